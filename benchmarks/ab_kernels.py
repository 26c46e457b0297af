"""Two builds of the fused CPU op timed against each other in one process: a git revision's ``csrc/dgc`` (A) against
the working tree's or a second revision's (B), on bench_kernels.py's gradient rows.

On a shared 2-core host the fused op's times move between levels from one process to the next (one build's dense
INT2 row took 25.6-38.2 ms across seven processes, results/kernels.md), so timing two builds in two processes says
little about a change of a few percent. Here both builds are compiled with the prebuilt op's flags (the op
builder's ``cxx_args()`` for a portable build) under two module names, loaded into one process and called in turn
on the same job; the order alternates from round to round (on such a host the second call of a round can be 15%
slower: two loads of one build gave a B/A of 1.16 on a row sent whole while B always ran second), and the figure
is the median of the rounds' B/A ratios. Both builds must produce the same bytes (the table says whether they did);
both run with this tree's Python side, so a revision whose binding takes other arguments cannot be compared.

Usage::

    python -m benchmarks.ab_kernels HEAD~1                  # HEAD~1's op (A) against the working tree's (B)
    python -m benchmarks.ab_kernels HEAD~3 HEAD --formats int4 int2 --densities 1 --rounds 30
"""

import argparse
import hashlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from unittest import mock

import torch

from benchmarks.bench_kernels import decode_fn, density_arg, keep_freed_memory, make_job, parse_size, timed
from deepspeed_dgc.codec.formats import VALUE_BITS, WEIGHT_QMAX
from deepspeed_dgc.codec.kernels import FusedCPUOps

ROOT = Path(__file__).resolve().parent.parent

SOURCE_DIR = "csrc/dgc"


def sources_of(rev: str | None, into: Path) -> Path:
    """The op's source directory of git revision ``rev`` extracted under ``into`` (the working tree's for None).

    Raises:
        subprocess.CalledProcessError: ``rev`` is not a revision of this repository.
    """
    if rev is None:
        return ROOT / SOURCE_DIR
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, SOURCE_DIR], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    return into / SOURCE_DIR


def build(src_dir: Path, label: str):
    """The CPU op compiled from ``src_dir`` with the prebuilt op's flags, as a module named after its sources'
    hash (a rebuild of the same sources reuses the build under ``build/ab_kernels``)."""
    from op_builder.dgc import PORTABLE_ENV, DGCCPUBuilder
    from torch.utils.cpp_extension import load

    builder = DGCCPUBuilder()
    with mock.patch.dict(os.environ, {PORTABLE_ENV: "1"}):  # the prebuilt op's flags (setup.py sets the same)
        flags = builder.strip_empty_entries(builder.cxx_args())
    digest = hashlib.sha256()
    for f in sorted(src_dir.iterdir()):
        digest.update(f.name.encode() + f.read_bytes())
    name = f"dgc_ab_{digest.hexdigest()[:12]}"
    out = ROOT / "build" / "ab_kernels" / name
    out.mkdir(parents=True, exist_ok=True)
    print(f"# {label}: {src_dir} -> module {name}", flush=True)
    # the CPU op's sources as that tree has them: one file before the split by stage, the builder's list after
    single = src_dir / "dgc_cpu.cpp"
    sources = [single] if single.exists() else [src_dir / f for f in builder.SOURCES]
    return load(name=name, sources=[str(f) for f in sources], extra_include_paths=[str(src_dir)],
                extra_cflags=flags, extra_ldflags=builder.extra_ldflags(), build_directory=str(out), verbose=False)


def timed_ab(fn_a, fn_b, clone, rounds: int) -> tuple:
    """Median ms of A's, B's and a clone's times over ``rounds`` rounds (A first in even rounds, B first in odd ones)
    and the median of the rounds' B/A ratios."""
    ta, tb, tc = [], [], []
    for k in range(rounds):
        if k % 2 == 0:
            a, b = timed(fn_a, "cpu"), timed(fn_b, "cpu")
        else:
            b, a = timed(fn_b, "cpu"), timed(fn_a, "cpu")
        ta.append(a)
        tb.append(b)
        tc.append(timed(clone, "cpu"))
    ms = {k: statistics.median(v) * 1e3 for k, v in (("a", ta), ("b", tb), ("clone", tc))}
    return ms, statistics.median(y / x for x, y in zip(ta, tb))


def compare(ops_a, ops_b, fmt: str, density: float, args) -> dict:
    """One compress row: the medians of A's, B's and a clone's times and of the rounds' B/A ratios, and whether A and
    B gave the same payload bytes and residual bits."""
    job = make_job(args.size, args.world, "cpu", args.seed, fmt, density)
    out_a, out_b = ops_a.compress(job), ops_b.compress(job)
    same = all(torch.equal(x, y) for x, y in zip(out_a.payloads, out_b.payloads)) and all(
        torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(out_a.residuals, out_b.residuals))
    ms, ratio = timed_ab(lambda: ops_a.compress(job), lambda: ops_b.compress(job), lambda: job.srcs[0].clone(),
                         args.rounds)
    return dict(stage="compress", format=fmt, density=density, ms=ms, b_over_a=ratio, same=same)


