"""The fixed layout (the device path) on a GPU (skipped where torch sees no CUDA device).

Run on a GPU machine: ``python -m pytest -q tests/gpu`` (part of ``make gpu-check``). One rank over NCCL: after the
first bucket of a shape, the whole bucket path (gather, threshold, capacity cut, quantize, pack, all_to_all_single,
decode, residuals, commit) runs under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any host
synchronisation; the CUDA op's encode and decode give the bytes, residual bits and sums of the torch ops on the same
GPU, and those equal the CPU's for the formats whose reductions are exact in any order.
"""

import os
import socket

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

from deepspeed_dgc.codec import fixed  # noqa: E402
from deepspeed_dgc.codec.kernels import FusedCUDAOps, load_fused_op  # noqa: E402
from deepspeed_dgc.codec.layout import Workspace  # noqa: E402
from deepspeed_dgc.config import DGCConfig  # noqa: E402
from deepspeed_dgc.memory.error_feedback import ErrorFeedback  # noqa: E402
from deepspeed_dgc.zero3.reduce_scatter import CompressedReduceScatter  # noqa: E402

FORMATS = ["int4", "int2", "int1", "fp8_e4m3", "fp8_e5m2"]


@pytest.fixture(scope="module")
def cuda_ops():
    return FusedCUDAOps(load_fused_op("cuda"))


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


def _plan(sizes, rows, density, fmt, gs=128):
    return fixed.FixedPlan.build(sizes, rows, list(range(rows)), [n >= 64 for n in sizes], density, True, fmt, gs,
                                 torch.float32, 2.0)


def _matrix(plan, srcs, device, dtype=torch.float32):
    L = plan.layout
    return L.gather([s.to(device, dtype) for s in srcs], fixed.owner_matrix(L.rows, L.columns, device, dtype))


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


# an fp32 matrix of any source dtype; a bf16 one for bf16 gradients only (fixed.matrix_dtype)
@pytest.mark.parametrize("src_dtype, out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("by_row", [False, True])
def test_cuda_gather_equals_torch_ops(cuda_ops, out_dtype, src_dtype, by_row):
    """The CUDA op's gather (one launch) into an fp32 or bf16 owner matrix, divided by 3 on the way, against the
    layout's torch gather and ``div_`` on the same GPU: the same bits, padding 0. Two rows owned by ranks 2 and 0 of
    3 (rank 2 holds the short last chunk of most tensors, none of the 2-element one); ``by_row``: sources that hold
    only these rows (the hierarchical topology's node rows), read at the row's chunk, real as far as its owner's."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    sizes = [5, 3000, 2, 65537, 64, 129]
    plan = fixed.FixedPlan.build(sizes, 3, [2, 0], [n >= 64 for n in sizes], 0.05, True, "int4", 128, torch.float32)
    L = plan.layout
    lengths = [L.rows * c for c in L.chunks] if by_row else sizes
    srcs = [(torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))).to("cuda", src_dtype)
            for n in lengths]
    want = L.gather(srcs, fixed.owner_matrix(L.rows, L.columns, "cuda", out_dtype), by_row=by_row).div_(3.0)
    got = cuda_ops.gather(L, srcs, torch.full((L.rows, L.columns), float("nan"), dtype=out_dtype, device="cuda"),
                          3.0, by_row)
    assert torch.equal(_bits(want), _bits(got))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("density", [1.0, 0.05, 0.001])
@pytest.mark.parametrize("sizes", [[5, 3000, 2, 65537, 64], [1 << 16, 1 << 12, 1 << 20]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_op_equals_torch_ops_on_the_gpu(cuda_ops, fmt, density, sizes, dtype):
    """The CUDA op's encode (scales, codes, packing, residual in one kernel) and decode-and-sum against the torch ops
    on the same GPU, 3 senders, an fp32 or a bf16 owner matrix (bf16 gradients, :func:`fixed.matrix_dtype`): the
    same payload bytes and residual bits, the same sums (senders in rank order)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    plan = _plan(sizes, 3, density, fmt)
    srcs = [[torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g)) for n in sizes]
            for _ in range(3)]
    for s in srcs[0]:
        s[::7] = 0.0
    seed = int(torch.randint(0, 1 << 30, ()))
    got = {}
    for name, ops in (("torch", None), ("fused", cuda_ops)):
        payloads, residuals = [], []
        for sender in srcs:
            A = _matrix(plan, sender, "cuda", dtype)
            gen = torch.Generator(device="cuda").manual_seed(seed)
            payloads.append(fixed.encode(A, plan, 7, Workspace(), sample_generator=gen, ops=ops))
            residuals.append(A)
        got[name] = (payloads, residuals)
    if fmt == "int1":
        _assert_int1_close(plan, got["torch"], got["fused"])
    else:
        for a, b in zip(got["torch"][0], got["fused"][0]):
            assert torch.equal(a, b)
        for a, b in zip(got["torch"][1], got["fused"][1]):
            assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
    for r in range(3):  # both decode the same payloads (the torch ops'): the same sums, senders in rank order
        received = torch.stack([p[r] for p in got["torch"][0]])
        sums = [fixed.decode_sum(received, plan, 7, r, Workspace(), ops=ops)[0] for ops in (None, cuda_ops)]
        assert torch.equal(_bits(sums[0]), _bits(sums[1]))


