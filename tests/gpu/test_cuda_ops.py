"""The CUDA op against the PyTorch reference on a GPU (skipped where torch sees no CUDA device).

Run on a GPU machine: ``python -m pytest -q tests/gpu`` (JIT-builds dgc_cuda_op for the visible
GPU, or uses the one prebuilt by ``DS_BUILD_DGC=1 pip install .``). Random buckets of odd sizes,
flat and hierarchical layouts, fp32/bf16/fp16 sources, loss scale 1 and 1024: the same payload
bytes and residual bits as the reference on the same device, and the same decoded sums.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

from deepspeed_dgc.codec import wire  # noqa: E402
from deepspeed_dgc.codec.kernels import FusedCUDAOps, load_fused_op  # noqa: E402
from deepspeed_dgc.codec.reference import REFERENCE  # noqa: E402

from ..unit.codec.jobs import SIZES, assert_same as _assert_same, make_job as _job  # noqa: E402


@pytest.fixture(scope="module")
def cuda_ops():
    return FusedCUDAOps(load_fused_op("cuda"))


def _to_cuda(job):
    job.srcs = [s.cuda() for s in job.srcs]
    job.residuals = [None if r is None else r.cuda() for r in job.residuals]
    job.samples = [None if s is None else s.cuda() for s in job.samples]
    return job


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("numels", SIZES + [[1 << 22, 3]])
def test_cuda_equals_reference(cuda_ops, hierarchical, rows, numels):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for loss_scale in (1.0, 1024.0):
            job = _to_cuda(_job(numels, rows, hierarchical=hierarchical, dtype=dtype, loss_scale=loss_scale, seed=rows))
            ref = REFERENCE.compress(job)
            out = cuda_ops.compress(job)
            _assert_same(ref, out)
            for row, payload in enumerate(out.payloads):
                layout = job.row_layout(row)
                body = wire.parse(payload, 0, layout)
                if body.kept == 0:
                    continue
                sums = []
                for ops in (REFERENCE, cuda_ops):
                    acc = torch.zeros(layout.row_numel, device="cuda")
                    ops.decode_add(acc, body, layout)
                    sums.append(acc)
                assert torch.equal(sums[0], sums[1])


@pytest.mark.parametrize("fmt", ["int2", "int1", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("density", [0.05, 1.0])
def test_cuda_every_value_format_equals_cpu_reference(cuda_ops, fmt, density):
    """INT2, INT1 and FP8 coded by the CUDA op: the bytes and residual bits the reference gives on the CPU (the oracle
    of the fused CPU op too), zeros included (INT1/INT2 bitmaps; INT1's scales to rounding: :func:`_assert_int1_close`),
    and the same decoded sums."""
    job = _job(SIZES[2], 2, value_format=fmt, density=density, residual=True, seed=5,
               min_numel=0 if density < 1 else 10**9)
    for src in job.srcs:
        src[::7] = 0.0
    for r in job.residuals:
        r[::7] = 0.0
    ref = REFERENCE.compress(job)
    out = cuda_ops.compress(_to_cuda(job))
    out = type(out)([p.cpu() for p in out.payloads], [r.cpu() for r in out.residuals], out.finite, out.kept,
                    out.thresholds)
    if fmt == "int1":
        _assert_int1_close(job, ref, out)
    else:
        _assert_same(ref, out)
    for row, payload in enumerate(ref.payloads):
        layout = job.row_layout(row)
        body = wire.parse(payload, 0, layout)
        cpu = torch.zeros(layout.row_numel)
        REFERENCE.decode_add(cpu, body, layout)
        gpu_body = wire.parse(payload.cuda(), 0, layout)
        gpu = torch.zeros(layout.row_numel, device="cuda")
        cuda_ops.decode_add(gpu, gpu_body, layout)
        assert torch.equal(cpu.view(torch.int32), gpu.cpu().view(torch.int32))


def _assert_int1_close(job, ref, out):
    """INT1's scale is the mean magnitude of a group's non-zero values, an fp32 sum: the CPU adds a group's values in
    order, torch's ``index_add_`` on a GPU with atomics in any order, so the scales (and the residuals ``v - sign(v)
    s``) agree to rounding, not to the bit; the kept count, positions and sign codes are the same."""
    assert (ref.finite, ref.kept) == (out.finite, out.kept)
    scale = 0.0
    for row, (a, b) in enumerate(zip(ref.payloads, out.payloads)):
        layout = job.row_layout(row)
        x, y = wire.parse(a, 0, layout), wire.parse(b, 0, layout)
        assert (x.kept, x.n_indexed) == (y.kept, y.n_indexed)
        assert torch.equal(x.index_bytes, y.index_bytes) and torch.equal(x.values, y.values)
        torch.testing.assert_close(y.scales, x.scales, rtol=3e-5, atol=0)
        scale = max(scale, float(x.scales.abs().max()) if x.scales.numel() else 0.0)
    for a, b in zip(ref.residuals, out.residuals):
        torch.testing.assert_close(b, a, rtol=0, atol=3e-5 * scale)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_weight_codes_equal_cpu_reference(cuda_ops, fmt, dtype):
    """The weight codes and decoded weights of the CUDA op equal the reference's on the CPU."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5001, generator=g) * torch.logspace(-5, 2, 5001)).to(dtype)
    x[:300] = 0.0
    for segments in (None, [1, 4000, 1000]):
        codes, scales = REFERENCE.quantize_weights(x, fmt, 64, segments)
        gc, gs = cuda_ops.quantize_weights(x.cuda(), fmt, 64, segments)
        assert torch.equal(codes, gc.cpu()) and torch.equal(scales.view(torch.int32), gs.cpu().view(torch.int32))
        cpu = torch.empty(5001, dtype=dtype)
        REFERENCE.dequantize_weights_into(cpu, codes, scales, fmt, 64, segments)
        gpu = torch.empty(5001, dtype=dtype, device="cuda")
        cuda_ops.dequantize_weights_into(gpu, gc, gs, fmt, 64, segments)
        assert torch.equal(cpu.view(torch.uint8), gpu.cpu().view(torch.uint8))


