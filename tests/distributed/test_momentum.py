"""The momentum methods through ZeRO-3 in 2 real processes, against stock DeepSpeed and float64 replays of what each
rank recorded: compressed momentum (1-bit Adam) and DGC's momentum correction (momentum SGD)."""

import math

import pytest
import torch

from deepspeed_dgc.codec.layout import padded_elements

from deepspeed_dgc.config import DGCConfigError
from deepspeed_dgc.zero3.optimizer import V_FLOOR, check_adam_method, check_step_optimizer, decoupled_weight_decay
from dist_launch import run_scenario, run_scenarios
from scenarios import Train

from ..unit.codec.jobs import dct64
from .test_engine import LOSSLESS, SPARSE

SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}},
       "zero_allow_untested_optimizer": True}


def test_compressed_momentum_is_adam_before_the_freeze_and_uses_the_frozen_v_after():
    """compressed_momentum, lossless otherwise, frozen after step 3, momentum sent raw: steps 1-3 equal stock
    ZeRO-3 Adam bit for bit; every step equals a float64 reference of Adam with ZeRO-3's gradient clipping
    (steps 1-3) and of the
    frozen-variance update p <- p (1 - lr wd) - lr m / (sqrt(max(v_hat_3, floor)) + eps) (steps 4-6), with m the
    sum of the ranks' momenta of their own (unclipped) gradients and floor 1% of the mean v_hat over each owner's
    partition."""
    stock = run_scenario(Train(steps=6, local_grads=True), timeout_s=300)
    ours = run_scenario(Train(steps=6, local_grads=True, lr_scheduler=True, config={"dgc": dict(
        LOSSLESS, compressed_momentum={"freeze_step": 3, "quantization": "none", "precondition": False})}),
        timeout_s=300)
    for r in range(2):
        for t in range(4):
            assert all(torch.equal(a, b) for a, b in zip(stock[r].params[t], ours[r].params[t])), (r, t)
    opt = ours[0].optimizer
    assert opt.type in ("Adam", "AdamW")
    lr, (b1, b2), eps = opt.lr, opt.betas, opt.eps
    wd = opt.weight_decay if opt.type == "AdamW" else 0.0
    params = [p.double() for p in ours[0].params[0]]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    local_m = [torch.zeros_like(p) for p in params]
    inv = None
    for t in range(1, 7):
        grads = [(a.double() + b.double()) / 2 for a, b in zip(ours[0].local_grads[t - 1], ours[1].local_grads[t - 1])]
        # ZeRO-3 clips by the global norm; after the freeze it does not
        clip = _clip_factor(opt.gradient_clipping, grads) if t <= 3 else 1.0
        for i, g in enumerate(grads):
            g = g.reshape(params[i].shape)
            local_m[i] = b1 * local_m[i] + (1 - b1) * g  # the ranks' momenta: of their own, unclipped gradients
            m[i] = b1 * m[i] + (1 - b1) * g / clip  # Adam's, of the clipped mean gradient
            if t <= 3:
                v[i] = b2 * v[i] + (1 - b2) * (g / clip)**2
                update = (m[i] / (1 - b1**t)) / ((v[i] / (1 - b2**t)).sqrt() + eps)
            else:
                if t == 4 and i == 0:
                    inv = []
                    for vi in v:
                        v_hat = (vi / (1 - b2**3)).reshape(-1)
                        c = math.ceil(v_hat.numel() / 2)
                        padded = torch.nn.functional.pad(v_hat, (0, 2 * c - v_hat.numel())).view(2, c)
                        floors = V_FLOOR * padded.mean(dim=1, keepdim=True)  # per owner partition, padding included
                        inv.append((1 / (torch.maximum(padded, floors).sqrt() + eps)).reshape(-1)[:v_hat.numel()])
                update = local_m[i] * inv[i].view(params[i].shape)
            params[i] = params[i] * (1 - lr * wd) - lr * update
        for r in range(2):
            for i, (got, want) in enumerate(zip(ours[r].params[t], params)):
                torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-6, msg=f"rank {r} step {t} param {i}")
    # the freeze changed the trajectory (the comparison after it is not stock Adam again)
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(stock[0].params[6], ours[0].params[6]))
    # lossless: no residual; fp32 local momentum (4 B) and this owner's fp32 1/(sqrt(v_hat)+eps) on half the params
    assert ours[0].stats["state_bytes_per_param"] == pytest.approx(4.0 + 4.0 / 2, rel=0.02)


