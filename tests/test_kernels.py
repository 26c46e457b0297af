"""The fused ops against the PyTorch reference, the builds (JIT, prebuilt, nvcc), and dispatch.

- the fused CPU op gives the same payload bytes, the same residual bits and the same kept count as
  the reference on random buckets of odd sizes: flat and hierarchical layouts, fp32/bf16/fp16
  sources, loss scale 1 and 1024, with and without residual, 1-3 owner rows, and samples crafted to
  force DGC's lowering rounds and its exact top-k step; a NaN makes both send nothing;
- decoding gives the same sums bit for bit, and malformed bodies raise ValueError in both;
- every .cu file compiles with nvcc for sm_80 and sm_90 against the installed torch headers;
- the JIT path and the prebuilt path (setup.py with DS_BUILD_DGC=1) both load and compute the same;
- ``kernels: "fused"`` without a compiler fails naming the cause; ``"auto"`` falls back with a warning.
"""

import glob
import os
import shutil
import subprocess
import sys
import types
import zlib

import pytest
import torch

from deepspeed_dgc.compressor import topk_threshold
from deepspeed_dgc.kernels import (REFERENCE, CompressJob, DGCKernelError, FusedCPUOps, draw_samples, get_ops,
                                   load_fused_op)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def fused():
    return FusedCPUOps(load_fused_op("cpu"))


def _job(numels, rows, *, hierarchical=False, dtype=torch.float32, residual=True, loss_scale=1.0, density=0.05,
         seed=0, group_size=16, min_numel=64, samples=None):
    """A random bucket; hierarchical: sources are columns of one (rows, C) node-sum matrix."""
    g = torch.Generator().manual_seed(seed)
    world = 2 * rows if hierarchical else rows
    chunks = [-(-n // world) for n in numels]
    sparse = [n >= min_numel for n in numels]
    scales = [10.0**int(torch.randint(-3, 3, (1, ), generator=g)) for _ in numels]
    if hierarchical:
        owners = [2 * k + 1 for k in range(rows)]  # local rank 1 of each node
        C = sum(chunks)
        node_sum = torch.randn(rows, C, generator=g)
        col = 0
        for n, c in zip(numels, chunks):  # padding of the node sum is 0
            real = torch.tensor([max(0, min(c, n - o * c)) for o in owners])[:, None] > torch.arange(c)
            node_sum[:, col:col + c] = torch.where(real, node_sum[:, col:col + c], 0.0)  # +0, as the reducer's
            col += c
        srcs = [node_sum.view(-1).to(dtype)] * len(numels)
        offsets = [sum(chunks[:i]) for i in range(len(chunks))]
        strides = [C] * len(numels)
        res_numels = [rows * c for c in chunks]
        divisor = 1.0
    else:
        owners = list(range(rows))
        srcs = [(torch.randn(n, generator=g) * s).to(dtype) for n, s in zip(numels, scales)]
        offsets, strides, res_numels, divisor = [0] * len(numels), chunks, list(numels), float(rows)
    residuals = [torch.randn(rn, generator=g) * 0.1 if residual else None for rn in res_numels]
    if hierarchical and residual:
        for r, n, c in zip(residuals, numels, chunks):  # padding of a residual stays 0
            real = (torch.tensor([max(0, min(c, n - o * c)) for o in owners])[:, None] > torch.arange(c)).view(-1)
            r.copy_(torch.where(real, r, 0.0))
    job = CompressJob(srcs, offsets, strides, list(numels), chunks, sparse, owners, residuals, res_numels, divisor,
                      loss_scale, density, [], group_size, True, torch.float32, 1234, residual)
    reals = [sum(job.real_counts(i)) for i in range(len(numels))]
    job.samples = samples(job) if samples else draw_samples(reals, sparse, density,
                                                            torch.Generator().manual_seed(seed + 1), "cpu")
    return job


def _assert_same(a, b):
    assert (a.finite, a.kept) == (b.finite, b.kept)
    assert len(a.payloads) == len(b.payloads)
    for x, y in zip(a.payloads, b.payloads):
        assert x.dtype == y.dtype == torch.uint8 and torch.equal(x, y)
    assert (a.residuals is None) == (b.residuals is None)
    for x, y in zip(a.residuals or [], b.residuals or []):
        assert x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))  # bits, signed zeros too


