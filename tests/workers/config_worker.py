"""Worker: initialize (and take one step) with each config of a list; record the error each raised, or None.

Usage: config_worker.py --out DIR --cases FILE. FILE is JSON: ``{name: case}`` where a case holds
  "config"          merged into scenarios.model.BASE (a ``null`` removes a key);
  "rank1_config"    merged on top on rank 1 only (ranks that disagree);
  "rank1_version"   the deepspeed_dgc version rank 1 reports;
  "hide_mpi4py"     ``import mpi4py`` fails, as if not installed;
  "hide_fused_op_on_rank"   on that rank: no loaded or prebuilt op, no compiler;
  "allow_fp16"      DeepSpeed's CPU accelerator accepts fp16 (so our check is what refuses);
  "step"            run one optimizer step after initialize (errors of the first exchange).
Cases run one after another in the same processes. Writes DIR/rank<r>.pt: {name: "ErrorType: message" or None}.
"""

import argparse
import json
import os
import sys

import torch
from deepspeed.accelerator import get_accelerator

import deepspeed_dgc._version
from common import finish, init
from scenarios.model import BASE, batches, make_engine, merge


def hide_fused_op():
    """On this rank only: no loaded op, no prebuilt op, no compiler (the fused op cannot load)."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    from op_builder.dgc import DGCCPUBuilder
    import deepspeed_dgc.codec.kernels as kernels
    OpBuilder._loaded_ops.pop(DGCCPUBuilder.NAME, None)
    DGCCPUBuilder.prebuilt_module = lambda self: None
    os.environ["CXX"] = "/nonexistent/c++"
    kernels._warned.clear()
    kernels._LOAD_FAILURES.clear()


def run_case(case, rank):
    cfg = merge(BASE, case.get("config", {}))
    if rank == 1:
        cfg = merge(cfg, case.get("rank1_config", {}))
        if "rank1_version" in case:
            deepspeed_dgc._version.__version__ = case["rank1_version"]
    hidden = {m: sys.modules.pop(m, None) for m in ("mpi4py", "mpi4py.MPI")} if case.get("hide_mpi4py") else {}
    if hidden:
        sys.modules["mpi4py"] = None  # import mpi4py now raises ImportError, as if not installed
    if case.get("hide_fused_op_on_rank") == rank:
        hide_fused_op()
    if case.get("allow_fp16"):
        get_accelerator().is_fp16_supported = lambda: True
    try:
        engine = make_engine(cfg)
        if case.get("step"):
            (x, y), = batches(rank, 1, 1, torch.float32)[0]
            engine.backward(engine(x, y))
            engine.step()
        return None
    except Exception as err:  # record whatever was raised; the test checks the type and the text
        return f"{type(err).__name__}: {err}"
    finally:
        for m, module in hidden.items():
            sys.modules.pop(m, None)
            if module is not None:
                sys.modules[m] = module


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True)
    args = ap.parse_args(argv)
    rank = init()
    with open(args.cases) as f:
        cases = json.load(f)
    version = deepspeed_dgc._version.__version__
    messages = {}
    for name, case in cases.items():
        messages[name] = run_case(case, rank)
        deepspeed_dgc._version.__version__ = version
    torch.save(messages, f"{args.out}/rank{rank}.pt")
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
