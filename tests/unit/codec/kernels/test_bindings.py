"""The op's module (cpu_bindings.cpp): bad input raises instead of touching memory; how the op is loaded (prebuilt,
rebuilt, no compiler) and when the fused op or the reference codes a bucket (``dgc.kernels``).
"""

import platform
import types

import pytest
import torch

from deepspeed_dgc.codec import wire
from deepspeed_dgc.codec.kernels import (
    DGCKernelError,
    fused_can_code,
    get_ops,
    load_fused_op,
)
from deepspeed_dgc.codec.reference import REFERENCE

from ..jobs import make_job
from ..test_wire import check_decodes_to_what_was_accumulated
from . import _leb




def test_bad_inputs_raise_instead_of_touching_memory(fused):
    """Inputs a corrupted payload or a wrong caller could produce: errors, never a crash or a write
    outside the buffers (each of these crashed or wrote out of bounds before being checked)."""
    op = fused.op
    two = torch.tensor([0x99, 0x09], dtype=torch.uint8)
    # varint gaps that wrap the int64 position around to a negative index
    wrap = torch.tensor(_leb(0) + _leb(2**63 - 1) + _leb(2**63 - 1 - 4), dtype=torch.uint8)
    for ops in (REFERENCE, fused):
        layout = wire.RowLayout(1, [100], [90], [True], True, "int4", 16, torch.float32, "varint")
        with pytest.raises(ValueError, match="past the partition"):
            ops.decode_add(torch.zeros(100), wire.Body(3, 3, torch.tensor([1.0]), two, wrap), layout)
    ok_index = torch.tensor(_leb(3) + _leb(5), dtype=torch.uint8)
    bad_calls = [
        dict(out=torch.zeros(1)),  # smaller than the row
        dict(sparse=[]),  # lists of different lengths
        dict(seg_real=[120]),  # more real elements than columns
        dict(group_size=0),
        dict(fmt=5),  # no such value format
    ]
    for bad in bad_calls:
        args = dict(out=torch.zeros(100), values=two, scales=torch.tensor([1.0]), index_bytes=ok_index, kept=2,
                    n_indexed=2, seg_real=[90], seg_chunks=[100], sparse=[True], group_size=16, fmt=0)
        args.update(bad)
        with pytest.raises((RuntimeError, ValueError), match="decode_add"):  # the C++ op's checks name the function
            op.decode_add(*args.values())
    empty_l = torch.empty(0, dtype=torch.long)
    base = dict(srcs=[torch.randn(100)], offsets=[0], strides=[50], residuals=[torch.randn(100)], residual_numels=[100],
                numels=[100], chunks=[50], sparse=[True], row_owner=[0, 1], ks=[5], samples=[empty_l], divisor=2.0,
                group_size=16, fmt=0, fingerprint=1, want_residual=True, fixed=[-1.0], reuse=False)
    op.compress_bucket(*base.values())  # the valid call works
    for bad, match in ((dict(residuals=[torch.randn(10)], residual_numels=[10]), "residual_numels"),
                       (dict(residuals=[torch.empty(0)], residual_numels=[0]), "residual_numels"),
                       (dict(offsets=[-1000]), "offsets"), (dict(ks=[0]), "ks"), (dict(ks=[-1]), "ks"),
                       (dict(fingerprint=2**40), "fingerprint"), (dict(strides=[10]), "strides"),
                       (dict(fixed=[]), "differ in length"), (dict(fmt=-1), "value format")):
        with pytest.raises(RuntimeError, match=match):
            op.compress_bucket(*dict(base, **bad).values())
    for sample in ([0, 5, 100], [-1, 3], [2**40]):  # sample indices outside the tensor's 100 real elements
        with pytest.raises(IndexError, match="sample index out of range"):
            op.compress_bucket(*dict(base, samples=[torch.tensor(sample)]).values())
    for k in (0, -1, 11):
        with pytest.raises(RuntimeError, match="k must be in"):
            op.topk_threshold(torch.rand(10), k, empty_l)


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """No prebuilt op, no loaded op, no compiler."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    from op_builder.dgc import DGCCPUBuilder
    monkeypatch.setattr(DGCCPUBuilder, "prebuilt_module", lambda self: None)
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    import deepspeed_dgc.codec.kernels as kernels
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.setattr(kernels, "_LOAD_FAILURES", {})


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


def test_auto_without_compiler_falls_back_with_one_warning(no_compiler, caplog, monkeypatch):
    """The fused op that cannot load falls back to the reference with one warning, and is not tried again in the
    process (every caller would otherwise retry the build)."""
    import deepspeed_dgc.codec.kernels as kernels
    attempts = []
    real = kernels.load_fused_op
    monkeypatch.setattr(kernels, "load_fused_op", lambda device_type: attempts.append(device_type) or real(device_type))
    with caplog.at_level("WARNING", logger="deepspeed_dgc"):
        assert get_ops("auto", "cpu", True) is REFERENCE
        assert get_ops("auto", "cpu", True) is REFERENCE
    warnings = [r.getMessage() for r in caplog.records if "using the PyTorch reference path" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0]
    assert attempts == ["cpu"]


def test_dispatch_choices():
    assert get_ops("reference", "cpu", True) is REFERENCE
    assert get_ops("auto", "cpu", False) is REFERENCE  # raw values: reference only
    assert get_ops("auto", "cpu", True).name == "fused-cpu"
    with pytest.raises(DGCKernelError, match="only code quantized payloads"):
        get_ops("fused", "cpu", False)
    with pytest.raises(ValueError, match="unknown kernels 'fast'"):
        get_ops("fast", "cpu", True)


@pytest.mark.parametrize("fmt, coding, sr", [("int4", "bitmap", False), ("int4", "varint", True),
                                              ("int2", "varint", True)])
def test_what_the_fused_op_does_not_code_is_still_coded_right(fused, fmt, coding, sr):
    """Jobs the fused op hands on (bitmap positions, stochastic rounding): its payloads decode to
    within the format's bound of a float64 oracle of the accumulator, the residuals are the accumulator minus what
    was sent, and each tensor keeps within DGC's bounds."""
    job = make_job([5, 3000, 2, 20000, 64], 2, value_format=fmt, index_coding=coding, density=0.1, seed=8)
    if sr:
        job.rounding_generator = torch.Generator().manual_seed(3)
    assert not fused_can_code(job)
    check_decodes_to_what_was_accumulated(job, fused.compress(job), fused)


def test_dense_jobs_stay_on_the_fused_op_whatever_the_index_coding():
    """Positions are never sent when no tensor is sparse, so a dense job with "bitmap" is still fused work."""
    job = make_job([100], 2, density=1.0, index_coding="bitmap")
    job.sparse = [False]
    assert fused_can_code(job)
    job.sparse = [True]
    assert not fused_can_code(job)


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return platform.machine() == "x86_64" and "avx2" in flags


def test_the_avx2_passes_run_where_the_cpu_has_avx2(fused):
    """The comparisons with the reference give the same bytes whether the op's hand-written AVX2 passes (compaction,
    streamed residual) ran or not; this says that they run on an x86-64 CPU with AVX2 (the op is built by GCC)."""
    assert fused.op.avx2_paths() == _cpu_has_avx2()
