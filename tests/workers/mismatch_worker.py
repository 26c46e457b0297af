"""Worker: the compressed reduce-scatter with a bucket whose last tensor has another size on rank 1 (another model).

Usage: mismatch_worker.py --out DIR [--layout fixed|exact]. Writes DIR/rank<r>.pt: {"error": "Type: message"} or
{"error": None}.
"""

import argparse
import sys

import torch

from common import finish, init

from deepspeed_dgc.config import DGCConfig
from deepspeed_dgc.memory.error_feedback import ErrorFeedback
from deepspeed_dgc.zero3.reduce_scatter import CompressedReduceScatter


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", default="fixed")
    args = ap.parse_args(argv)
    rank = init()
    cfg = DGCConfig(enabled=True, density=0.1, min_numel=0, layout=args.layout, timeout_s=30.0)
    reducer = CompressedReduceScatter(cfg, ErrorFeedback("fp32"), seed=rank)
    sizes = [300, 5000 if rank == 0 else 7000]
    error = None
    try:
        reducer.reduce_scatter([torch.randn(n) for n in sizes], [0, 1], None, torch.float32)
    except Exception as err:  # noqa: BLE001 -- the test checks which
        error = f"{type(err).__name__}: {err}"
    torch.save({"error": error}, f"{args.out}/rank{rank}.pt")
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
