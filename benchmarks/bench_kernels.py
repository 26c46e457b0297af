"""Time the compression kernels: PyTorch reference vs fused op, decode, and torch.clone.

For each size n (fp32 elements) one rank's bucket of one tensor, split between ``--world`` owners,
density 0.01, INT4 (group 128), with an error-feedback residual, is compressed by the reference
path and by the fused op (same threshold sample, so both must give the same bytes; the table says
whether they did), one owner's payload is decoded and scatter-added into a dense fp32 row, and the
same input buffer is cloned. "reused" rows compress the same bucket with the threshold the fused op
just estimated, as ``threshold_reuse_steps`` does between estimates (no sample, no counting rounds).
Every timing is the median of ``--repeats`` runs, the variants interleaved in each repeat. GB/s counts
the fp32 input bytes (4 n) per second.

Usage::

    python benchmarks/bench_kernels.py [--device cpu|cuda] [--sizes 1M 4M 16M 64M] [--repeats 5] [--json PATH]
"""

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from deepspeed_dgc.codec import wire
from deepspeed_dgc.codec.job import CompressJob
from deepspeed_dgc.codec.kernels import get_ops
from deepspeed_dgc.codec.reference import REFERENCE
from deepspeed_dgc.codec.selection import draw_samples


def parse_size(text: str) -> int:
    """``"16M"`` -> 16777216 (K, M, G are powers of 1024); at least 1024 elements."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        n = int(float(text[:-1]) * mult[text[-1].upper()]) if text[-1].upper() in mult else int(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"size {text!r}: give elements like 1048576, 4M or 512K") from None
    if n < 1024:
        raise argparse.ArgumentTypeError(f"size {text!r}: at least 1024 elements")
    return n


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive integer is needed")
    return v


def make_job(n: int, world: int, device: str, seed: int) -> CompressJob:
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=gen).to(device)
    residual = (torch.randn(n, generator=gen) * 0.01).to(device)
    c = -(-n // world)
    job = CompressJob(srcs=[grad], offsets=[0], row_strides=[c], numels=[n], chunks=[c], sparse=[True],
                      row_owner=list(range(world)), residuals=[residual], residual_numels=[n], divisor=float(world),
                      density=0.01, samples=[], group_size=128, quantize=True,
                      value_dtype=torch.float32, fingerprint=1, want_residual=True)
    job.samples = draw_samples([n], [True], 0.01, torch.Generator(device=device).manual_seed(seed), device)
    return job


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def decode_fn(ops, job, payload):
    """Decoding row 0's payload and adding it into a dense fp32 row, as a receiver does."""
    layout = job.row_layout(0)
    body = wire.parse(payload, 0, layout)
    out = torch.zeros(layout.row_numel, dtype=torch.float32, device=payload.device)
    return lambda: ops.decode_add(out, body, layout)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.payloads, b.payloads)) and all(
        torch.equal(x, y) for x, y in zip(a.residuals, b.residuals))


def bench(n: int, args, fused) -> dict:
    job = make_job(n, args.world, args.device, args.seed)
    ref_out = REFERENCE.compress(job)
    fused_out = fused.compress(job)
    reuse = make_job(n, args.world, args.device, args.seed)
    reuse.reuse_thresholds, reuse.samples = list(fused_out.thresholds), [None]
    same = all(_same(ops_a.compress(a), ops_b.compress(b))
               for ops_a, a, ops_b, b in ((REFERENCE, job, fused, job), (REFERENCE, reuse, fused, reuse)))
    times = {"reference": [], "fused": [], "reference_reused": [], "fused_reused": [], "decode": [], "clone": []}
    dec = decode_fn(fused, job, fused_out.payloads[0])
    src = job.srcs[0]
    for _ in range(args.repeats):
        times["reference"].append(timed(lambda: REFERENCE.compress(job), args.device))
        times["fused"].append(timed(lambda: fused.compress(job), args.device))
        times["reference_reused"].append(timed(lambda: REFERENCE.compress(reuse), args.device))
        times["fused_reused"].append(timed(lambda: fused.compress(reuse), args.device))
        times["decode"].append(timed(dec, args.device))
        times["clone"].append(timed(lambda: src.clone(), args.device))
    med = {k: statistics.median(v) for k, v in times.items()}
    gbs = {k: 4 * n / v / 1e9 for k, v in med.items()}
    return dict(n=n, kept=fused_out.kept, payload_bytes=sum(p.numel() for p in fused_out.payloads),
                same_bytes=bool(same), ms={k: v * 1e3 for k, v in med.items()}, gb_per_s=gbs,
                fused_speedup_vs_reference=med["reference"] / med["fused"], fused_vs_clone=med["fused"] / med["clone"],
                decode_vs_clone=med["decode"] / med["clone"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sizes", nargs="+", type=parse_size, default=["1M", "4M", "16M", "64M"],
                    help="fp32 elements per size: 1048576, 4M, 512K (at least 1024)")
    ap.add_argument("--world", type=positive_int, default=2, help="owner rows of the bucket (ranks)")
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_kernels: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    fused = get_ops("fused", args.device, True)
    rows = []
    for size in args.sizes:
        rows.append(bench(size if isinstance(size, int) else parse_size(size), args, fused))
    machine = dict(device=args.device, threads=torch.get_num_threads(), cpu=platform.processor() or platform.machine(),
                   torch=torch.__version__, simd=getattr(fused.op, "simd_info", lambda: "n/a")(),
                   gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)
    print(f"# bench_kernels: {args.device}, {machine['threads']} threads, density 0.01, INT4 group 128, "
          f"{args.world} owners, median of {args.repeats}")
    print("| n | reference ms | fused ms | reference reused ms | fused reused ms | decode ms | clone ms | fused GB/s "
          "| clone GB/s | fused speed-up | fused / clone | same bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms, gbs = r["ms"], r["gb_per_s"]
        print(f"| {r['n'] / (1 << 20):.4g}M | {ms['reference']:.2f} | {ms['fused']:.2f} | {ms['reference_reused']:.2f} "
              f"| {ms['fused_reused']:.2f} | {ms['decode']:.3f} | {ms['clone']:.2f} | {gbs['fused']:.2f} "
              f"| {gbs['clone']:.2f} | {r['fused_speedup_vs_reference']:.1f}x | {r['fused_vs_clone']:.2f}x "
              f"| {'yes' if r['same_bytes'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine, args=vars(args), rows=rows), f, indent=1)
    return 0 if all(r["same_bytes"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
