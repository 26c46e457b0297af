"""Time the compression kernels: PyTorch reference vs fused op, per value format, decode, weight codes, torch.clone.

Gradients: for each value format, density and size n (fp32 elements), one rank's bucket of one tensor, split
between ``--world`` owners, with an error-feedback residual (group 128), is compressed by the reference path and
by the fused op (same threshold sample, so both must give the same bytes; the table says whether they did). One
owner's payload is decoded and scatter-added into a dense fp32 row by each, and the same input buffer is cloned.
"reused" rows (sparse densities only) compress the same bucket with the threshold the fused op just estimated, as
``threshold_reuse_steps`` does between estimates (no sample, no counting rounds).

Weights: for each weight format (the quantized all-gather's INT8 / FP8 e4m3 / INT4; fp8 residual storage is FP8
e4m3 in groups of 128) a shard of n fp32 weights is quantized and dequantized into a bf16 buffer by each.

Every timing is the median of ``--repeats`` runs, the variants interleaved in each repeat. GB/s counts the fp32
input bytes (4 n) per second. With glibc's defaults (what a CPU training process has) every output of 32 MB or more
is a fresh mapping whose pages fault in as they are first written, for the clone as for the fused op's new
residual; ``--reuse-freed-memory`` keeps freed memory for reuse instead (``mallopt``: no mmap or trim under 1 GiB),
as a caching allocator does on a GPU, so that the clone is the memory-bandwidth floor and the fused op's own
compute shows.

Usage::

    python -m benchmarks.bench_kernels [--device cpu|cuda] [--sizes 1M 4M 16M] [--formats int4 int2 ...]
        [--densities 0.01 1] [--weight-formats int8 fp8_e4m3 int4] [--repeats 5] [--json PATH]
"""

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time

import torch

from deepspeed_dgc.codec import wire
from deepspeed_dgc.codec.formats import VALUE_BITS, WEIGHT_QMAX
from deepspeed_dgc.codec.job import CompressJob
from deepspeed_dgc.codec.kernels import get_ops
from deepspeed_dgc.codec.reference import REFERENCE
from deepspeed_dgc.codec.selection import draw_samples


def size_label(n: int) -> str:
    """16777216 -> "16M", 524288 -> "512K", other counts as they are."""
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


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


def density_arg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"density {text!r}: a number in (0, 1] is needed")
    return v


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive integer is needed")
    return v


def make_job(n: int, world: int, device: str, seed: int, fmt: str = "int4", density: float = 0.01) -> CompressJob:
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=gen).to(device)
    residual = (torch.randn(n, generator=gen) * 0.01).to(device)
    c = -(-n // world)
    sparse = density < 1
    job = CompressJob(srcs=[grad], offsets=[0], row_strides=[c], numels=[n], chunks=[c], sparse=[sparse],
                      row_owner=list(range(world)), residuals=[residual], residual_numels=[n], divisor=float(world),
                      density=density, samples=[], group_size=128, quantize=True,
                      value_dtype=torch.float32, fingerprint=1, want_residual=True, value_format=fmt)
    job.samples = draw_samples([n], [sparse], density, torch.Generator(device=device).manual_seed(seed), device)
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
    """Decoding row 0's payload and adding it into a dense fp32 row, as a receiver does; and that row."""
    layout = job.row_layout(0)
    body = wire.parse(payload, 0, layout)
    out = torch.zeros(layout.row_numel, dtype=torch.float32, device=payload.device)
    return (lambda: ops.decode_add(out, body, layout)), out


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.payloads, b.payloads)) and all(
        torch.equal(x, y) for x, y in zip(a.residuals, b.residuals))


