"""How well DGC's threshold sample estimates the top-k threshold on real gradients: independent positions against
runs of contiguous positions (``deepspeed_dgc.codec.selection.sample_indices``).

Run from the repository root::

    python -m benchmarks.study_threshold_sample --n-embd 512 --density 0.1
    python -m benchmarks.study_threshold_sample --n-embd 768 --density 0.01

One process, no DeepSpeed: the examples' char GPT (``examples/train_char_gpt.py``'s model, 4 layers) trained on the
shipped Shakespeare text with Adam for ``--steps`` steps, each parameter's gradient plus its error-feedback residual
(the accumulator) sparsified by DGC's top-k (``topk_threshold`` on the current sample) and the rest carried to the
next step. At ``--at`` steps, for every tensor of ``--min-numel`` elements or more, ``--draws`` samples of each kind
give a threshold each (the ``ceil(s k / m)``-th largest sampled magnitude, before DGC's corrections), and the figure
is the count that threshold keeps over k. Kinds: ``iid`` (DGC's independent positions: ``torch.randint``), ``runs``
(``sample_indices``: runs of 16 from 2^21 elements, independent positions below), and for contrast, on every tensor:
``runs16`` and ``runs64`` (runs of 16 or 64 from uniform multiples of the length), ``strat16``, ``strat32`` and
``strat64`` (stratified: the multiples split into as many equal strata as there are runs, one run drawn in each).
Printed per kind and per run length L that ``sample_indices`` uses for the tensor: draws, mean, standard deviation,
1st and 99th percentile, and the share outside DGC's [0.8, 1.3] band (where its correction rounds would run).
"""

import argparse
import math
import sys

import torch

from deepspeed_dgc.codec.selection import (MIN_SAMPLE, run_length, sample_indices, sample_size, target_count,
                                           topk_threshold)
from examples import train_char_gpt as gpt


def runs_of(m: int, length: int, gen: torch.Generator, stratified: bool = False) -> torch.Tensor:
    """``sample_size(m) // length`` runs of ``length`` positions from multiples of ``length``: uniform (with
    replacement), or one from each of as many equal strata of the multiples (``stratified``)."""
    n_runs, slots = sample_size(m) // length, m // length
    if stratified:
        lo = torch.arange(n_runs) * slots // n_runs
        hi = (torch.arange(n_runs) + 1) * slots // n_runs
        starts = lo + (torch.rand(n_runs, dtype=torch.float64, generator=gen) * (hi - lo)).long()
    else:
        starts = torch.randint(0, slots, (n_runs, ), generator=gen)
    return (starts[:, None] * length + torch.arange(length)).reshape(-1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--at", type=int, nargs="+", default=[2, 10, 30, 60], help="steps at which samples are drawn")
    ap.add_argument("--draws", type=int, default=30, help="samples of each kind per tensor and step")
    ap.add_argument("--min-numel", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    train, _, vocab = gpt.load_data()
    model = gpt.CharGPT(vocab, 64, 4, args.n_embd, 8)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(args.seed + 1)
    residual = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    ratios = {}
    for step in range(1, args.steps + 1):
        x, y = gpt.get_batch(train, 16, 64, gen)
        opt.zero_grad()
        model(x, y).backward()
        for name, p in model.named_parameters():
            acc = p.grad.reshape(-1) + residual[name].reshape(-1)
            m = acc.numel()
            if m <= MIN_SAMPLE:
                continue
            mag, k = acc.abs(), target_count(m, args.density)
            if step in args.at and m >= args.min_numel:
                length = run_length(m)
                draw = {"iid": lambda: torch.randint(0, m, (sample_size(m), ), generator=gen),
                        "runs": lambda: sample_indices(m, k, gen), "runs16": lambda: runs_of(m, 16, gen),
                        "runs64": lambda: runs_of(m, 64, gen), "strat16": lambda: runs_of(m, 16, gen, True),
                        "strat32": lambda: runs_of(m, 32, gen, True), "strat64": lambda: runs_of(m, 64, gen, True)}
                for kind, sample in draw.items():
                    for _ in range(args.draws):
                        s = sample()
                        threshold = torch.topk(mag[s], max(1, math.ceil(s.numel() * k / m))).values.min()
                        ratios.setdefault((kind, length), []).append(int((mag >= threshold).sum()) / k)
            keep = mag >= topk_threshold(mag, k, sample_indices(m, k, gen))
            p.grad.copy_((acc * keep).view_as(p))
            residual[name].copy_((acc * ~keep).view_as(p))
        opt.step()
    print(f"n_embd {args.n_embd}, density {args.density}: kept count of the sample's threshold / k")
    print("| kind | L | draws | mean | sd | p1 | p99 | outside [0.8, 1.3] |\n|---|---|---|---|---|---|---|---|")
    for (kind, length), v in sorted(ratios.items()):
        t = torch.tensor(v, dtype=torch.float64)
        p1, p99 = torch.quantile(t, torch.tensor([0.01, 0.99], dtype=torch.float64)).tolist()
        out = float(((t < 0.8) | (t > 1.3)).double().mean())
        print(f"| {kind} | {length} | {t.numel()} | {t.mean():.3f} | {t.std():.3f} | {p1:.3f} | {p99:.3f} "
              f"| {out:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
