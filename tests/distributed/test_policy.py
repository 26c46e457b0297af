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


def _dct_coefficients(x: torch.Tensor, owner_chunk: int, s: int) -> torch.Tensor:
    """float64 orthonormal DCT-II of every chunk of ``s`` elements inside each owner's partition of the flat ``x``
    (``owner_chunk`` elements each, the last padded with zeros), the chunks without padding only: ``(chunks, s)``
    (where a chunk has padding, the extraction's IDCT also touched the padding, which is not kept)."""
    n = torch.arange(s, dtype=torch.float64)
    basis = torch.cos(math.pi * (n[None, :] + 0.5) * n[:, None] / s) * math.sqrt(2.0 / s)
    basis[0] /= math.sqrt(2.0)
    width = -(-owner_chunk // s) * s
    real = torch.nn.functional.pad(torch.ones_like(x), (0, 2 * owner_chunk - x.numel())).view(2, owner_chunk)
    parts = torch.nn.functional.pad(x, (0, 2 * owner_chunk - x.numel())).view(2, owner_chunk)
    full = torch.nn.functional.pad(real, (0, width - owner_chunk)).reshape(-1, s).all(dim=1)
    return (torch.nn.functional.pad(parts, (0, width - owner_chunk)).reshape(-1, s) @ basis.T)[full]


def test_policy_auto_under_decoupled_momentum_sends_the_extraction_by_stock():
    """Decoupled momentum (fp32 momentum, top-2 of chunks of 16, INT4) with the agreed choices alternating
    compressed and stock, 6 steps. Checked in float64 from what each rank recorded (its gradient and committed
    momentum after every step), for every step whichever way its bucket went: each rank's extraction ``q = decay m +
    g / 2 - m'`` (``m'`` the momentum it kept) has at most 2 nonzero DCT coefficients in each chunk of 16 of each
    owner's partition (DeMo's top-k, not the whole momentum), the owners hold the sum of the ranks' extractions, and
    their step is DeMo's sign step on it (lr 1e-2, no weight decay). A bucket sent by stock therefore trains as the
    compressed one does: the method's step, only the bytes differ."""
    decay = 0.9
    dm = {"enabled": True, "policy": "auto", "policy_interval": 2,
          "decoupled_momentum": {"chunk": 16, "topk": 2, "quantization": "int4", "decay": decay}}
    ranks = run_scenario(ScriptedPolicy(steps=6, local_grads=True, script="cs", config={
        "dgc": dm, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}}}))
    keys = ranks[0].keys
    stats = ranks[0].stats
    assert stats["policy"] == ranks[1].stats["policy"]
    # both ways taken: some buckets by stock, and fewer bytes than stock's in all
    assert stats["stock_buckets_total"] > 0 and stats["wire_bytes_total"] < 0.8 * stats["dense_fp32_bytes_total"], stats
    for t in range(6):
        for i, key in enumerate(keys):
            extractions = []
            for rec in ranks:
                after = rec.momenta[t][key].double()
                before = rec.momenta[t - 1][key].double() if t else torch.zeros_like(after)
                q = decay * before + rec.local_grads[t][i].double().reshape(-1) / 2 - after
                coef = _dct_coefficients(q, -(-q.numel() // 2), 16)
                big = coef.abs() > 1e-4 * coef.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
                assert int(big.sum(dim=1).max()) <= 2, (t, key)
                assert bool((after != 0).any()) or q.numel() <= 2 * 2, (t, key)  # the rest is kept, not sent
                extractions.append(q)
            got = ranks[0].grads[t][i].double().reshape(-1)
            total = sum(extractions)
            torch.testing.assert_close(got, total, rtol=1e-5, atol=1e-6 * float(total.abs().max()))
            p0, p1 = ranks[0].params[t][i].double(), ranks[0].params[t + 1][i].double()
            torch.testing.assert_close((p0 - p1).reshape(-1), 1e-2 * torch.sign(got), rtol=1e-4, atol=1e-7)