def bench(n: int, fmt: str, density: float, args, fused) -> dict:
    """One row of the gradient table: compress and decode by each implementation, and a clone."""
    job = make_job(n, args.world, args.device, args.seed, fmt, density)
    ref_out = REFERENCE.compress(job)
    fused_out = fused.compress(job)
    sparse = density < 1
    pairs = [(job, job)]
    if sparse:  # the thresholds just estimated (reported when the job takes part in reuse)
        est = make_job(n, args.world, args.device, args.seed, fmt, density)
        est.reuse_thresholds = [None]
        reuse = make_job(n, args.world, args.device, args.seed, fmt, density)
        reuse.reuse_thresholds, reuse.samples = list(fused.compress(est).thresholds), [None]
        assert all(t is not None for t in reuse.reuse_thresholds)
        pairs.append((reuse, reuse))
    same = _same(ref_out, fused_out) and all(_same(REFERENCE.compress(a), fused.compress(b)) for a, b in pairs[1:])
    dec_ref, out_ref = decode_fn(REFERENCE, job, ref_out.payloads[0])
    dec_fused, out_fused = decode_fn(fused, job, ref_out.payloads[0])
    dec_ref()
    dec_fused()
    same = same and torch.equal(out_ref, out_fused)
    variants = {"reference": lambda: REFERENCE.compress(job), "fused": lambda: fused.compress(job)}
    if sparse:
        variants.update(reference_reused=lambda: REFERENCE.compress(reuse), fused_reused=lambda: fused.compress(reuse))
    src = job.srcs[0]
    variants.update(decode_reference=dec_ref, decode_fused=dec_fused, clone=lambda: src.clone())
    med = interleaved(variants, args)
    gbs = {k: 4 * n / v / 1e9 for k, v in med.items()}
    return dict(kind="gradients", format=fmt, density=density, n=n, kept=fused_out.kept,
                payload_bytes=sum(p.numel() for p in fused_out.payloads), same_bytes=bool(same),
                ms={k: v * 1e3 for k, v in med.items()}, gb_per_s=gbs,
                fused_speedup_vs_reference=med["reference"] / med["fused"], fused_vs_clone=med["fused"] / med["clone"],
                decode_speedup=med["decode_reference"] / med["decode_fused"])


def interleaved(variants: dict, args) -> dict:
    """Median seconds of each variant over ``args.repeats`` rounds, every round running each variant once."""
    times = {k: [] for k in variants}
    for _ in range(args.repeats):
        for k, fn in variants.items():
            times[k].append(timed(fn, args.device))
    return {k: statistics.median(v) for k, v in times.items()}


