"""MPI backend and hierarchical topology of the compressed reduce-scatter, in real processes under mpirun.

- flat, 2 and 3 ranks: the mpi4py backend gives the same bytes, outputs and residuals as the
  torch (gloo) backend, bit for bit; so does the PyTorch reference compressor against the fused op
  (``dgc.kernels``), flat at 3 ranks and hierarchical;
- hierarchical, 4 ranks as 2 nodes of 2 (LOCAL_SIZE=2; both backends, also bit-identical): each output equals
  the sum over nodes of what was sent, error feedback conserves every gradient, dense INT4 is
  within the INT4 bound of the float64 reference, lossless mode is exactly the two-level fp32 sum
  (and within fp32 rounding of stock's flat sum), and the bytes split into intra- and inter-node.
"""

import math

import pytest
import torch

from dist_launch import free_port, run_scenarios_mpirun
from deepspeed_dgc.codec.selection import target_count
from scenarios import ReduceCases
from scenarios.reduce import CASES as ALL_CASES, SIZES, STEPS

from .test_reduce_scatter import assert_threshold_schedule

# every case of the flat topology but gradient accumulation's (tests/distributed/test_reduce_scatter.py has those)
CASES = {k: v for k, v in ALL_CASES.items() if "gas4" not in k}
# relative rounding of each residual storage (as tests/distributed/test_reduce_scatter.py)
STORAGE_REL_ERROR = {"fp32": 0.0, "bf16": 2.0**-8, "fp8": 2.0**-4}

L = 2  # ranks per node in the hierarchical run


def _run_mpirun(world, runs, topology, layout="auto", **env):
    """Every run of ``runs`` (``BACKEND[:KERNELS],...``) in turn under one mpirun: run -> per rank, case name -> its
    :class:`~scenarios.reduce.ReduceCase`."""
    jobs = {run: ReduceCases.of_run(run, topology=topology, layout=layout) for run in runs.split(",")}
    records = run_scenarios_mpirun(jobs, world, timeout_s=240,
                                   env_to_ranks=dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **env))
    return {run: [rec.cases for rec in recs] for run, recs in records.items()}


def _assert_backends_equal(runs, world, run_a="torch", run_b="mpi"):
    for rank in range(world):
        a = runs[run_a][rank]
        b = runs[run_b][rank]
        assert a.keys() == b.keys() and set(CASES) <= a.keys() <= set(ALL_CASES)
        for case in a:
            for sa, sb in zip(a[case].steps, b[case].steps, strict=True):
                for x, y in zip(sa.outputs, sb.outputs, strict=True):
                    # bits, so that the NaN of a poisoned (skipped) micro-step compares too
                    assert x.dtype == y.dtype and torch.equal(x.view(torch.int32), y.view(torch.int32)), \
                        f"rank {rank} {case}: outputs differ"
                assert sa.residuals.keys() == sb.residuals.keys()
                assert all(torch.equal(sa.residuals[k].view(torch.int32), sb.residuals[k].view(torch.int32))
                           for k in sa.residuals)  # bits: the fixed layout stages NaN residuals of a skipped step
                assert (sa.wire_bytes, sa.kept) == (sb.wire_bytes, sb.kept)


def test_mpi_backend_bit_identical_to_torch_flat_in_the_fixed_layout():
    """The fixed layout (equal payloads, no size exchange) through mpi4py: the same outputs, residuals and bytes as
    through gloo, bit for bit, at 2 ranks."""
    _assert_backends_equal(_run_mpirun(2, "torch,mpi", "flat", layout="fixed"), 2)


@pytest.mark.parametrize("world", [2, 3])
def test_mpi_backend_bit_identical_to_torch_flat(world):
    runs = _run_mpirun(world, "torch,mpi,torch:reference" if world == 3 else "torch,mpi", "flat")
    _assert_backends_equal(runs, world)
    if world == 3:
        _assert_backends_equal(runs, world, "torch", "torch:reference")  # fused op == reference
        _assert_ops(runs, world)


@pytest.fixture(scope="module")
def hier():
    # no dgc.ranks_per_node: the node size comes from the launcher variable LOCAL_SIZE (here 2
    # instead of mpirun's OMPI_COMM_WORLD_LOCAL_SIZE of 4), as the deepspeed launcher would set it
    runs = _run_mpirun(4, "torch,mpi,torch:reference", "hierarchical", LOCAL_SIZE=str(L))
    return runs, runs["torch"]