def test_momentum_correction_dense_equals_stock_momentum_sgd():
    """DGC's momentum correction with every element sent and nothing quantized is momentum SGD: the ranks apply the
    momentum to their own gradients, the owners apply it only to the weight-decay term (SGD, momentum 0.9, weight
    decay 0.01, 6 steps, 2 ranks, compared with stock ZeRO-3 at every step)."""
    stock = run_scenario(Train(steps=6, local_grads=True, config=dict(SGD, gradient_clipping=0.0)), timeout_s=300)
    # DeepSpeed's clipping (1.0) must be switched off by momentum_correction, else this run would differ from stock
    ours = run_scenario(Train(steps=6, local_grads=True, lr_scheduler=True, config=dict(
        SGD, gradient_clipping=1.0, dgc=dict(LOSSLESS, momentum_correction=True))), timeout_s=300)
    assert ours[0].optimizer.type == "SGD" and ours[0].optimizer.momentum == 0.9
    for r in range(2):
        for t in range(7):
            for a, b in zip(ours[r].params[t], stock[r].params[t]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert ours[r].skipped[-1] == 0 and len(ours[r].momenta) == 6
    # momentum really acts: the last step is not lr * (mean gradient + wd p)
    lr, last = 0.05, 5
    mean_g = [(a + b) / 2 for a, b in zip(stock[0].local_grads[last], stock[1].local_grads[last])]
    plain = [p - lr * (g.view(p.shape) + 0.01 * p) for p, g in zip(stock[0].params[last], mean_g)]
    assert max(float((x - y).abs().max()) for x, y in zip(plain, stock[0].params[last + 1])) > 1e-4


def test_momentum_correction_masks_the_sent_velocity_and_the_owner_applies_only_what_was_sent():
    """density 0.1, no quantization, local_clip_norm 0.05, weight decay 0.01, 2 ranks, 6 steps, checked in float64
    from what each rank recorded: the velocity is u = 0.9 u + clip(g) / 2 (each tensor's local gradient clipped to
    norm 0.05); error feedback accumulates u; where top-k sent an element its residual and its velocity are 0
    (momentum factor masking), elsewhere both carry on; and every parameter moves by exactly -lr (sum over ranks
    of what they sent + b), b = 0.9 b + wd p (the owner adds momentum to the weight-decay term only)."""
    ranks = run_scenario(Train(steps=6, local_grads=True, lr_scheduler=True, config=dict(
        SGD, gradient_clipping=0.0, dgc=dict(SPARSE, quantization="none", momentum_correction=True,
                                             local_clip_norm=0.05))), timeout_s=300)
    lr, m, clip, wd = 0.05, 0.9, 0.05, 0.01
    wd_buf = None
    ids = ranks[0].keys
    shapes = [p.shape for p in ranks[0].params[0]]
    clipped = kept_total = 0
    for t in range(6):
        sent_sum = [torch.zeros(s, dtype=torch.float64).reshape(-1) for s in shapes]
        for r in range(2):
            rec = ranks[r]
            for i, key in enumerate(ids):
                g = rec.local_grads[t][i].double().reshape(-1)
                norm = float(g.norm())
                if norm > clip:
                    g, clipped = g * (clip / norm), clipped + 1
                u_prev = rec.momenta[t - 1][key].double() if t else torch.zeros_like(g)
                e_prev = (rec.residuals[t - 1][key].double() if t and key in rec.residuals[t - 1]
                          else torch.zeros_like(g))
                u_pre = m * u_prev + g / 2
                acc = u_pre + e_prev
                e = rec.residuals[t][key].double()
                u = rec.momenta[t][key].double()
                sparse = g.numel() >= 256
                if sparse:
                    kept = e == 0
                    n_kept = int(kept.sum())
                    assert 0 < n_kept < g.numel() // 2, (t, r, i, n_kept)
                    kept_total += n_kept
                    assert torch.all(u[kept] == 0), (t, r, i)  # masked
                    torch.testing.assert_close(u[~kept], u_pre[~kept], rtol=1e-5, atol=1e-7)
                    torch.testing.assert_close(e[~kept], acc[~kept], rtol=1e-5, atol=1e-7)
                else:  # sent whole, never masked
                    torch.testing.assert_close(u, u_pre, rtol=1e-5, atol=1e-7)
                    assert torch.all(e == 0)
                sent_sum[i] += acc - e
        before = [p.double().reshape(-1) for p in ranks[0].params[t]]
        wd_buf = [wd * p for p in before] if wd_buf is None else [m * b + wd * p for b, p in zip(wd_buf, before)]
        for i in range(len(ids)):
            after = ranks[0].params[t + 1][i].double().reshape(-1)
            torch.testing.assert_close(after, before[i] - lr * (sent_sum[i] + wd_buf[i]), rtol=1e-5, atol=2e-6)
    assert clipped > 0 and kept_total > 0


def _chunked_dct_top_k(delta, world, s, k):
    """float64 oracle of one rank's send: the owner matrix of ``delta`` cut in chunks of s, the k largest |DCT| per
    chunk; returns what the receivers decode (the kept coefficients transformed back), shape ``delta``'s."""
    n = delta.numel()
    c = -(-n // world)
    m = -(-c // s)
    rows = torch.nn.functional.pad(delta, (0, world * c - n)).view(world, c)
    x = torch.nn.functional.pad(rows, (0, m * s - c)).view(world, m, s)
    d = dct64(s)
    coef = x @ d.T
    idx = coef.abs().topk(k, dim=2).indices
    kept = torch.zeros_like(coef).scatter_(2, idx, coef.gather(2, idx))
    return (kept @ d).view(world, m * s)[:, :c].reshape(-1)[:n]


def _replayed_sums(ranks, steps: int, decay: float, raw: bool, chunk: int = 16, topk: int = 3):
    """Per step, u (float64, one flat tensor per parameter): the sum over the 2 ranks of what each rank's momentum
    lost, ``decay prev + g / 2 - now`` from the recorded momenta and local gradients (fp16: unscaled). ``raw``: what
    was lost is checked against the float64 top-``topk`` of each ``chunk``-column chunk's DCT and the momenta against
    a float64 replay of DeMo's recursion; else (quantized codes) only that something was sent."""
    shapes = [p.shape for p in ranks[0].params[0]]
    delta64 = [[torch.zeros(math.prod(s), dtype=torch.float64) for s in shapes] for _ in range(2)]
    for t in range(steps):
        u = [torch.zeros(math.prod(s), dtype=torch.float64) for s in shapes]
        for r in range(2):
            rec = ranks[r]
            for i, key in enumerate(rec.keys):
                g = rec.local_grads[t][i].double().reshape(-1) / rec.loss_scale[t]  # fp16: scaled by the loss scale
                prev = rec.momenta[t - 1][key].double() if t else torch.zeros_like(g)
                pre = decay * prev + g / 2
                now = rec.momenta[t][key].double()
                sent = pre - now  # what this rank's momentum lost
                if raw:
                    pre64 = decay * delta64[r][i] + g / 2
                    sent64 = _chunked_dct_top_k(pre64, 2, chunk, topk)
                    delta64[r][i] = pre64 - sent64
                    torch.testing.assert_close(sent, sent64, rtol=1e-4, atol=1e-6 * float(pre64.abs().max()))
                    torch.testing.assert_close(now, delta64[r][i], rtol=1e-4, atol=1e-6 * float(pre64.abs().max()))
                else:  # INT4 codes sent: the momentum kept more than a raw top-k leaves, and lost something
                    assert float(sent.abs().max()) > 0
                u[i] += sent
        yield u


def _clip_factor(gradient_clipping: float, u) -> float:
    """What ZeRO-3 divides the partitions by before the step: their global L2 norm (of the tensors ``u``) over
    ``gradient_clipping`` where that is above 1 (1 without clipping)."""
    norm = math.sqrt(sum(float(x.square().sum()) for x in u))
    return max(1.0, (norm + 1e-6) / gradient_clipping) if gradient_clipping > 0 else 1.0


DEMO_LOSSLESS = {"enabled": True, "decoupled_momentum": {"update": "optimizer", "decay": 0.0, "transform": "none",
                                                         "chunk": 8, "topk": 8, "quantization": "none"}}
ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}}}


