"""Quantized parameter all-gather in 2 and 4 real processes (parameters gathered in forward and backward)."""

import pytest
import torch

from dist_launch import run_scenario
from scenarios import QuantizedGather
from scenarios.allgather import STEPS

# Largest error of a gathered weight, as a fraction of the absmax of its scale group.
BOUND = {"none": 0.0, "int8": 0.5 / 127, "fp8_e4m3": 16.0 / 448, "int4": 0.5 / 7}
# Bytes on the wire over fp32 bytes: 1 (or 1/2) byte per weight plus a 4-byte scale per 256.
RATIO = {"none": (1.0, 1.0), "int8": (0.25, 0.26), "fp8_e4m3": (0.25, 0.26), "int4": (0.125, 0.135)}
MODULES = {"l1": 2, "ln": 2, "l2": 2}  # parameters per module, in engine.module.parameters() order


@pytest.mark.parametrize("world,fmt,hpz,sequential,nodes,scale", [(2, "none", 1, 0, 0, 1), (2, "int8", 1, 0, 0, 1),
                                                                  (2, "fp8_e4m3", 1, 0, 0, 1), (2, "int4", 1, 0, 0, 1),
                                                                  (4, "int8", 1, 0, 2, 1), (4, "int4", 2, 0, 2, 1),
                                                                  (2, "fp8_e4m3", 1, 1, 0, 1), (2, "int8", 1, 0, 0, 1000)],
                         ids=["w2-none", "w2-int8", "w2-fp8", "w2-int4", "w4-int8-2x2", "w4-int4-hpz2-2x2",
                              "w2-fp8-sequential", "w2-int8-weight-1000x-bias"])
def test_gathered_weights(world, fmt, hpz, sequential, nodes, scale):
    """Coalesced gathers (one per module), hpZ secondary groups, and one gather per parameter; at 4 ranks as 2 nodes
    of 2 the gradients take the hierarchical topology too. Each gathered parameter is within its format's bound of
    its own absmax, also when it is gathered together with a parameter 1000 times larger (l1.weight beside l1.bias):
    scale groups never span two parameters."""
    job = QuantizedGather(format=fmt, hpz=hpz, sequential=bool(sequential), node_size=nodes, scale_l1_weight=scale)
    records = run_scenario(job, world, timeout_s=300)
    ranks = [rec.steps for rec in records]
    for t in range(STEPS):
        rec = ranks[0][t]
        exact = iter(rec.exact)
        for module, n in MODULES.items():
            seen = rec.seen[module]
            ref = [next(exact) for _ in range(n)]
            for i, (s, w) in enumerate(zip(seen, ref)):  # each parameter against its own absmax
                absmax, err = float(w.abs().max()), float((s - w).abs().max())
                assert err <= BOUND[fmt] * absmax * (1 + 1e-5), f"step {t} {module}[{i}]: error {err}, absmax {absmax}"
            if fmt != "none" and module != "ln":
                assert max(float((s - w).abs().max()) for s, w in zip(seen, ref)) > 0  # really quantized
            for r in range(1, world):  # every rank computes with the same weights
                assert all(torch.equal(a, b) for a, b in zip(seen, ranks[r][t].seen[module]))
        for r in range(world):
            assert ranks[r][t].shards_unchanged, "a gather changed the stored shards"
            assert ranks[r][t].master_equal, "stored shards differ from the fp32 master partition"
            lo, hi = RATIO[fmt]
            ratio = ranks[r][t].param_wire / ranks[r][t].param_dense
            assert lo <= ratio <= hi, f"rank {r} step {t}: all-gather bytes ratio {ratio}"
    for r in range(world):  # GatheredParameters is an exact path: never quantized
        assert records[r].gathered_exact, "GatheredParameters did not give the exact fp32 weights"
    losses = [rec.loss for rec in ranks[0]]
    assert all(l == l for l in losses)  # finite
    if nodes:  # bytes crossing nodes: 2 of the 3 peers of a 4-rank gather are on the other node
        for r in range(world):
            for t in range(1, STEPS):  # (step 0's forward uses hpZ's secondary shards made at init)
                rec = ranks[r][t]
                share = rec.param_inter_dense / rec.param_dense
                # without hpZ every gather spans both nodes: 2/3 of the bytes cross; with hpZ the
                # backward gather (n/2 from 1 peer) stays in the node and only forward's crosses:
                # (2 * n/4) / (3 * n/4 + n/2) = 0.4
                assert share == pytest.approx(0.4 if hpz == 2 else 2 / 3, abs=0.03), (r, t, share)
                wire_share = rec.param_inter_wire / rec.param_wire
                assert wire_share == pytest.approx(share, abs=0.03)
                assert rec.grad_inter_wire > 0