def test_mpi_backend_bit_identical_to_torch_hierarchical(hier):
    _assert_backends_equal(hier[0], 4)


def test_fused_op_bit_identical_to_reference_hierarchical(hier):
    _assert_backends_equal(hier[0], 4, "torch", "torch:reference")
    _assert_ops(hier[0], 4)


def _assert_ops(runs, world):
    """The default run used the fused op for INT4 cases; the reference run did not."""
    for rank in range(world):
        fused = runs["torch"][rank]
        ref = runs["torch:reference"][rank]
        for case, kw in CASES.items():  # the fused op takes every quantized job (and hands what it cannot code on)
            assert fused[case].ops == ("fused-cpu" if kw["quantization"] != "none" else "reference"), case
            assert ref[case].ops == "reference"


W = 4
N = W // L


def _block(flat: torch.Tensor, n: int, local: int) -> torch.Tensor:
    """float64 (N, c): the slices of owners k*L + local of a flat tensor of n elements, zero padded."""
    c = math.ceil(n / W)
    padded = torch.nn.functional.pad(flat.reshape(-1).double(), (0, W * c - n)).view(W, c)
    return padded[local::L]


def _residual(ranks, case, r, step, i):
    c = math.ceil(SIZES[i] / W)
    if step < 0 or i not in ranks[r][case].steps[step].residuals:
        return torch.zeros(N, c, dtype=torch.float64)
    return ranks[r][case].steps[step].residuals[i].double().view(N, c)


def _node_acc(ranks, case, r, step, i):
    """What rank r compresses: its node's sum of g/W over its owners' slices, plus its residual."""
    node = r // L
    g = sum(ranks[s][case].steps[step].inputs[i].reshape(-1).double() for s in range(node * L, node * L + L))
    return _block(g / W, SIZES[i], r % L) + _residual(ranks, case, r, step - 1, i)


def _output(ranks, case, step, i):
    n = SIZES[i]
    c = math.ceil(n / W)
    parts = []
    for r in range(W):
        o = ranks[r][case].steps[step].outputs[i]
        assert o.numel() == max(0, min(c, n - r * c))
        parts.append(o.double())
    return torch.nn.functional.pad(torch.cat(parts), (0, W * c - n)).view(W, c)