def test_decoupled_momentum_takes_any_optimizer_shared_masks_need_adam():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1, weight_decay=0.1)
    check_step_optimizer(sgd, "decoupled_momentum")
    assert not decoupled_weight_decay(sgd)  # SGD's weight decay is L2: added to the update before the sign
    assert decoupled_weight_decay(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))]))
    with pytest.raises(DGCConfigError, match="'dgc.shared_mask' needs an Adam optimizer .* got SGD"):
        check_adam_method(sgd, "shared_mask")
    for bad in (None, "0.1"):
        sgd.param_groups[0]["lr"] = bad
        with pytest.raises(DGCConfigError, match=f"a param group of SGD has no 'lr' \\(got {bad!r}\\)"):
            check_step_optimizer(sgd, "decoupled_momentum")
    del sgd.param_groups[0]["lr"]
    with pytest.raises(DGCConfigError, match="a param group of SGD has no 'lr' \\(got None\\)"):
        check_step_optimizer(sgd, "decoupled_momentum")
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    check_adam_method(adam, "shared_mask")
    adam.param_groups[0]["lr"] = None
    with pytest.raises(DGCConfigError, match="a param group of Adam has no 'lr'"):
        check_adam_method(adam, "shared_mask")
    adam.param_groups[0]["lr"] = 0.1
    with pytest.raises(DGCConfigError, match="'fp16'"):  # decoupled momentum runs fp16 and offload (tests below)
        check_adam_method(adam, "shared_mask", fp16=True)
    with pytest.raises(DGCConfigError, match="offload_optimizer"):
        check_adam_method(adam, "shared_mask", offload=True)


def test_decoupled_momentum_lossless_is_stock_adam_bit_for_bit():
    """decoupled_momentum with decay 0, every coordinate of every chunk sent raw, no transform and the owners' own
    Adam: the same parameters as stock ZeRO-3 Adam at every step, bit for bit (2 ranks, 2 micro-steps per step):
    the window's sum sent once against stock's coalesced reduction (the same sum), and with
    ``accumulate_locally: false`` each micro-step sent, the owners accumulating, against stock's own accumulation."""
    every = {"dgc": dict(DEMO_LOSSLESS, accumulate_locally=False)}
    runs = run_scenarios({"stock_coalesced": Train(steps=4, gas=2, coalesce=True),
                          "ours": Train(steps=4, gas=2, coalesce=False, config={"dgc": DEMO_LOSSLESS}),
                          "stock": Train(steps=4, gas=2), "ours_every": Train(steps=4, gas=2, config=every)},
                         timeout_s=300)
    for ours, stock in (("ours", "stock_coalesced"), ("ours_every", "stock")):
        for r in range(2):
            assert runs[ours][r].losses == runs[stock][r].losses
            for t in range(5):
                assert all(torch.equal(a, b) for a, b in zip(runs[stock][r].params[t], runs[ours][r].params[t])), \
                    (ours, r, t)
    # raw fp32 plus positions: more bytes than stock's per send; the held window sends once for stock's two
    assert runs["ours_every"][0].stats["compression_ratio"] < 1.0 < runs["ours"][0].stats["compression_ratio"] < 2.0


SGD_DEMO = dict(SGD, optimizer={"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1}})


FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}
AUTOCAST = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}


@pytest.mark.parametrize("fmt,half,opt,scale", [("none", None, ADAMW, None), ("int4", "bf16", ADAMW, 1.5),
                                                ("none", None, SGD_DEMO, 0.5), ("int4", "fp16", ADAMW, None),
                                                ("int4", "autocast", ADAMW, None)],
                         ids=["raw", "int4-bf16-lr1.5", "raw-sgd-lr0.5", "int4-fp16", "int4-autocast"])
