"""Worker: README.md's quick start as written: its ds_config and its Python, on a small model, then a few steps.

Usage: readme_worker.py --out DIR. Writes DIR/rank<r>.json with the losses, the gradients' compression ratio and
what the README's ``print`` printed.

A standalone script on purpose, not a scenario of tests/workers/scenarios: it models a user's own script, running the
README's code as written, with nothing of the test scenarios around it.
"""

import argparse
import contextlib
import io
import json
import os
import re

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def quick_start():
    """The ``json`` and ``python`` blocks of README.md's "Quick start" section."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Quick start"):]
    section = section[:section.index("\n## ", 1)]
    return (re.search(r"```json\n(.*?)```", section, re.S).group(1),
            re.search(r"```python\n(.*?)```", section, re.S).group(1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    out_dir = ap.parse_args(argv).out
    config, code = quick_start()
    rank = int(os.environ["RANK"])
    os.chdir(out_dir)
    if rank == 0:
        with open("ds_config.json", "w") as f:
            f.write(config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    while not os.path.exists("ds_config.json"):  # rank 0 writes it; the README reads it by that name
        pass
    printed = io.StringIO()
    scope = {"model": model}
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md quick start", "exec"), scope)
    engine = scope["engine"]
    gen = torch.Generator().manual_seed(rank)
    w = torch.randn(64, 1, generator=torch.Generator().manual_seed(7))
    x = torch.randn(16, 64, generator=gen)  # one batch per rank, fitted for a few steps
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.mse_loss(engine(x), x @ w)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    stats = scope["deepspeed_dgc"].get_stats(engine)
    with open(f"rank{rank}.json", "w") as f:
        json.dump({"losses": losses, "ratio": stats.compression_ratio, "printed": printed.getvalue()}, f)
    from common import finish

    finish()


if __name__ == "__main__":
    main()