def bench_weights(n: int, fmt: str, args, fused) -> dict:
    """One row of the weight table: quantize a shard of n fp32 weights, dequantize into bf16, by each; and a clone."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(args.seed)).to(args.device)
    ref = REFERENCE.quantize_weights(x, fmt, 128)
    got = fused.quantize_weights(x, fmt, 128)
    outs = [torch.empty(n, dtype=torch.bfloat16, device=args.device) for _ in range(2)]
    REFERENCE.dequantize_weights_into(outs[0], *ref, fmt, 128)
    fused.dequantize_weights_into(outs[1], *ref, fmt, 128)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ref, got))
    same = same and torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))
    med = interleaved({"quantize_reference": lambda: REFERENCE.quantize_weights(x, fmt, 128),
                       "quantize_fused": lambda: fused.quantize_weights(x, fmt, 128),
                       "dequantize_reference": lambda: REFERENCE.dequantize_weights_into(outs[0], *ref, fmt, 128),
                       "dequantize_fused": lambda: fused.dequantize_weights_into(outs[1], *ref, fmt, 128),
                       "clone": lambda: x.clone()}, args)
    return dict(kind="weights", format=fmt, n=n, same_bytes=bool(same), ms={k: v * 1e3 for k, v in med.items()},
                gb_per_s={k: 4 * n / v / 1e9 for k, v in med.items()},
                quantize_speedup=med["quantize_reference"] / med["quantize_fused"],
                dequantize_speedup=med["dequantize_reference"] / med["dequantize_fused"],
                quantize_vs_clone=med["quantize_fused"] / med["clone"],
                dequantize_vs_clone=med["dequantize_fused"] / med["clone"])


def keep_freed_memory() -> bool:
    """glibc only: serve large blocks from the heap and keep freed memory (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD at 1 GiB);
    whether it applied."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sizes", nargs="+", type=parse_size, default=["1M", "4M", "16M"],
                    help="fp32 elements per size: 1048576, 4M, 512K (at least 1024)")
    ap.add_argument("--formats", nargs="+", choices=list(VALUE_BITS), default=list(VALUE_BITS),
                    help="value formats of the gradient rows")
    ap.add_argument("--densities", nargs="+", type=density_arg, default=[0.01, 1.0],
                    help="top-k densities of the gradient rows (1: sent whole, no positions)")
    ap.add_argument("--weight-formats", nargs="*", choices=list(WEIGHT_QMAX), default=list(WEIGHT_QMAX),
                    help="weight formats of the weight rows (none: no weight rows)")
    ap.add_argument("--world", type=positive_int, default=2, help="owner rows of the bucket (ranks)")
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--reuse-freed-memory", action="store_true",
                    help="glibc keeps freed memory for reuse (no fresh pages for large outputs, as a caching allocator)")
    args = ap.parse_args(argv)
    sizes = [size if isinstance(size, int) else parse_size(size) for size in args.sizes]
    if args.world > min(sizes):
        ap.error(f"--world {args.world}: more owner rows than the smallest size's {min(sizes)} elements")
    json_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else None
    if json_dir and not os.path.isdir(json_dir):
        ap.error(f"--json {args.json}: no directory {json_dir!r} to write it in")
    warm = args.reuse_freed_memory and args.device == "cpu" and keep_freed_memory()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_kernels: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    fused = get_ops("fused", args.device, True)
    rows = [bench(n, fmt, d, args, fused) for d in args.densities for fmt in args.formats for n in sizes]
    wrows = [bench_weights(n, fmt, args, fused) for fmt in args.weight_formats for n in sizes]
    machine = dict(device=args.device, threads=torch.get_num_threads(), cpu=platform.processor() or platform.machine(),
                   torch=torch.__version__, simd=getattr(fused.op, "simd_info", lambda: "n/a")(), warm_allocator=warm,
                   gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)
    print(f"# bench_kernels: {args.device}, {machine['threads']} threads, group 128, {args.world} owners, "
          f"median of {args.repeats}, {'freed memory reused' if warm else 'fresh pages'}")
    print("| format | density | n | reference ms | fused ms | fused reused ms | decode ref ms | decode fused ms "
          "| clone ms | fused GB/s | fused speed-up | fused / clone | decode speed-up | same bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms, gbs = r["ms"], r["gb_per_s"]
        reused = f"{ms['fused_reused']:.2f}" if "fused_reused" in ms else "-"
        print(f"| {r['format']} | {r['density']:g} | {size_label(r['n'])} | {ms['reference']:.2f} "
              f"| {ms['fused']:.2f} | {reused} | {ms['decode_reference']:.2f} | {ms['decode_fused']:.2f} "
              f"| {ms['clone']:.2f} | {gbs['fused']:.2f} | {r['fused_speedup_vs_reference']:.1f}x "
              f"| {r['fused_vs_clone']:.2f}x | {r['decode_speedup']:.1f}x | {'yes' if r['same_bytes'] else 'NO'} |")
    if wrows:
        print()
        print("| weights | n | quantize ref ms | quantize fused ms | dequantize ref ms | dequantize fused ms | clone ms "
              "| quantize speed-up | dequantize speed-up | quantize / clone | dequantize / clone | same bytes |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in wrows:
            ms = r["ms"]
            print(f"| {r['format']} | {size_label(r['n'])} | {ms['quantize_reference']:.2f} "
                  f"| {ms['quantize_fused']:.2f} | {ms['dequantize_reference']:.2f} | {ms['dequantize_fused']:.2f} "
                  f"| {ms['clone']:.2f} | {r['quantize_speedup']:.1f}x | {r['dequantize_speedup']:.1f}x "
                  f"| {r['quantize_vs_clone']:.2f}x | {r['dequantize_vs_clone']:.2f}x "
                  f"| {'yes' if r['same_bytes'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine, args=vars(args), rows=rows, weight_rows=wrows), f, indent=1)
    return 0 if all(r["same_bytes"] for r in rows + wrows) else 1


if __name__ == "__main__":
    sys.exit(main())
