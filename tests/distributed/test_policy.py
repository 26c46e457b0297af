"""``"dgc": {"policy": "auto"}`` in 2 real processes: the ranks agree on every bucket's choice, a bucket sent by stock
takes its residuals along, and a run that always chooses stock is stock ZeRO-3 bit for bit."""

import math

import torch

from dist_launch import run_scenario
from scenarios import ScriptedPolicy, Train

from .test_momentum import _node_rows

AUTO = {"enabled": True, "policy": "auto", "policy_interval": 2, "residual_dtype": "fp32",
        "weights": {"quantization": "int4"}}


def test_policy_auto_switches_buckets_and_conserves_what_was_not_sent():
    """6 steps, measured again every 2 applied steps, the agreed choices alternating compressed and stock while rank
    1's own times say the opposite (tests/workers/scenarios/policy.py; at the compressed rounds stock is
    timed only once, by the agreed times of the first run): every rank chose the same; both
    choices happened; checked in float64 from what each rank recorded, the averaged gradient of every parameter is
    the sum over ranks of residual + g / 2 - residual' (compressed: dense INT4 with error feedback; stock: the
    residual goes along and becomes exactly 0), and some bucket went stock right after a compressed step, so a
    non-zero residual was sent by stock."""
    ranks = run_scenario(ScriptedPolicy(steps=6, local_grads=True, script="Cs", config={"dgc": AUTO}))
    keys = ranks[0].keys
    stats = [rec.stats for rec in ranks]
    assert stats[0]["policy"] == stats[1]["policy"] and stats[0]["policy"]
    assert {d["choice"] for d in stats[0]["policy"].values()} <= {"stock", "compressed"}
    buckets = [d for k, d in stats[0]["policy"].items() if not k.startswith("all-gather")]
    assert buckets and all(d["measured_at_step"] == 4 for d in buckets)  # measured at 0, 2 and 4
    assert 0 < stats[0]["stock_buckets_total"] == stats[1]["stock_buckets_total"]
    assert stats[0]["policy_probe_bytes"] > 0
    gathers = [d["choice"] for k, d in stats[0]["policy"].items() if k.startswith("all-gather")]
    assert gathers and set(gathers) == {"compressed"}  # the last round (step 4) agreed on compressed
    assert stats[0]["param_wire_bytes_total"] < 0.5 * stats[0]["param_dense_fp32_bytes_total"]
    flushed = compressed = 0
    for t in range(6):
        for i, key in enumerate(keys):
            total = 0
            # stock before anything was compressed leaves no residual at all
            after = [rec.residuals[t].get(key, torch.zeros(1)).double() for rec in ranks]
            went_stock = all(bool((a == 0).all()) for a in after)
            for rec, a in zip(ranks, after):
                g = rec.local_grads[t][i].double().reshape(-1)
                before = rec.residuals[t - 1].get(key) if t else None
                before = torch.zeros_like(g) if before is None else before.double()
                total = total + before + g / 2 - a
                flushed += int(went_stock and bool((before != 0).any()))
            compressed += int(not went_stock)
            got = ranks[0].grads[t][i].double().reshape(-1)
            torch.testing.assert_close(got, total, rtol=1e-5, atol=1e-6 * float(total.abs().max()))
    assert flushed > 0 and compressed > 0


