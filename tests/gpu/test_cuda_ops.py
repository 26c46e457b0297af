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
        assert step == 0 or ptrs == last
        last = ptrs