SIZES = [[1], [3, 70, 1001], [5, 3000, 2, 65537, 64]]


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("numels", SIZES)
def test_fused_cpu_equals_reference(fused, hierarchical, rows, numels):
    # every tensor sparsified, some with no real element in this rank's rows (hierarchical, small tensors)
    _assert_same(REFERENCE.compress(_job(numels, rows, hierarchical=hierarchical, min_numel=0)),
                 fused.compress(_job(numels, rows, hierarchical=hierarchical, min_numel=0)))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for loss_scale in (1.0, 1024.0):
            for residual in (True, False):
                seed = zlib.crc32(repr((rows, numels, str(dtype), loss_scale, residual)).encode()) % 1000
                job = _job(numels, rows, hierarchical=hierarchical, dtype=dtype, residual=residual,
                           loss_scale=loss_scale, seed=seed)
                ref = REFERENCE.compress(job)
                assert ref.kept > 0 or not any(any(job.real_counts(i)) for i in range(len(numels)))
                _assert_same(ref, fused.compress(job))


def _sample_of(which):
    """Samples made of the smallest (forces the exact top-k step) or largest (forces lowering) magnitudes."""

    def make(job):
        out = []
        for i, src in enumerate(job.srcs):
            if not job.sparse[i]:
                out.append(None)
                continue
            mag = (src.float() / job.divisor + job.residuals[i]).abs()
            order = torch.argsort(mag, descending=(which == "largest"))
            out.append(order[:2000].repeat(3))
        return out

    return make


@pytest.mark.parametrize("which", ["smallest", "largest"])
def test_threshold_corrections_match(fused, which):
    job = _job([100_000, 7], 2, density=0.01, samples=_sample_of(which), min_numel=64)
    ref = REFERENCE.compress(job)
    _assert_same(ref, fused.compress(job))
    k = 1000
    kept_big = ref.kept - 7  # the 7-element tensor is sent whole
    if which == "smallest":
        assert kept_big == k  # exact top-k step (no ties among random floats)
    else:
        assert 0.8 * k <= kept_big <= 1.3 * k  # lowered until at least 0.8 k


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("numels", SIZES[1:])
def test_reused_and_fixed_thresholds_match(fused, hierarchical, numels):
    """Thresholds the fused op returns equal the reference's; reusing them on the next step's values (some
    tensors reused, some estimated, loss scale 1024) gives the same bytes and bits, as does the fixed-threshold
    mode; a reused threshold keeping everything is cut to exactly k, one keeping too few is not lowered."""
    first = _job(numels, 2, hierarchical=hierarchical, loss_scale=1024.0, density=0.1)
    assert all(t is None for t in REFERENCE.compress(first).thresholds + fused.compress(first).thresholds)
    first.reuse_thresholds = [None] * len(numels)  # estimate all, report them
    ref = REFERENCE.compress(first)
    _assert_same(ref, fu := fused.compress(first))
    assert fu.thresholds == ref.thresholds
    assert [t is not None for t in ref.thresholds] == [s and sum(first.real_counts(i)) > k for i, (s, k) in
                                                        enumerate(zip(first.sparse, first.targets()))]
    nxt = _job(numels, 2, hierarchical=hierarchical, loss_scale=1024.0, density=0.1)  # the next step: same scales
    for src in {id(x): x for x in nxt.srcs}.values():
        src.mul_(torch.rand(src.shape, generator=torch.Generator().manual_seed(7)).add_(0.7).to(src.dtype))
    nxt.reuse_thresholds = [t if i % 2 == 0 else None for i, t in enumerate(ref.thresholds)]
    nxt.samples = [s if nxt.reuse_thresholds[i] is None else None for i, s in enumerate(nxt.samples)]
    ref2 = REFERENCE.compress(nxt)
    _assert_same(ref2, fu2 := fused.compress(nxt))
    assert fu2.thresholds == ref2.thresholds
    reused = [i for i, t in enumerate(nxt.reuse_thresholds) if t is not None]
    assert any(ref2.thresholds[i] == nxt.reuse_thresholds[i] for i in reused)  # kept what reached it
    for i in reused:  # or cut to the k largest, when more than 1.3 k reached it
        assert ref2.thresholds[i] >= nxt.reuse_thresholds[i]
    n = max(numels)  # one tensor: the kept count is that tensor's
    for reuse in (0.0, 1e9):
        job = _job([n], 2, hierarchical=hierarchical, density=0.1, seed=9)
        job.reuse_thresholds = [reuse]
        ref3 = REFERENCE.compress(job)
        _assert_same(ref3, fused.compress(job))
        assert ref3.kept == (job.targets()[0] if reuse == 0.0 else 0)
    fixed = _job(numels, 2, hierarchical=hierarchical, loss_scale=1024.0, density=0.1, seed=11)
    fixed.threshold = 0.3
    ref4 = REFERENCE.compress(fixed)
    _assert_same(ref4, fused.compress(fixed))
    assert all(t == pytest.approx(0.3, rel=1e-7) for t, s in zip(ref4.thresholds, fixed.sparse) if s)


