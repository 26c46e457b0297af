"""The fixed layout (the device path) on a GPU (skipped where torch sees no CUDA device).

Run on a GPU machine: ``python -m pytest -q tests/gpu``. One rank over NCCL: after the first bucket of a shape,
the whole bucket path (accumulate, threshold, capacity, quantize, pack, all_to_all_single, decode, residuals,
commit) runs under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any host synchronisation; and the
fixed layout's payloads and residuals on the GPU equal the CPU reference's bit for bit (INT4 and raw values: every
reduction they use is exact in any order).
"""

import os
import socket

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

from deepspeed_dgc.codec.kernels import FusedCUDAOps, load_fused_op  # noqa: E402
from deepspeed_dgc.codec.reference import REFERENCE  # noqa: E402
from deepspeed_dgc.config import DGCConfig  # noqa: E402
from deepspeed_dgc.memory.error_feedback import ErrorFeedback  # noqa: E402
from deepspeed_dgc.zero3.reduce_scatter import CompressedReduceScatter  # noqa: E402

from ..unit.codec.jobs import make_job  # noqa: E402


@pytest.fixture(scope="module")
def nccl_world():
    """A world of one rank over NCCL in this process (the exchange is a real all_to_all_single)."""
    import deepspeed
    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        deepspeed.init_distributed(dist_backend="nccl")
    torch.cuda.set_device(0)


@pytest.mark.parametrize("kernels", ["reference", "auto"])
@pytest.mark.parametrize("quantization", ["int4", "int2", "int1", "fp8_e4m3", "none"])
def test_the_bucket_path_never_synchronises_the_host(nccl_world, kernels, quantization):
    cfg = DGCConfig(enabled=True, density=0.05, quantization=quantization, min_numel=64, layout="fixed",
                    kernels=kernels, stochastic_rounding=quantization in ("int4", "int2"))
    memory = ErrorFeedback(cfg.residual_storage)
    reducer = CompressedReduceScatter(cfg, memory, seed=0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = [5, 3000, 65537]

    def step():
        grads = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
        outs, _ = reducer.reduce_scatter(grads, list(range(len(sizes))), None, torch.float32)
        memory.commit()
        reducer.end_step(True)
        return outs

    step()  # the first bucket of a shape makes its constants and the process groups
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            outs = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(bool(torch.isfinite(o).all()) for o in outs)


@pytest.mark.parametrize("quantize", [True, False], ids=["int4", "raw"])
@pytest.mark.parametrize("density", [0.3, 0.02, 0.001])
def test_gpu_payloads_and_residuals_equal_the_cpu_reference(density, quantize):
    job = make_job([5, 3000, 2, 65537, 64], 3, density=density, seed=11, min_numel=64)
    job.quantize = quantize
    cpu = REFERENCE.compress_fixed(job)
    job.srcs = [s.cuda() for s in job.srcs]
    job.residuals = [None if r is None else r.cuda() for r in job.residuals]
    job.samples = [None if s is None else s.cuda() for s in job.samples]
    for ops in (REFERENCE, FusedCUDAOps(load_fused_op("cuda"))):
        gpu = ops.compress_fixed(job)
        assert torch.equal(gpu.payloads.cpu(), cpu.payloads), ops.name
        for a, b in zip(cpu.residuals, gpu.residuals):
            assert torch.equal(a.view(torch.int32), b.cpu().view(torch.int32)), ops.name
        row_cpu, _ = REFERENCE.decode_sum_fixed(cpu.payloads, job)
        row_gpu, _ = ops.decode_sum_fixed(gpu.payloads, job)
        assert torch.equal(row_cpu, row_gpu.cpu()), ops.name