@pytest.mark.parametrize("case", list(CASES))
def test_hierarchical_delivers_what_was_sent_and_conserves(hier, case):
    _, ranks = hier
    rel = STORAGE_REL_ERROR[CASES[case].get("residual_dtype", "fp32")]
    for i, n in enumerate(SIZES):
        grad_sum = sum(ranks[r][case].steps[t].inputs[i].reshape(-1).double() for r in range(W)
                       for t in range(STEPS)) / W
        delivered = torch.zeros(W, math.ceil(n / W), dtype=torch.float64)
        lost_total = 0.0
        for t in range(STEPS):
            out = _output(ranks, case, t, i)
            for o in range(W):
                senders = range(o % L, W, L)
                sent = sum((_node_acc(ranks, case, q, t, i) - _residual(ranks, case, q, t, i))[o // L] for q in senders)
                # the committed residuals are rounded by their storage (fp32: exact); the node sums are fp32 (here
                # float64), which shows where gradients of very different scales meet (auto_scales)
                lost = sum(rel * float(_residual(ranks, case, q, t, i).abs().max())
                           + 1e-6 * float(_node_acc(ranks, case, q, t, i).abs().max()) for q in senders)
                torch.testing.assert_close(out[o], sent, rtol=0, atol=1e-5 * max(1.0, float(sent.abs().max())) + lost)
            delivered += out
            lost_total += rel * sum(float(_residual(ranks, case, q, t, i).abs().max()) for q in range(W))
        residual_total = torch.zeros(W, math.ceil(n / W), dtype=torch.float64)
        for r in range(W):
            residual_total[r % L::L] += _residual(ranks, case, r, STEPS - 1, i)
        total = (delivered + residual_total).reshape(-1)[:n]
        torch.testing.assert_close(total, grad_sum, rtol=0, atol=1e-4 * float(grad_sum.abs().max()) + lost_total)


def test_hierarchical_dense_int4_within_bound_of_float64(hier):
    """Error per owner at most the sum over its N senders of half their largest group scale."""
    _, ranks = hier
    for t in range(STEPS):
        for i, n in enumerate(SIZES):
            out = _output(ranks, "dense_int4", t, i)
            for o in range(W):
                accs = [_node_acc(ranks, "dense_int4", q, t, i) for q in range(o % L, W, L)]
                exact = sum(a[o // L] for a in accs)
                bound = sum(float(a.abs().max()) / 7 / 2 for a in accs) * (1 + 1e-5) + 1e-7
                assert float((out[o] - exact).abs().max()) <= bound
            if n >= 42:  # real quantization error, so the bound is not vacuous
                exact_all = torch.stack([sum(_node_acc(ranks, "dense_int4", q, t, i)[o // L] for q in range(o % L, W, L))
                                         for o in range(W)])
                assert float((out - exact_all).abs().max()) > 0


def test_hierarchical_lossless_is_the_two_level_sum(hier):
    """Exactly (g0/W + g1/W) + (g2/W + g3/W) in fp32, and within fp32 rounding of stock's flat sum."""
    _, ranks = hier
    for t in range(STEPS):
        for i, n in enumerate(SIZES):
            g = [ranks[r]["lossless"].steps[t].inputs[i].reshape(-1).div(W) for r in range(W)]
            two_level = (g[0] + g[1]) + (g[2] + g[3])
            out = _output(ranks, "lossless", t, i).reshape(-1)[:n].float()
            assert torch.equal(out, two_level)
            flat = ((g[0] + g[1]) + g[2]) + g[3]
            # two reorderings of a 4-term fp32 sum differ by at most a few ulps of sum |g|
            assert bool(((out - flat).abs() <= 3 * 2.0**-24 * sum(x.abs() for x in g)).all())
            assert all(not ranks[r]["lossless"].steps[t].residuals for r in range(W))


def test_hierarchical_selection_count_and_byte_split(hier):
    _, ranks = hier
    C = sum(math.ceil(n / W) for n in SIZES)
    for r in range(W):
        for t in range(STEPS):
            step = ranks[r]["sparse_int4"].steps[t]
            real = [int((_block(torch.ones(n), n, r % L) != 0).sum()) for n in SIZES]
            assert step.kept == sum(target_count(k, CASES["sparse_int4"]["density"]) for k in real)
            # hop 1 is dense fp32: to the one node-mate, N rows of C values, plus its size word
            assert step.intra_node_wire_bytes == (L - 1) * (N * C * 4 + 8)
            assert step.inter_node_wire_bytes > 0
            dense = ranks[r]["lossless"].steps[t]
            assert step.inter_node_wire_bytes < dense.inter_node_wire_bytes
            assert step.wire_bytes == step.intra_node_wire_bytes + step.inter_node_wire_bytes


def test_hierarchical_density_auto_agrees_between_nodes_and_sets_the_count(hier):
    """density "auto" (rank r's gradients scaled by 1000**r): the ranks that exchange between nodes (one local rank
    on every node) use one density, the largest they estimated on their node-level sums, within the bounds; each
    keeps that density's count of its real node-level elements."""
    _, ranks = hier
    cfg = CASES["auto_scales"]
    for local in range(L):
        peers = range(local, W, L)
        densities = [[ranks[r]["auto_scales"].steps[t].density for t in range(STEPS)] for r in peers]
        assert all(d == densities[0] for d in densities), densities
        assert all(cfg["density_min"] <= d <= cfg["density_max"] for d in densities[0])
        assert any(d < cfg["density_max"] for d in densities[0])  # it chose, not the cap every time
        for r in peers:
            for t in range(STEPS):
                real = [int((_block(torch.ones(n), n, local) != 0).sum()) for n in SIZES]
                assert ranks[r]["auto_scales"].steps[t].kept == sum(target_count(k, densities[0][t]) for k in real)


def test_hierarchical_threshold_reuse_estimates_every_n_steps(hier):
    """threshold_reuse_steps 3: a sparsified tensor's threshold is estimated at steps 0 and 3 and served again at
    steps 1 and 2, on the node-level sums as on the flat topology."""
    _, ranks = hier
    for r in range(W):
        steps = ranks[r]["reuse_threshold"].steps
        reused = 0
        for t, step in enumerate(steps):
            for i, n in enumerate(SIZES):
                real = int((_block(torch.ones(n), n, r % L) != 0).sum())
                if target_count(real, 0.1) >= real:
                    assert i not in step.thresholds
                    continue
                assert_threshold_schedule(steps, t, i)
                reused += t % 3 != 0
        assert reused > 0