def test_decoupled_momentum_against_a_float64_replay(fmt, half, opt, scale):
    """DeMo's method, 2 ranks, 6 steps, AdamW (weight decay 0.1), chunks of 16, 3 coefficients each, decay 0.9:
    every rank's momentum is delta = 0.9 delta + g / 2 minus what it sent, and every parameter moves by
    p <- p (1 - lr wd) - lr sign(u) with u the sum over ranks of what their momenta lost (sign checked where
    |u| is not at rounding level). ``raw-sgd``: momentum SGD (weight decay 0.1, L2): p <- p - lr sign(u + wd p),
    at SGD's learning rate and schedule, its momentum buffer unused. ``int4-fp16``: an fp16 engine with dynamic loss
    scaling (the owners' partitions carry u times the loss scale, and ZeRO-3 divides it out before the sign).
    ``lr1.5`` / ``lr0.5``: ``lr_scale`` 1.5 / 0.5, the sign term's rate times it, decoupled weight decay's not (L2's
    is inside the sign; unset: 1). Raw values: what was sent is the float64 top-3 of each chunk's DCT, and the
    momenta equal the float64 replay. INT4: the sum the owner applies includes the quantization, and what a
    momentum lost is exactly what was sent (the rest stays); also with a bf16 engine (bf16 gradients, the fp32
    master partitions step)."""
    lr, wd, decay = 1e-2, 0.1, 0.9
    method = {"chunk": 16, "topk": 3, "decay": decay, "quantization": fmt, **({"lr_scale": scale} if scale else {})}
    scale = scale or 1.0
    ranks = run_scenario(Train(steps=6, local_grads=True, lr_scheduler=True, config=dict(opt, dgc={
        "enabled": True, "decoupled_momentum": method},
        **({"bf16": {"enabled": True}} if half == "bf16" else FP16 if half == "fp16" else AUTOCAST if half else {})),
        allow_fp16=half == "fp16"), timeout_s=300)
    assert ranks[0].optimizer.type == opt["optimizer"]["type"]
    l2 = opt is SGD_DEMO
    keys = ranks[0].keys
    shapes = [p.shape for p in ranks[0].params[0]]
    checked = 0
    for t, u in enumerate(_replayed_sums(ranks, 6, decay, raw=fmt == "none")):
        # ZeRO-3 clips u by its global norm before the step: only the sign is taken, so that matters with L2 alone
        clip = _clip_factor(ranks[0].optimizer.gradient_clipping, u)
        for i in range(len(keys)):
            before = ranks[0].params[t][i].double().reshape(-1)
            after = ranks[0].params[t + 1][i].double().reshape(-1)
            if l2:  # L2: the decay is part of what the sign is taken of
                direction = u[i] / clip + wd * before
                clear = direction.abs() > 1e-4 * float(direction.abs().max())
                want = before - scale * lr * torch.sign(direction)
            else:
                clear = u[i].abs() > 1e-4 * float(u[i].abs().max())
                want = before * (1 - lr * wd) - scale * lr * torch.sign(u[i])
            torch.testing.assert_close(after[clear], want[clear], rtol=1e-6, atol=1e-6)
            checked += int(clear.sum())
            assert torch.equal(ranks[1].params[t + 1][i], ranks[0].params[t + 1][i])
    assert checked > 0.9 * 6 * sum(math.prod(s) for s in shapes)
    # the momentum is stored in fp32: 4 bytes per element of the padded owner matrix (each slice a whole number of
    # 16-column chunks); a 16-column chunk sends 3 values
    numels = [math.prod(s) for s in shapes]
    want = 4.0 * padded_elements(numels, 2, 2, 16) / sum(numels)
    assert ranks[0].stats["state_bytes_per_param"] == pytest.approx(want, rel=1e-6) and want < 4.1


def _check_steps_on_u(ranks, decay: float, replay) -> None:
    """Every parameter after each of 6 steps against ``replay(i, g, before)``: the float64 step of parameter ``i``
    (flat) from ``before`` on ``g``, u (:func:`_replayed_sums`, raw top-3 of 16) over ZeRO-3's clip factor; it returns
    the parameter wanted and where it is checked (a sign's argument not at rounding level). Clipping must have acted
    in 3 steps or more, 90% of the elements be checked, and both ranks hold the same parameters."""
    settings = ranks[0].optimizer
    checked, clipped = 0, 0
    for t, u in enumerate(_replayed_sums(ranks, 6, decay, raw=True)):
        clip = _clip_factor(settings.gradient_clipping, u)
        clipped += clip > 1.0
        for i in range(len(u)):
            before = ranks[0].params[t][i].double().reshape(-1)
            after = ranks[0].params[t + 1][i].double().reshape(-1)
            want, clear = replay(i, u[i] / clip, before)
            torch.testing.assert_close(after[clear], want[clear], rtol=1e-6, atol=1e-6)
            checked += int(clear.sum())
            assert torch.equal(ranks[1].params[t + 1][i], ranks[0].params[t + 1][i])
    assert checked > 0.9 * 6 * sum(p.numel() for p in ranks[0].params[0]) and clipped >= 3


def test_decoupled_momentum_hands_u_to_a_users_lion_against_a_float64_replay():
    """``update: "optimizer"`` with an optimizer DeepSpeed did not build, passed by the user to
    ``deepspeed.initialize``: Lion in plain PyTorch (lr 1e-2, betas (0.9, 0.99), decoupled weight decay 0.1).
    DeMo's momenta with decay 0.9, raw top-3 of 16, 2 ranks, 6 steps, gradient clipping 0.05 (below u's norm, so it
    acts). Lion steps on u, the sum over ranks of what their momenta lost, clipped, as its gradient:
    ``p <- p (1 - lr wd) - lr sign(0.9 m + 0.1 u)``, ``m <- 0.99 m + 0.01 u`` (float64 replay; the sign checked where
    its argument is not at rounding level). Lion on u is what keeps stock Lion's loss on the main job
    (docs/methods.md)."""
    decay = 0.9
    ranks = run_scenario(Train(steps=6, local_grads=True, client_optimizer="lion", config={
        "gradient_clipping": 0.05, "dgc": {"enabled": True, "decoupled_momentum": {
            "chunk": 16, "topk": 3, "decay": decay, "quantization": "none", "update": "optimizer"}}}), timeout_s=300)
    settings = ranks[0].optimizer
    assert settings.type == "Lion" and settings.weight_decay == 0.1
    lr, (b1, b2), wd = settings.lr, settings.betas, settings.weight_decay
    exp_avg = [torch.zeros(p.numel(), dtype=torch.float64) for p in ranks[0].params[0]]

    def lion(i, g, before):
        direction = b1 * exp_avg[i] + (1 - b1) * g
        exp_avg[i].mul_(b2).add_(g, alpha=1 - b2)
        clear = direction.abs() > 1e-4 * float(direction.abs().max())
        return before * (1 - lr * wd) - lr * torch.sign(direction), clear

    _check_steps_on_u(ranks, decay, lion)