def test_cuda_non_finite_sends_nothing(cuda_ops):
    job = _to_cuda(_job([3, 5000], 2))
    job.srcs[1][1234] = float("inf")
    out = cuda_ops.compress(job)
    _assert_same(REFERENCE.compress(job), out)
    assert not out.finite and out.kept == 0


@pytest.mark.parametrize("hierarchical", [False, True])
def test_cuda_reused_thresholds_match(cuda_ops, hierarchical):
    """threshold_reuse_steps on the GPU: thresholds estimated by the CUDA path equal the reference's on the device;
    reusing them (one tensor reused, one estimated; loss scale 1024) gives the same bytes and bits."""
    first = _to_cuda(_job([5, 3000, 65537], 2, hierarchical=hierarchical, loss_scale=1024.0, density=0.1))
    first.reuse_thresholds = [None] * 3  # estimate all, report them (as tests/unit/codec/kernels/test_threshold.py)
    ref = REFERENCE.compress(first)
    out = cuda_ops.compress(first)
    _assert_same(ref, out)
    assert out.thresholds == ref.thresholds and ref.thresholds[2] is not None
    nxt = _to_cuda(_job([5, 3000, 65537], 2, hierarchical=hierarchical, loss_scale=1024.0, density=0.1, seed=3))
    nxt.reuse_thresholds = [None, None, ref.thresholds[2]]
    nxt.samples[2] = None
    _assert_same(REFERENCE.compress(nxt), cuda_ops.compress(nxt))


@pytest.mark.parametrize("storage", ["fp32", "bf16", "fp8"])
def test_offloaded_residuals_are_pinned_and_come_back_to_the_gpu(storage):
    """residual_offload with CUDA residuals: committed copies are pinned host tensors, reused across commits; reads
    come back on the GPU with the bits of the same memory without offload."""
    from deepspeed_dgc.memory.error_feedback import ErrorFeedback
    plain, off = ErrorFeedback(storage), ErrorFeedback(storage, offload=True)
    last = None
    for step in range(3):
        r = torch.randn(100_003, device="cuda") * (step + 1)
        for m in (plain, off):
            m.stage(7, r.clone())
            m.commit()
        stored = off.committed[7] if isinstance(off.committed[7], tuple) else (off.committed[7], )
        assert all(t.device.type == "cpu" and t.is_pinned() for t in stored)
        got = off.get(7)
        assert got.device.type == "cuda" and torch.equal(got, plain.get(7))
        ptrs = [t.data_ptr() for t in stored]
        assert last is None or ptrs == last
        last = ptrs


@pytest.mark.parametrize("storage", ["fp32", "bf16", "fp8", "int8"])
def test_offloaded_blocks_through_the_side_stream_equal_device_ones(storage):
    """Bucket blocks with offload on a GPU: written back and fetched on the side stream (HostCopies), every read
    equals the same store kept on the GPU, bit for bit, through commits and a rollback; pinned host buffers, two per
    block, alternating."""
    from ..unit.memory.test_error_feedback import check_offloaded_blocks
    check_offloaded_blocks(storage, "cuda")