def compare_decode(ops_a, ops_b, fmt: str, density: float, args) -> dict:
    """One decode row: row 0's payload decoded and added into a dense row by A and by B (the same sums?)."""
    job = make_job(args.size, args.world, "cpu", args.seed, fmt, density)
    payload = ops_a.compress(job).payloads[0]
    (dec_a, out_a), (dec_b, out_b) = decode_fn(ops_a, job, payload), decode_fn(ops_b, job, payload)
    dec_a()
    dec_b()
    same = torch.equal(out_a, out_b)
    ms, ratio = timed_ab(dec_a, dec_b, lambda: job.srcs[0].clone(), args.rounds)
    return dict(stage="decode", format=fmt, density=density, ms=ms, b_over_a=ratio, same=same)


def compare_weights(ops_a, ops_b, wfmt: str, args) -> list:
    """Two rows: a shard of fp32 weights quantized, and its codes dequantized into bf16, by A and by B."""
    x = torch.randn(args.size, generator=torch.Generator().manual_seed(args.seed))
    qa, qb = ops_a.quantize_weights(x, wfmt, 128), ops_b.quantize_weights(x, wfmt, 128)
    outs = [torch.empty(args.size, dtype=torch.bfloat16) for _ in range(2)]
    ops_a.dequantize_weights_into(outs[0], *qa, wfmt, 128)
    ops_b.dequantize_weights_into(outs[1], *qa, wfmt, 128)
    same_q = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(qa, qb))
    same_d = torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))
    rows = []
    for stage, fa, fb, same in (
            ("quantize weights", lambda: ops_a.quantize_weights(x, wfmt, 128),
             lambda: ops_b.quantize_weights(x, wfmt, 128), same_q),
            ("dequantize weights", lambda: ops_a.dequantize_weights_into(outs[0], *qa, wfmt, 128),
             lambda: ops_b.dequantize_weights_into(outs[1], *qa, wfmt, 128), same_d)):
        ms, ratio = timed_ab(fa, fb, lambda: x.clone(), args.rounds)
        rows.append(dict(stage=stage, format=wfmt, density=None, ms=ms, b_over_a=ratio, same=same))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="git revision of build A")
    ap.add_argument("b", nargs="?", default=None, help="git revision of build B (default: the working tree)")
    ap.add_argument("--formats", nargs="+", choices=list(VALUE_BITS), default=list(VALUE_BITS))
    ap.add_argument("--densities", nargs="+", type=density_arg, default=[0.01, 1.0])
    ap.add_argument("--size", type=parse_size, default=parse_size("16M"), help="fp32 elements (default 16M)")
    ap.add_argument("--rounds", type=int, default=30, help="rounds per row, each calling A and B once (default 30)")
    ap.add_argument("--world", type=int, default=2, help="owners the tensor is split between (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", nargs="+", choices=["compress", "decode", "weights"],
                    default=["compress", "decode", "weights"], help="what to time (default all)")
    ap.add_argument("--weight-formats", nargs="+", choices=list(WEIGHT_QMAX), default=list(WEIGHT_QMAX))
    ap.add_argument("--default-allocator", action="store_true",
                    help="keep glibc's defaults (by default freed memory is kept for reuse, as bench_kernels.py's "
                    "--reuse-freed-memory)")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (the order alternates between rounds)")
    if not args.default_allocator and not keep_freed_memory():
        print("# could not keep freed memory (not glibc); timing with the default allocator", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            dirs = [sources_of(rev, Path(tmp) / side) for rev, side in ((args.a, "a"), (args.b, "b"))]
        except subprocess.CalledProcessError as e:
            ap.error(f"{' '.join(e.cmd[3:])}: {e.stderr.decode(errors='replace').strip()}")
        ops_a = FusedCPUOps(build(dirs[0], f"A ({args.a})"))
        ops_b = FusedCPUOps(build(dirs[1], f"B ({args.b or 'working tree'})"))
    print(f"# {args.size} elements, {args.world} owners, {torch.get_num_threads()} threads, {args.rounds} rounds, "
          "order alternating; ms are medians")
    print("| stage | format | density | A ms | B ms | clone ms | A / clone | B / clone | B / A (median of rounds) "
          "| same bytes |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")

    def rows():
        for fmt in args.formats:
            for density in args.densities:
                if "compress" in args.stages:
                    yield compare(ops_a, ops_b, fmt, density, args)
                if "decode" in args.stages:
                    yield compare_decode(ops_a, ops_b, fmt, density, args)
        if "weights" in args.stages:
            for wfmt in args.weight_formats:
                yield from compare_weights(ops_a, ops_b, wfmt, args)

    for row in rows():
        ms = row["ms"]
        density = "" if row["density"] is None else f"{row['density']:g}"
        print(f"| {row['stage']} | {row['format']} | {density} | {ms['a']:.2f} | {ms['b']:.2f} | {ms['clone']:.2f} | "
              f"{ms['a'] / ms['clone']:.2f}x | {ms['b'] / ms['clone']:.2f}x | {row['b_over_a']:.3f} | "
              f"{'yes' if row['same'] else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