def test_decoupled_momentum_hands_u_to_adamw_with_beta1_0_against_a_float64_replay():
    """``update: "optimizer"`` with DeepSpeed's AdamW at ``betas`` (0, 0.99), configs/zero3_dgc_adam_on_u.json's
    setting (docs/methods.md, "AdamW on u"): the decoupled momentum (decay 0.99) is Adam's first moment, Adam keeps
    its second. 2 ranks, 6 steps, raw top-3 of 16, clipping 0.05 (it acts); float64 replay of torch's AdamW on
    u over the clip factor: ``v <- 0.99 v + 0.01 g^2``, ``p <- p (1 - lr wd) - lr g / (sqrt(v / (1 - 0.99^k)) + eps)``
    (beta1 0: no first-moment bias correction)."""
    decay = 0.99
    ranks = run_scenario(Train(steps=6, local_grads=True, config={
        "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.0, 0.99], "eps": 1e-8, "weight_decay": 0.1,
                                                  "torch_adam": True}},
        "dgc": {"enabled": True, "decoupled_momentum": {
            "chunk": 16, "topk": 3, "decay": decay, "quantization": "none", "update": "optimizer"}}}), timeout_s=300)
    settings = ranks[0].optimizer
    assert settings.type == "AdamW" and tuple(settings.betas) == (0.0, 0.99) and settings.weight_decay == 0.1
    lr, b2, eps, wd = settings.lr, settings.betas[1], settings.eps, settings.weight_decay
    exp_avg_sq = [torch.zeros(p.numel(), dtype=torch.float64) for p in ranks[0].params[0]]
    seen = [0] * len(exp_avg_sq)

    def adamw(i, g, before):
        seen[i] += 1
        exp_avg_sq[i].mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (exp_avg_sq[i] / (1 - b2 ** seen[i])).sqrt() + eps
        return before * (1 - lr * wd) - lr * g / denom, torch.ones_like(g, dtype=torch.bool)

    _check_steps_on_u(ranks, decay, adamw)


@pytest.mark.parametrize("held", [True, False], ids=["window-held", "every-micro-step"])
def test_decoupled_momentum_with_gradient_accumulation_against_a_float64_replay(held):
    """Gradient accumulation 2, raw DCT coefficients, DeepSpeed's "Adam" (AdamW mode, weight decay 0.01), 4 steps.
    Held (``accumulate_locally``, the default): the window's gradients add up and their sum / 2 enters each rank's
    momentum once (after one decay), which sends its top-3 of each chunk once. Every micro-step
    (``accumulate_locally: false``): each micro-step adds g / 2 (after the decay) and sends its top-3. Either way the
    owners step once per window with the sign of the sum over ranks (and micro-steps), and decoupled weight decay."""
    decay = 0.9
    ranks = run_scenario(Train(steps=4, gas=2, local_grads=True, config={"dgc": {
        "enabled": True, "accumulate_locally": held,
        "decoupled_momentum": {"chunk": 16, "topk": 3, "decay": decay, "quantization": "none"}}}), timeout_s=300)
    opt = ranks[0].optimizer
    assert opt.type == "AdamW" and opt.weight_decay > 0
    lr, wd = opt.lr, opt.weight_decay
    shapes = [p.shape for p in ranks[0].params[0]]
    delta = [[torch.zeros(math.prod(s), dtype=torch.float64) for s in shapes] for _ in range(2)]
    for t in range(4):
        u = [torch.zeros(math.prod(s), dtype=torch.float64) for s in shapes]
        for r in range(2):
            micros = ranks[r].local_grads_micro[t]
            assert len(micros) == 2
            if held:  # one send of the window's sum
                micros = [[a + b for a, b in zip(*micros)]]
            for grads in micros:
                for i, g in enumerate(grads):
                    pre = decay * delta[r][i] + g.double().reshape(-1) / 2
                    sent = _chunked_dct_top_k(pre, 2, 16, 3)
                    delta[r][i] = pre - sent
                    u[i] += sent
        for i, key in enumerate(ranks[0].keys):
            for r in range(2):
                scale = float(delta[r][i].abs().max()) + 1e-30
                torch.testing.assert_close(ranks[r].momenta[t][key].double(), delta[r][i], rtol=1e-4, atol=1e-5 * scale)
            before = ranks[0].params[t][i].double().reshape(-1)
            after = ranks[0].params[t + 1][i].double().reshape(-1)
            clear = u[i].abs() > 1e-4 * float(u[i].abs().max())
            want = before * (1 - lr * wd) - lr * torch.sign(u[i])
            torch.testing.assert_close(after[clear], want[clear], rtol=1e-6, atol=1e-6)
            assert int(clear.sum()) > 0.9 * u[i].numel()