def test_mostly_zero_tensor(fused):
    """Most elements exactly 0: the lowering rounds run out; both keep the same elements."""
    job = _job([50_000], 2, density=0.1, residual=False)
    job.srcs[0][torch.arange(50_000) % 97 != 0] = 0
    _assert_same(REFERENCE.compress(job), fused.compress(job))


def test_non_finite_sends_nothing(fused):
    job = _job([3, 5000], 2)
    job.srcs[1][1234] = float("nan")
    ref, fu = REFERENCE.compress(job), fused.compress(job)
    _assert_same(ref, fu)
    assert not fu.finite and fu.kept == 0 and fu.residuals is None
    assert all(p.numel() == 20 for p in fu.payloads)  # header only


def test_topk_threshold_binding(fused):
    g = torch.Generator().manual_seed(3)
    for n, k in ((5000, 50), (100_000, 1000), (3000, 2999)):
        mag = torch.randn(n, generator=g).abs()
        sample = torch.randint(0, n, (1500, ), generator=g)
        assert fused.op.topk_threshold(mag, k, sample) == float(topk_threshold(mag, k, sample))
        assert fused.op.topk_threshold(mag, k, torch.empty(0, dtype=torch.long)) == float(topk_threshold(mag, k, None))


def _parse(payload):
    kept, n_index, n_groups = payload[:20].view(torch.int32).tolist()[2:]
    off = 20 + 4 * n_groups
    return (payload[off:off + (kept + 1) // 2], payload[20:off].view(torch.float32),
            payload[off + (kept + 1) // 2:off + (kept + 1) // 2 + n_index], kept)


@pytest.mark.parametrize("hierarchical", [False, True])
def test_decode_add_equals_reference(fused, hierarchical):
    job = _job([5, 3000, 2, 65537, 64], 3, hierarchical=hierarchical, seed=11)
    out = REFERENCE.compress(job)
    for row, payload in enumerate(out.payloads):
        values, scales, index_bytes, kept = _parse(payload)
        seg_real = [max(0, min(c, n - job.row_owner[row] * c)) for n, c in zip(job.numels, job.chunks)]
        n_indexed = kept - sum(r for r, s in zip(seg_real, job.sparse) if not s)
        sums = []
        for ops in (REFERENCE, fused):
            acc = torch.randn(sum(job.chunks), generator=torch.Generator().manual_seed(row))
            ops.decode_add(acc, values, scales, index_bytes, kept, n_indexed, seg_real, job.chunks, job.sparse,
                           job.group_size, True, torch.float32)
            sums.append(acc)
        assert torch.equal(sums[0], sums[1])
        # malformed bodies: a truncated varint, one position too many, an index past the row
        for bad_index, bad_n in ((index_bytes[:-1], n_indexed), (index_bytes, n_indexed + 1),
                                 (torch.tensor([0xFF, 0xFF, 0x7F], dtype=torch.uint8), 1)):
            for ops in (REFERENCE, fused):
                with pytest.raises(ValueError):
                    ops.decode_add(torch.zeros(sum(job.chunks)), values, scales, bad_index, kept - n_indexed + bad_n,
                                   bad_n, seg_real, job.chunks, job.sparse, job.group_size, True, torch.float32)


# ---- builds -------------------------------------------------------------------------------------


def _torch_includes():
    from torch.utils.cpp_extension import include_paths
    return [f"-I{p}" for p in include_paths()]


@pytest.mark.parametrize("cu", sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"), recursive=True)))
def test_cu_compiles_with_nvcc(cu, tmp_path):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        pytest.skip("nvcc is not installed")
    cmd = [nvcc, "-c", cu, "-o", str(tmp_path / "out.o"), "-std=c++17", "--fmad=false", "-O3",
           f"-I{os.path.dirname(cu)}", *_torch_includes(),
           "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "out.o").stat().st_size > 0


CHECK_OP = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_kernels import _job, _assert_same
from deepspeed_dgc.kernels import REFERENCE, FusedCPUOps
op = {load}
job = _job([5, 3000, 65537], 2, seed=5)
_assert_same(REFERENCE.compress(job), FusedCPUOps(op).compress(job))
print("OP_FILE", op.__file__)
"""


def _run_check(load: str, env=None, cwd=ROOT):
    code = CHECK_OP.format(tests=os.path.dirname(os.path.abspath(__file__)), load=load)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.split("OP_FILE ")[1].strip()


def test_jit_path_loads():
    """The JIT build (torch cpp_extension through DeepSpeed's builder) loads and equals the reference."""
    path = _run_check("__import__('op_builder').DGCCPUBuilder().jit_load(verbose=False)")
    assert "torch_extensions" in path or os.environ["TORCH_EXTENSIONS_DIR"] in path


def test_prebuilt_path_loads(tmp_path):
    """The op prebuilt by ``DS_BUILD_DGC=1 pip install -e .`` (``make install``; else built here with
    ``DS_BUILD_DGC=1 python setup.py build_ext``) is what ``load()`` imports, with no compiler and no JIT."""
    built = glob.glob(os.path.join(ROOT, "deepspeed_dgc", "_prebuilt", "dgc_cpu_op*.so"))
    if not built:
        proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path),
                               "--build-temp", str(tmp_path / "tmp")], capture_output=True, text=True, timeout=900,
                              cwd=ROOT, env=dict(os.environ, DS_BUILD_DGC="1"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        built = glob.glob(str(tmp_path / "deepspeed_dgc" / "_prebuilt" / "dgc_cpu_op*.so"))
    assert built, "setup.py with DS_BUILD_DGC=1 built no dgc_cpu_op"
    # load it through the builder from a tree whose package holds the built module (no compiler needed)
    shutil.copytree(os.path.join(ROOT, "deepspeed_dgc"), tmp_path / "tree" / "deepspeed_dgc")
    shutil.copytree(os.path.join(ROOT, "op_builder"), tmp_path / "tree" / "op_builder")
    shutil.copy(built[0], tmp_path / "tree" / "deepspeed_dgc" / "_prebuilt")
    code = CHECK_OP.format(tests=os.path.dirname(os.path.abspath(__file__)),
                           load="__import__('op_builder').DGCCPUBuilder().load()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path / "tree",
                          env=dict(os.environ, PYTHONPATH=str(tmp_path / "tree"), CXX="/nonexistent/c++",
                                   TORCH_EXTENSIONS_DIR=str(tmp_path / "no_jit")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "_prebuilt" in proc.stdout and not (tmp_path / "no_jit").exists()


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """No prebuilt op, no loaded op, no compiler."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    from op_builder.dgc import DGCCPUBuilder
    monkeypatch.setattr(DGCCPUBuilder, "prebuilt_module", lambda self: None)
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    import deepspeed_dgc.kernels as kernels
    monkeypatch.setattr(kernels, "_warned", set())


def test_stale_prebuilt_op_is_rebuilt_with_a_warning(monkeypatch, caplog):
    """A prebuilt module of an older calling convention (an editable install not reinstalled after a pull) is
    not loaded: the builder says so and JIT-builds from the sources instead."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    from op_builder.dgc import DGCCPUBuilder
    assert load_fused_op("cpu").ABI == DGCCPUBuilder.ABI  # the op built from these sources declares it
    stale, fresh = types.SimpleNamespace(), types.SimpleNamespace(ABI=DGCCPUBuilder.ABI)  # ABI absent: 1
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    monkeypatch.setattr(DGCCPUBuilder, "prebuilt_module", lambda self: stale)
    monkeypatch.setattr(DGCCPUBuilder, "jit_load", lambda self, verbose=False: fresh)
    with caplog.at_level("WARNING", logger="deepspeed_dgc"):
        assert DGCCPUBuilder().load() is fresh
    assert f"calling convention 1, these sources need {DGCCPUBuilder.ABI}" in caplog.text


def test_fused_without_compiler_fails_clearly(no_compiler):
    with pytest.raises(DGCKernelError, match=r"'dgc.kernels' is \"fused\" but the fused cpu op cannot load: .*"
                       r"no C\+\+ compiler \(/nonexistent/c\+\+\)"):
        get_ops("fused", "cpu", True)


def test_auto_without_compiler_falls_back_with_one_warning(no_compiler, caplog):
    with caplog.at_level("WARNING", logger="deepspeed_dgc"):
        assert get_ops("auto", "cpu", True) is REFERENCE
        assert get_ops("auto", "cpu", True) is REFERENCE
    warnings = [r.getMessage() for r in caplog.records if "using the PyTorch reference path" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0]


def test_dispatch_choices():
    assert get_ops("reference", "cpu", True) is REFERENCE
    assert get_ops("auto", "cpu", False) is REFERENCE  # raw values: reference only
    assert get_ops("auto", "cpu", True).name == "fused-cpu"
    with pytest.raises(DGCKernelError, match="only code INT4"):
        get_ops("fused", "cpu", False)
    with pytest.raises(ValueError, match="unknown kernels 'fast'"):
        get_ops("fast", "cpu", True)


def test_report_lists_every_op():
    proc = subprocess.run([sys.executable, "-m", "deepspeed_dgc", "report"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for key in ("deepspeed_dgc", "deepspeed", "torch", "accelerator", "nvcc", "mpi4py", "MPI library"):
        assert f"\n{key}" in out, key
    cpu = [line for line in out.splitlines() if line.startswith("dgc_cpu_op")][0]
    cuda = [line for line in out.splitlines() if line.startswith("dgc_cuda_op")][0]
    assert ": prebuilt" in cpu or ": JIT-compatible" in cpu, cpu
    if not torch.cuda.is_available():
        assert ": unavailable" in cuda and ("no CUDA" in cuda or "has no CUDA" in cuda), cuda


def _leb(v):
    out = []
    while v >= 128:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    return out + [v]


def test_bad_inputs_raise_instead_of_touching_memory(fused):
    """Inputs a corrupted payload or a wrong caller could produce: errors, never a crash or a write
    outside the buffers (each of these crashed or wrote out of bounds before being checked)."""
    op = fused.op
    two = torch.tensor([0x99, 0x09], dtype=torch.uint8)
    # varint gaps that wrap the int64 position around to a negative index
    wrap = torch.tensor(_leb(0) + _leb(2**63 - 1) + _leb(2**63 - 1 - 4), dtype=torch.uint8)
    for ops in (REFERENCE, fused):
        with pytest.raises(ValueError, match="past the partition"):
            ops.decode_add(torch.zeros(100), two, torch.tensor([1.0]), wrap, 3, 3, [90], [100], [True], 16, True,
                           torch.float32)
    ok_index = torch.tensor(_leb(3) + _leb(5), dtype=torch.uint8)
    bad_calls = [
        dict(out=torch.zeros(1)),  # smaller than the row
        dict(sparse=[]),  # lists of different lengths
        dict(seg_real=[120]),  # more real elements than columns
        dict(group_size=0),
    ]
    for bad in bad_calls:
        args = dict(out=torch.zeros(100), values=two, scales=torch.tensor([1.0]), index_bytes=ok_index, kept=2,
                    n_indexed=2, seg_real=[90], seg_chunks=[100], sparse=[True], group_size=16)
        args.update(bad)
        with pytest.raises((RuntimeError, ValueError)):
            op.decode_add(*args.values())
    empty_l = torch.empty(0, dtype=torch.long)
    base = dict(srcs=[torch.randn(100)], offsets=[0], strides=[50], residuals=[torch.randn(100)], residual_numels=[100],
                numels=[100], chunks=[50], sparse=[True], row_owner=[0, 1], ks=[5], samples=[empty_l], divisor=2.0,
                loss_scale=1.0, group_size=16, fingerprint=1, want_residual=True, fixed=[-1.0], reuse=False)
    op.compress_bucket(*base.values())  # the valid call works
    for bad, match in ((dict(residuals=[torch.randn(10)], residual_numels=[10]), "residual_numels"),
                       (dict(residuals=[torch.empty(0)], residual_numels=[0]), "residual_numels"),
                       (dict(offsets=[-1000]), "offsets"), (dict(ks=[0]), "ks"), (dict(ks=[-1]), "ks"),
                       (dict(fingerprint=2**40), "fingerprint"), (dict(strides=[10]), "strides"),
                       (dict(fixed=[]), "differ in length")):
        with pytest.raises(RuntimeError, match=match):
            op.compress_bucket(*dict(base, **bad).values())
    for k in (0, -1, 11):
        with pytest.raises(RuntimeError, match="k must be in"):
            op.topk_threshold(torch.rand(10), k, empty_l)


def test_reducer_reuses_thresholds_every_n_exchanges(fused):
    """threshold_reuse_steps 3: the reducer estimates (draws a sample) at exchanges 0 and 3, reuses the stored
    threshold at 1 and 2, estimates afresh when the density changes (exchange 4) and when momentum replaces the
    gradient at the same density (exchange 6), and reuses in between."""
    from deepspeed_dgc.config import DGCConfig
    from deepspeed_dgc.memory import ErrorFeedback
    from deepspeed_dgc.reducer import CompressedReduceScatter
    reducer = CompressedReduceScatter(DGCConfig(enabled=True, density=0.1, threshold_reuse_steps=3, min_numel=0),
                                      ErrorFeedback("fp32"), ops=fused)
    g = torch.Generator().manual_seed(3)
    numels, keys = [5000, 3], [10, 11]
    chunks = [-(-n // 2) for n in numels]
    pattern = []
    for step, density in enumerate([0.1] * 4 + [0.2] * 2 + [0.2] * 2):
        if step == 6:  # the compressed momentum's freeze: the same density, another quantity
            reducer.momentum = types.SimpleNamespace(sending=True, frozen=False)
        reducer._density = density
        srcs = [torch.randn(n, generator=g) for n in numels]
        job = reducer._job(srcs, [0, 0], chunks, numels, chunks, [True, True], [0, 1], keys, numels, 2.0, 1.0,
                           torch.float32, 1, "cpu")
        reused = job.reuse_thresholds[0] is not None
        assert (job.samples[0] is None) == reused  # a sample is drawn only to estimate
        out = fused.compress(job)
        reducer._remember_thresholds(job, keys, out.thresholds)
        pattern.append((reused, reducer.thresholds[10][1:]))
    assert pattern == [(False, [0.1, 1, False]), (True, [0.1, 2, False]), (True, [0.1, 3, False]),
                       (False, [0.1, 1, False]), (False, [0.2, 1, False]), (True, [0.2, 2, False]),
                       (False, [0.2, 1, True]), (True, [0.2, 2, True])]
