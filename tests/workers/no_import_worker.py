"""Worker: a training script that never imports deepspeed_dgc, with a "dgc" section in its config.

Usage: no_import_worker.py --out DIR. Trains a copy of scenarios.model's Net 3 steps (DGC at density 0.1, INT4) with
only ``deepspeed`` imported, then records whether deepspeed_dgc was loaded (by the start-up hook that installing the
package adds) and, if so, its telemetry. Writes DIR/rank<r>.pt.

A standalone script on purpose, not a scenario of tests/workers/scenarios: it models a user's own script, and must not
import deepspeed_dgc at all (the scenarios package does).
"""

import argparse
import sys

import torch

from common import finish, init

import deepspeed  # noqa: E402 -- and nothing of deepspeed_dgc


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(24, 101)
        self.l2 = torch.nn.Linear(101, 37)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.l2(torch.nn.functional.gelu(self.l1(x))), y)


CONFIG = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
          "zero_optimization": {"stage": 3}, "steps_per_print": 1000000,
          "dgc": {"enabled": True, "density": 0.1, "min_numel": 256}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rank = init()
    loaded_before = "deepspeed_dgc" in sys.modules
    torch.manual_seed(0)
    model = Net()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 24, generator=gen), torch.randn(4, 37, generator=gen)))
        engine.step()
    dgc = sys.modules.get("deepspeed_dgc")
    stats = None if dgc is None or dgc.get_stats(engine) is None else dgc.get_stats(engine).to_dict()
    torch.save(dict(loaded_before=loaded_before, loaded_after=dgc is not None, stats=stats), f"{args.out}/rank{rank}.pt")
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