def test_policy_auto_on_the_hierarchical_topology_sends_the_node_level_residuals_with_stock():
    """4 ranks as 2 nodes of 2, the same script: rank (k, l)'s residual is of its node's sums for the owners k'L + l;
    in float64, the averaged gradient is the sum over nodes of residual + node sum of g / W - residual', where a bucket
    sent by stock added the residual to this rank's gradient at those owners' slices and left it exactly 0."""
    W, L = 4, 2
    N = W // L
    ranks = run_scenario(ScriptedPolicy(steps=6, local_grads=True, script="cs", config={"dgc": dict(
        AUTO, topology="hierarchical", ranks_per_node=L)}), world=W, timeout_s=400)
    keys = ranks[0].keys
    shapes = [p.shape for p in ranks[0].params[0]]
    assert all(rec.stats["policy"] == ranks[0].stats["policy"] for rec in ranks)
    flushed = 0
    for t in range(6):
        for i, key in enumerate(keys):
            n = math.prod(shapes[i])
            c = -(-n // W)
            sent_rows = torch.zeros(W, c, dtype=torch.float64)
            for r, rec in enumerate(ranks):
                node, local = divmod(r, L)
                mine = sum(_node_rows(ranks[s].local_grads[t][i], W, L, local)
                           for s in range(node * L, node * L + L)) / W
                before = rec.residuals[t - 1].get(key) if t else None
                before = torch.zeros_like(mine) if before is None else before.double().view(N, c)
                after = rec.residuals[t].get(key)
                after = torch.zeros_like(mine) if after is None else after.double().view(N, c)
                flushed += int(bool((after == 0).all()) and bool((before != 0).any()))
                sent_rows[local::L] += before + mine - after
            total = sent_rows.reshape(-1)[:n]
            got = ranks[0].grads[t][i].double().reshape(-1)
            torch.testing.assert_close(got, total, rtol=1e-5, atol=1e-6 * float(total.abs().max()))
    assert flushed > 0


def test_policy_auto_that_always_chooses_stock_is_stock_bit_for_bit():
    """Every measurement agrees on stock (rank 1's own times say compressed), of the buckets and of the INT4 weight
    gathers: 4 steps with the same losses, full gradients and parameters as stock ZeRO-3, bit for bit, and the
    telemetry counts every bucket as stock's."""
    stock = run_scenario(Train(steps=4))
    ours = run_scenario(ScriptedPolicy(steps=4, script="s", config={"dgc": AUTO}))
    for r in range(2):
        assert ours[r].losses == stock[r].losses
        for a, b in zip(ours[r].grads, stock[r].grads):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        for a, b in zip(ours[r].params, stock[r].params):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        stats = ours[r].stats
        assert stats["stock_buckets_total"] > 0 and all(d["choice"] == "stock" for d in stats["policy"].values())
        assert any(k.startswith("all-gather") for k in stats["policy"])
        assert stats["param_wire_bytes_total"] >= stats["param_dense_fp32_bytes_total"] * 0.99  # stock's bytes
        assert stats["compression_ratio"] == 1.0 or abs(stats["compression_ratio"] - 1.0) < 0.02


def test_policy_auto_under_decoupled_momentum_sends_the_whole_momentum_by_stock():
    """Decoupled momentum (fp32 momentum, top-2 of chunks of 16, INT4) with the agreed choices alternating
    compressed and stock, 6 steps. Checked in float64 from what each rank recorded (its gradient and committed
    momentum after every step): a bucket sent by stock carried every rank's whole momentum, so what the owners hold
    is the sum over ranks of decay m + g / 2 and the momenta are then exactly 0; a compressed one left momenta that
    are not; the owners' step is DeMo's sign step on what they hold, in both cases (lr 1e-2, no weight decay)."""
    decay = 0.9
    dm = {"enabled": True, "policy": "auto", "policy_interval": 2,
          "decoupled_momentum": {"chunk": 16, "topk": 2, "quantization": "int4", "decay": decay}}
    ranks = run_scenario(ScriptedPolicy(steps=6, local_grads=True, script="cs", config={
        "dgc": dm, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}}}))
    keys = ranks[0].keys
    assert ranks[0].stats["policy"] == ranks[1].stats["policy"] and ranks[0].stats["stock_buckets_total"] > 0
    carried = compressed = 0
    for t in range(6):
        for i, key in enumerate(keys):
            after = [rec.momenta[t][key].double() for rec in ranks]
            before = [rec.momenta[t - 1][key].double() if t else torch.zeros_like(after[0]) for rec in ranks]
            got = ranks[0].grads[t][i].double().reshape(-1)
            if all(bool((a == 0).all()) for a in after):  # went by stock
                total = sum(decay * b + rec.local_grads[t][i].double().reshape(-1) / 2
                            for b, rec in zip(before, ranks))
                torch.testing.assert_close(got, total, rtol=1e-5, atol=1e-6 * float(total.abs().max()))
                carried += int(any(bool((b != 0).any()) for b in before))
            else:
                compressed += 1
            p0, p1 = ranks[0].params[t][i].double(), ranks[0].params[t + 1][i].double()
            step = (p0 - p1).reshape(-1)
            torch.testing.assert_close(step, 1e-2 * torch.sign(got), rtol=1e-4, atol=1e-7)
    assert carried > 0 and compressed > 0
