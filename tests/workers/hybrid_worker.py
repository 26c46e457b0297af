"""Worker: the main job's model (CharGPT on the shipped text) trained through HybridTrainer.

Usage: hybrid_worker.py --out DIR. 30 steps, 2 ranks; writes OUT_DIR/rank<r>.pt with the losses, the
engine's "dgc" config and the telemetry totals.

A standalone script, not a scenario of tests/workers/scenarios: it models a user's own script, training only through
HybridTrainer's public API (``init_model``, ``train_step``), as the main job's script would.
"""

import argparse
import sys

import torch

import deepspeed_dgc
from common import finish, init
from deepspeed_dgc import HybridTrainer
from examples.train_char_gpt import CharGPT, get_batch, load_data


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    out_dir = ap.parse_args(argv).out
    rank = init()
    train, _, vocab = load_data()
    torch.manual_seed(0)
    model = CharGPT(vocab, block_size=32, n_layer=1, n_embd=64, n_head=4)
    trainer = HybridTrainer(precision_policy="int4", topology="flat", sparse_threshold=0.1,
                            train_micro_batch_size_per_gpu=16,
                            optimizer={"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}},
                            zero_optimization={"reduce_bucket_size": 500000},
                            dgc={"min_numel": 2048})
    engine = trainer.init_model(model)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = [trainer.train_step(get_batch(train, 16, 32, gen), lambda m, b: m(b[0], b[1])) for _ in range(30)]
    stats = deepspeed_dgc.get_stats(engine)
    torch.save(dict(losses=losses, dgc=engine.config["dgc"], stats=stats.to_dict()), f"{out_dir}/rank{rank}.pt")
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