def test_shared_mask_ranks_send_the_owners_coordinates_and_the_owners_step_on_their_sum():
    """shared_mask (density 0.1, INT4, fp32 residuals), 2 ranks, 6 steps, checked in float64 from what each rank
    recorded: what a rank sent is what its residual lost, sent = residual + g / 2 - residual'; the averaged gradient
    ZeRO-3's Adam stepped on is the sum over ranks of what they sent; step 1 is sent dense (the warm-up), and from
    step 2 on, in each owner's partition of each parameter, both ranks sent values only inside one common set of at
    most k = ceil(0.1 c) coordinates (the owner's mask)."""
    ranks = run_scenario(Train(steps=6, local_grads=True, config={"dgc": {
        "enabled": True, "residual_dtype": "fp32", "shared_mask": {"density": 0.1, "group_size": 32}}}), timeout_s=300)
    keys = ranks[0].keys
    masked_slices = 0
    for t in range(6):
        for i, key in enumerate(keys):
            sent, used_by = [], []
            for r in range(2):
                rec = ranks[r]
                g = rec.local_grads[t][i].double().reshape(-1)
                before = rec.residuals[t - 1][key].double() if t else torch.zeros_like(g)
                acc = before + g / 2
                sent.append(acc - rec.residuals[t][key].double())
                used_by.append(sent[-1].abs() > 1e-6 * acc.abs())  # not fp32 rounding of the accumulation
            total = sent[0] + sent[1]
            got = ranks[0].grads[t][i].double().reshape(-1)
            torch.testing.assert_close(got, total, rtol=1e-5, atol=1e-6 * float(total.abs().max()))
            n = total.numel()
            c = -(-n // 2)
            k = math.ceil(0.1 * c)
            for o in range(2):
                used = used_by[0][o * c:(o + 1) * c] | used_by[1][o * c:(o + 1) * c]
                if t == 0:
                    assert int(used.sum()) > min(k, int(used.numel()) - 1) or used.numel() <= 1
                else:
                    assert int(used.sum()) <= k, (t, key, o, int(used.sum()), k)
                    masked_slices += 1
    assert masked_slices >= 5 * len(keys)
    stats = ranks[0].stats
    assert stats["compression_ratio"] > 3.0  # dense INT4 step 1, then 10% of the values and the masks


def test_shared_mask_on_the_hierarchical_topology_sends_the_owners_coordinates_of_the_node_sums():
    """shared_mask (density 0.1, INT4, fp32 residuals) on 4 ranks as 2 nodes of 2, 5 steps, checked in float64 from
    what each rank recorded. Rank (k, l) holds a residual only of its node's dense sums for the owners k'L + l
    (N x ceil(n / W) elements: 1/L of the parameter); what it sent is what that residual lost, sent = residual + node
    sum of g / W - residual'; the averaged gradient is the sum over nodes of what was sent; from step 2 on, in each
    owner's partition of each parameter, the ranks of every node sent values only inside one common set of at most
    k = ceil(0.1 c) coordinates (the owner's mask, shared between nodes); the masks and values cross nodes only."""
    W, L, steps = 4, 2, 5
    N = W // L
    ranks = run_scenario(Train(steps=steps, local_grads=True, config={"dgc": {
        "enabled": True, "topology": "hierarchical", "ranks_per_node": L, "residual_dtype": "fp32",
        "shared_mask": {"density": 0.1, "group_size": 32}}}), world=W, timeout_s=400)
    keys = ranks[0].keys
    shapes = [p.shape for p in ranks[0].params[0]]
    masked_slices = 0
    for t in range(steps):
        for i, key in enumerate(keys):
            n = math.prod(shapes[i])
            c = -(-n // W)
            k_mask = math.ceil(0.1 * c)
            sent_rows = torch.zeros(W, c, dtype=torch.float64)
            used = torch.zeros(W, c, dtype=torch.bool)
            for r in range(W):
                node, local = divmod(r, L)
                mine = sum(_node_rows(ranks[s].local_grads[t][i], W, L, local)
                           for s in range(node * L, node * L + L)) / W
                rec = ranks[r]
                assert rec.residuals[t][key].numel() == N * c  # 1/L of the parameter (plus padding)
                before = rec.residuals[t - 1][key].double().view(N, c) if t else torch.zeros_like(mine)
                acc = before + mine
                sent = acc - rec.residuals[t][key].double().view(N, c)
                sent_rows[local::L] += sent
                # not fp32 rounding of the node sum and the accumulation (the sum may cancel: relative to the terms)
                used[local::L] |= sent.abs() > 1e-6 * (before.abs() + mine.abs())
            got = ranks[0].grads[t][i].double().reshape(-1)
            total = sent_rows.reshape(-1)[:n]
            torch.testing.assert_close(got, total, rtol=1e-5, atol=1e-6 * float(total.abs().max()))
            for o in range(W):
                if t == 0:  # the warm-up step: dense INT4
                    assert int(used[o].sum()) > min(k_mask, c - 1) or c <= 1
                else:
                    assert int(used[o].sum()) <= k_mask, (t, key, o, int(used[o].sum()), k_mask)
                    masked_slices += 1
    assert masked_slices >= (steps - 1) * W * len(keys)
    stats = ranks[0].stats  # between nodes: dense INT4 at step 1, then 10% of the values and the masks
    assert 0 < stats["grad_inter_node_wire_bytes_total"] < stats["grad_inter_node_dense_fp32_bytes_total"] / 3


@pytest.mark.parametrize("W,L", [(4, 2), (2, 2)], ids=["2x2", "1x2"])
def test_decoupled_momentum_on_the_hierarchical_topology_against_a_float64_replay(W, L):
    """W ranks as nodes of L, raw DCT coefficients, AdamW (weight decay 0.1), 4 steps: rank (k, l) keeps a momentum
    only of its node's dense sums for the owners k'L + l (N x ceil(n / W) elements: 1/L of the parameter), sends the
    top-3 of each chunk to those owners across nodes, and the owner steps with the sign of the sum over nodes; past an
    owner's real elements (the last owner's padding) the momentum stays 0. On one node (1x2) nothing crosses a node but
    the momentum and its extraction are the same (DeMo's step, not signSGD)."""
    lr, wd, decay = 1e-2, 0.1, 0.9
    N = W // L
    ranks = run_scenario(Train(steps=4, local_grads=True, config=dict(ADAMW, dgc={
        "enabled": True, "topology": "hierarchical", "ranks_per_node": L,
        "decoupled_momentum": {"chunk": 16, "topk": 3, "decay": decay, "quantization": "none"}})),
        world=W, timeout_s=400)
    keys = ranks[0].keys
    shapes = [p.shape for p in ranks[0].params[0]]
    delta = {}
    for t in range(4):
        for i, key in enumerate(keys):
            n = math.prod(shapes[i])
            c = -(-n // W)
            owner_rows = [torch.nn.functional.pad(ranks[r].local_grads[t][i].double().reshape(-1) / W,
                                                  (0, W * c - n)).view(W, c) for r in range(W)]
            node_sum = [sum(owner_rows[k * L + j] for j in range(L)) for k in range(N)]  # (W, c) per node
            u = torch.zeros(W, c, dtype=torch.float64)
            for k in range(N):
                for lr_ in range(L):
                    r = k * L + lr_
                    mine = torch.stack([node_sum[k][j * L + lr_] for j in range(N)]).reshape(-1)  # owners jL + l
                    pre = decay * delta.get((r, i), torch.zeros_like(mine)) + mine
                    sent = _chunked_dct_top_k(pre, N, 16, 3).view(N, c)
                    rest = (pre - sent.reshape(-1)).view(N, c)
                    for j in range(N):  # what the momentum keeps past an owner's real elements (padding) is 0
                        rest[j, max(0, min(c, n - (j * L + lr_) * c)):] = 0
                    delta[(r, i)] = rest.reshape(-1)
                    got = ranks[r].momenta[t][key].double()
                    assert got.numel() == N * c  # 1/L of the parameter (plus padding)
                    torch.testing.assert_close(got, delta[(r, i)], rtol=1e-4, atol=1e-5 * float(pre.abs().max()))
                    for j in range(N):
                        u[j * L + lr_] += sent[j]
            u = u.reshape(-1)[:n]
            before = ranks[0].params[t][i].double().reshape(-1)
            after = ranks[0].params[t + 1][i].double().reshape(-1)
            clear = u.abs() > 1e-4 * float(u.abs().max())
            want = before * (1 - lr * wd) - lr * torch.sign(u)
            torch.testing.assert_close(after[clear], want[clear], rtol=1e-6, atol=1e-6)
            assert int(clear.sum()) > 0.9 * n
    assert (ranks[0].stats["grad_inter_node_wire_bytes_total"] > 0) == (N > 1)


def _node_rows(flat: torch.Tensor, W: int, L: int, local: int) -> torch.Tensor:
    """float64 (N, c): the slices of owners k L + local of a flat tensor, zero-padded (what rank (k, local) of the
    hierarchical topology compresses, before the sum over its node)."""
    n = flat.numel()
    c = -(-n // W)
    return torch.nn.functional.pad(flat.double().reshape(-1), (0, W * c - n)).view(W, c)[local::L]


def test_momentum_correction_on_the_hierarchical_topology_against_a_float64_replay():
    """4 ranks as 2 nodes of 2, density 0.1, no quantization, SGD (momentum 0.9, weight decay 0.01), 4 steps: rank
    (k, l) keeps the velocity only of its node's dense sums for the owners k'L + l (N x ceil(n / W) elements, 1/L of
    the parameter), u = 0.9 u + node sum of g / W; error feedback accumulates u between nodes; where top-k sent an
    element its residual and velocity are 0; every parameter moves by -lr (sum over nodes of what was sent + b)."""
    W, L, lr, m, wd = 4, 2, 0.05, 0.9, 0.01
    N = W // L
    ranks = run_scenario(Train(steps=4, local_grads=True, config=dict(
        SGD, gradient_clipping=0.0, dgc=dict(SPARSE, quantization="none", momentum_correction=True,
                                             topology="hierarchical", ranks_per_node=L))), world=W, timeout_s=400)
    keys = ranks[0].keys
    shapes = [p.shape for p in ranks[0].params[0]]
    wd_buf, kept_total = None, 0
    for t in range(4):
        before = [p.double().reshape(-1) for p in ranks[0].params[t]]
        wd_buf = [wd * p for p in before] if wd_buf is None else [m * b + wd * p for b, p in zip(wd_buf, before)]
        for i, key in enumerate(keys):
            n = math.prod(shapes[i])
            c = -(-n // W)
            sent_rows = torch.zeros(W, c, dtype=torch.float64)
            for r in range(W):
                k, local = divmod(r, L)
                mine = sum(_node_rows(ranks[s].local_grads[t][i], W, L, local) for s in range(k * L, k * L + L)) / W
                rec = ranks[r]
                u_prev = rec.momenta[t - 1][key].double().view(N, c) if t else torch.zeros_like(mine)
                e_prev = (rec.residuals[t - 1][key].double().view(N, c) if t and key in rec.residuals[t - 1]
                          else torch.zeros_like(mine))
                u_pre = m * u_prev + mine
                acc = u_pre + e_prev
                e = rec.residuals[t][key].double().view(N, c)
                u = rec.momenta[t][key].double().view(N, c)
                assert rec.momenta[t][key].numel() == N * c  # 1/L of the parameter (plus padding)
                if n >= 256:  # sparsified: masked where sent
                    kept = (e == 0) & (acc != 0)
                    assert 0 < int(kept.sum()) < kept.numel() // 2, (t, r, i)
                    kept_total += int(kept.sum())
                    assert torch.all(u[kept] == 0), (t, r, i)
                    torch.testing.assert_close(u[~kept], u_pre[~kept], rtol=1e-5, atol=1e-7)
                    torch.testing.assert_close(e[~kept], acc[~kept], rtol=1e-5, atol=1e-7)
                else:  # sent whole, never masked
                    torch.testing.assert_close(u, u_pre, rtol=1e-5, atol=1e-7)
                    assert torch.all(e == 0)
                sent_rows[local::L] += acc - e
            after = ranks[0].params[t + 1][i].double().reshape(-1)
            want = before[i] - lr * (sent_rows.reshape(-1)[:n] + wd_buf[i])
            torch.testing.assert_close(after, want, rtol=1e-5, atol=2e-6)
    assert kept_total > 0
    assert ranks[0].stats["grad_inter_node_wire_bytes_total"] > 0


def test_compressed_momentum_on_the_hierarchical_topology_uses_the_node_level_momenta():
    """4 ranks as 2 nodes of 2, compressed_momentum frozen after step 2 with the preconditioner, lossless otherwise,
    4 steps, against float64: rank (k, l) keeps the local momentum (and the bf16 frozen preconditioner) only of its
    node's sums for the owners k'L + l (1/L of the parameter); after the freeze every parameter moves by
    -lr (1/(sqrt(max(v_hat_2, floor)) + eps) in bf16) * (the momentum of the mean gradient), plus weight decay."""
    W, L = 4, 2
    N = W // L
    ranks = run_scenario(Train(steps=4, local_grads=True, config={"dgc": dict(
        LOSSLESS, topology="hierarchical", ranks_per_node=L,
        compressed_momentum={"freeze_step": 2, "quantization": "none", "precondition": True})}), world=W, timeout_s=400)
    opt = ranks[0].optimizer
    lr, (b1, b2), eps = opt.lr, opt.betas, opt.eps
    wd = opt.weight_decay if opt.type == "AdamW" else 0.0
    keys = ranks[0].keys
    params = [p.double() for p in ranks[0].params[0]]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    local_m = [torch.zeros_like(p).reshape(-1) for p in params]
    inv = None
    for t in range(1, 5):
        grads = [sum(ranks[r].local_grads[t - 1][i].double() for r in range(W)) / W for i in range(len(params))]
        clip = _clip_factor(opt.gradient_clipping, grads) if t <= 2 else 1.0
        for i, g in enumerate(grads):
            g = g.reshape(params[i].shape)
            local_m[i] = b1 * local_m[i] + (1 - b1) * g.reshape(-1)
            for r in range(W):  # each rank's momentum: of its node's sums, its owners' rows only
                k, local = divmod(r, L)
                node_g = sum(_node_rows(ranks[s].local_grads[t - 1][i], W, L, local) for s in range(k * L, k * L + L))
                got = ranks[r].momenta[t - 1][keys[i]].double()
                assert got.numel() == N * -(-g.numel() // W)
                if t == 1:
                    torch.testing.assert_close(got, (1 - b1) * node_g.reshape(-1) / W, rtol=1e-5, atol=1e-8)
            m[i] = b1 * m[i] + (1 - b1) * g / clip
            if t <= 2:
                v[i] = b2 * v[i] + (1 - b2) * (g / clip)**2
                update = (m[i] / (1 - b1**t)) / ((v[i] / (1 - b2**t)).sqrt() + eps)
            else:
                if inv is None:
                    inv = []
                    for vi in v:
                        v_hat = (vi / (1 - b2**2)).reshape(-1)
                        c = -(-v_hat.numel() // W)
                        padded = torch.nn.functional.pad(v_hat, (0, W * c - v_hat.numel())).view(W, c)
                        floors = V_FLOOR * padded.mean(dim=1, keepdim=True)
                        exact = (1 / (torch.maximum(padded, floors).sqrt() + eps)).reshape(-1)[:v_hat.numel()]
                        inv.append(exact.float().to(torch.bfloat16).double())  # the sent momenta carry the bf16 one
                update = (local_m[i] * inv[i]).view(params[i].shape)
            params[i] = params[i] * (1 - lr * wd) - lr * update
        for r in range(W):
            for i, (got, want) in enumerate(zip(ranks[r].params[t], params)):
                torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-6, msg=f"rank {r} step {t} param {i}")
    # local momenta (4 B) and frozen preconditioner (2 B) of 1/L of each parameter, and the owner's nothing else
    assert ranks[0].stats["state_bytes_per_param"] == pytest.approx((4.0 + 2.0) / L, rel=0.05)


def test_decoupled_momentum_with_zero_offload_equals_it_on_the_device():
    """ZeRO-Offload and ZeRO-Infinity's parameter offload with decoupled momentum (int8 storage), 2 ranks, 4 steps:
    the owners' sign step runs on the offloaded fp32 partitions where the optimizer runs, and the losses, parameters
    and momenta equal the run without offload bit for bit. The momentum goes to host memory with the optimizer state
    (``offload`` unset) unless ``offload: false`` keeps it on the device."""
    dm = {"chunk": 16, "topk": 3, "quantization": "int2", "storage": "int8"}
    opt_off = {"offload_optimizer": {"device": "cpu"}}
    cases = {"device": ({}, dm), "optimizer": (opt_off, dm),
             "optimizer+param": (dict(opt_off, offload_param={"device": "cpu"}), dm),
             "optimizer, momentum on the device": (opt_off, dict(dm, offload=False))}
    runs = run_scenarios({name: Train(steps=4, config={"zero_optimization": zero, "dgc": {
        "enabled": True, "decoupled_momentum": d}}) for name, (zero, d) in cases.items()})
    device = runs["device"]
    for name in cases:
        for r in range(2):
            rec = runs[name][r]
            assert rec.losses == device[r].losses, name
            assert all(torch.equal(a, b) for a, b in zip(rec.params[-1], device[r].params[-1])), name
            assert all(torch.equal(rec.momenta[-1][k], device[r].momenta[-1][k]) for k in device[r].momenta[-1])
            on_host = name in ("optimizer", "optimizer+param")
            assert (rec.stats["host_state_bytes"] == 2 * rec.stats["state_bytes"]) if on_host else \
                rec.stats["host_state_bytes"] == 0, name