def _assert_int1_close(plan, want, got):
    """INT1's scale is the mean magnitude of a group's non-zero values: an fp32 sum, which the torch ops' reduction and
    the kernel's tree add in different orders, so the scales (and the residuals ``v - sign(v) s``) agree to rounding,
    not to the bit; every other byte (headers, sign codes, chunk counts, positions) is the same."""
    s_at, v_at, _, _ = plan.sections
    for a, b in zip(want[0], got[0]):
        assert torch.equal(a[:, :s_at], b[:, :s_at]) and torch.equal(a[:, v_at:], b[:, v_at:])
        sa, sb = a[:, s_at:v_at].contiguous().view(torch.float32), b[:, s_at:v_at].contiguous().view(torch.float32)
        torch.testing.assert_close(sb, sa, rtol=3e-5, atol=0)
        scale = float(sa.abs().max())
    for a, b in zip(want[1], got[1]):  # a bf16 residual may round to the next bf16 (2^-8 of it) on a scale's last bit
        slack = 3e-5 * scale + (a.float().abs() * 2.0**-7 if a.dtype == torch.bfloat16 else 0.0)
        assert a.dtype == b.dtype and bool(((b.float() - a.float()).abs() <= slack).all())


@pytest.mark.parametrize("fmt", ["int4", "int2", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("density", [0.3, 0.02, 0.001])
def test_gpu_payloads_and_residuals_equal_the_cpu(fmt, density, monkeypatch):
    """Same sample positions (drawn on the CPU and moved: the CPU and CUDA generators draw different numbers), the
    GPU's payloads and residuals equal the CPU's bit for bit (INT4, INT2 and FP8 reduce with max/min only, exact in
    any order; their scales are true divisions on both)."""
    sizes = [5, 3000, 2, 65537, 64]
    plan = _plan(sizes, 2, density, fmt)
    assert density == 0.3 or any(plan.sparse), plan  # the sparse path is compared, not only the dense one
    g = torch.Generator().manual_seed(11)
    srcs = [torch.randn(n, generator=g) for n in sizes]
    drawn = fixed.draw_sample

    def drawn_on_the_cpu(plan, generator, device):
        positions, tensor = drawn(plan, torch.Generator().manual_seed(5), "cpu")
        return positions.to(device), tensor.to(device)
    monkeypatch.setattr(fixed, "draw_sample", drawn_on_the_cpu)
    out = {}
    for device in ("cpu", "cuda"):
        A = _matrix(plan, srcs, device)
        out[device] = (fixed.encode(A, plan, 7, Workspace(), sample_generator=None), A)
    assert torch.equal(out["cpu"][0], out["cuda"][0].cpu())
    assert torch.equal(out["cpu"][1].view(torch.int32), out["cuda"][1].cpu().view(torch.int32))


@pytest.mark.parametrize("kernels", ["reference", "auto"])
@pytest.mark.parametrize("quantization", FORMATS + ["none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bucket_path_never_synchronises_the_host(nccl_world, kernels, quantization, dtype):
    cfg = DGCConfig(enabled=True, density=0.05, quantization=quantization, min_numel=64, layout="fixed",
                    kernels=kernels, stochastic_rounding=quantization in ("int4", "int2"))
    memory = ErrorFeedback(cfg.residual_storage)
    reducer = CompressedReduceScatter(cfg, memory, seed=0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = [5, 3000, 65537, 1 << 20]

    def step():
        grads = [torch.randn(n, device="cuda", generator=gen).to(dtype) for n in sizes]
        outs, _ = reducer.reduce_scatter(grads, list(range(len(sizes))), None, dtype, consume=True)
        outs = [o.clone() for o in outs]
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
