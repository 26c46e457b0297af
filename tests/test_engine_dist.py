"""ZeRO-3 through deepspeed.initialize in 2 real processes: the seam against stock DeepSpeed."""

import csv
import math
import os
import tempfile

import pytest
import torch

from dist_launch import check_ok, launch


def run(mode, world=2, timeout_s=240, out=None, steps=None):
    out = out or tempfile.mkdtemp()
    check_ok(launch(world, "engine_worker.py", [mode, out] + ([str(steps)] if steps else []), timeout_s=timeout_s))
    return [torch.load(f"{out}/rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("comm", ["", "_bf16comm"], ids=["fp32comm", "bf16comm"])
def test_lossless_bit_identical_to_stock(comm):
    """density 1 + no quantization, gradient accumulation 2, 4 steps: same losses, full
    gradients and fp32 parameters as stock ZeRO-3, bit for bit (fp32 or bf16 communication)."""
    stock = run("stock" + comm)
    ours = run("lossless" + comm)
    for r in range(2):
        assert ours[r]["losses"] == stock[r]["losses"]
        for step, (a, b) in enumerate(zip(ours[r]["grads"], stock[r]["grads"])):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"rank {r} step {step}: gradients differ"
        for step, (a, b) in enumerate(zip(ours[r]["params"], stock[r]["params"])):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"rank {r} step {step}: parameters differ"
        # parameters moved, so the comparison is not between two untouched models
        assert not torch.equal(stock[r]["params"][0][0], stock[r]["params"][-1][0])
        stats = ours[r]["stats"]
        assert stats["steps"] == 4 and stats["wire_bytes_total"] > 0


@pytest.mark.parametrize("mode", ["overflow_fp16", "overflow_bf16", "overflow_bf16_momentum"])
def test_inf_on_one_rank_skips_step_everywhere(mode):
    """Inf in rank 1's input at step 2: every rank skips that step, parameters and residuals
    stay as they were, residuals stay finite, and training goes on (``overflow_bf16``: with the residuals offloaded
    to host memory). With compressed_momentum under bf16 (frozen
    after step 1, so step 2 sends momentum): the local momenta also roll back and stay finite (fp16 engines are
    refused with compressed_momentum, see the bad-config test)."""
    out = tempfile.mkdtemp()
    ranks = run(mode, out=out)
    for r, rec in enumerate(ranks):
        assert rec["skipped"] == [0, 0, 1, 1], f"rank {r}"
        for x, y in zip(rec["params"][2], rec["params"][3]):  # params before / after step 2
            assert torch.equal(x, y)
        assert not all(torch.equal(x, y) for x, y in zip(rec["params"][3], rec["params"][4]))  # step 3 applied
        assert rec["residuals"][1], "sparse compression left no residuals"
        for res in rec["residuals"]:
            assert all(bool(torch.isfinite(v).all()) for v in res.values())
        for k in rec["residuals"][1]:
            assert torch.equal(rec["residuals"][1][k], rec["residuals"][2][k])
        assert not all(torch.equal(rec["residuals"][2][k], rec["residuals"][3][k]) for k in rec["residuals"][2])
        assert rec["stats"]["skipped_steps"] == 1
        assert all(math.isfinite(l) for i, l in enumerate(rec["losses"]) if not (r == 1 and i == 2))
        if mode.endswith("_momentum"):
            assert len(rec["momenta"]) == 4 and rec["momenta"][1]
            for mom in rec["momenta"]:
                assert all(bool(torch.isfinite(v).all()) for v in mom.values())
            assert all(torch.equal(rec["momenta"][1][k], rec["momenta"][2][k]) for k in rec["momenta"][1])
            assert not all(torch.equal(rec["momenta"][2][k], rec["momenta"][3][k]) for k in rec["momenta"][2])
            assert rec["stats"]["state_bytes_per_param"] > 6  # residual + momentum + preconditioner
    if mode.startswith("overflow_fp16"):
        assert [rec["loss_scale"] for rec in ranks][0] == [256.0, 256.0, 128.0, 128.0]
    elif mode == "overflow_bf16":  # telemetry reaches DeepSpeed's monitor (CSV here), one row per step (stats_interval 1)
        assert all(rec["stats"]["host_state_bytes"] == rec["stats"]["state_bytes"] > 0 for rec in ranks)  # offloaded
        with open(os.path.join(out, "monitor", "Train_dgc_compression_ratio.csv")) as f:
            rows = list(csv.reader(f))[1:]
        assert len(rows) == 4 and all(float(v) > 1 for _, v in rows)
        assert os.path.exists(os.path.join(out, "monitor", "Train_dgc_residual_norm.csv"))


def test_bad_config_fails_on_every_rank_naming_the_key():
    ranks = run("bad_config")
    expected = {
        "misspelled": "dgc.densty",
        "density_range": "dgc.density",
        "quantization_value": "dgc.quantization",
        "stage2": "zero_optimization.stage",
        "no_reduce_scatter": "zero_optimization.reduce_scatter",
        "qgz": "zero_optimization.zero_quantized_gradients",
        "stage0": "zero_optimization.stage",
        "qwz": "zero_optimization.zero_quantized_weights",
        "nontrainable": "zero_optimization.zero_quantized_nontrainable_weights",
        "weights_format": "dgc.weights.quantization",
        "no_optimizer": "optimizer",
        "backend_value": "dgc.comm_backend",
        "topology_value": "dgc.topology",
        "timeout_zero": "dgc.timeout_s",
        "hpz_node_mismatch": "zero_optimization.zero_hpz_partition_size",
        "nodes_do_not_divide": "dgc.ranks_per_node",
        "kernels_value": "dgc.kernels",
        "momentum_sgd": "dgc.compressed_momentum",
        "momentum_gas": "gradient_accumulation_steps",
        "momentum_hierarchical": "dgc.compressed_momentum",
        "sr_with_fp8": "dgc.stochastic_rounding",
        "density_auto_typo": "dgc.density",
        "residual_dtype_value": "dgc.residual_dtype",
        "momentum_fp16": "'fp16'",
        "mc_with_adam": "needs the SGD optimizer",
        "mc_sgd_no_momentum": "'optimizer.params.momentum' > 0",
        "mc_nesterov": "'optimizer.params.nesterov'",
        "mc_maximize": "'optimizer.params.maximize'",
        "momentum_autocast": "'torch_autocast'",
        "mc_and_compressed_momentum": "exclude each other",
        "local_clip_without_mc": "dgc.local_clip_norm",
    }
    for r, messages in enumerate(ranks):
        for case, key in expected.items():
            msg = messages[case]
            assert msg is not None, f"rank {r}: {case} was accepted"
            assert msg.startswith("DGCConfigError") and key in msg, f"rank {r} {case}: {msg}"
            if case.startswith("mc_") and "exclude" not in msg:
                assert "dgc.momentum_correction" in msg, msg
    for r, messages in enumerate(ranks):  # mpi4py works here, but the processes were not started by mpirun
        msg = messages["mpi_without_mpirun"]
        assert msg is not None and msg.startswith("DGCBackendError") and "dgc.comm_backend" in msg, msg
        assert "MPI world of 1, torch world is 2" in msg and "mpirun" in msg, msg
        msg = messages["mpi4py_missing"]
        assert msg is not None and msg.startswith("DGCBackendError") and "mpi4py cannot be imported" in msg, msg
    for r, messages in enumerate(ranks):  # the fused op cannot load on rank 1 only: both ranks fail, naming it
        msg = messages["fused_missing_on_rank1"]
        assert msg is not None and msg.startswith("DGCKernelError"), msg
        assert ("no C++ compiler" in msg) if r == 1 else ("could not load on rank(s) [1]" in msg), msg
    assert "allowed keys: enabled, density" in ranks[0]["misspelled"]
    assert "'fp8_e5m2' or 'none'" in ranks[0]["quantization_value"]


@pytest.mark.parametrize("mode, key, values", [("mismatch", "'dgc.density'", ("0.1", "0.2")),
                                               ("mismatch_version", "'deepspeed_dgc version'", ("'0.1.0'", "'0.0.0-other'")),
                                               ("mismatch_disabled", "'dgc.enabled'", ("True", "False"))])
def test_ranks_that_disagree_fail_on_every_rank(mode, key, values):
    """Rank 1 runs another density, another package version, or DGC disabled: both ranks raise at
    initialize, naming the key and both values, instead of mixing formats or hanging."""
    ranks = run(mode)
    for r, msg in enumerate(ranks):
        assert msg is not None and msg.startswith("DGCConfigError") and "differ between ranks" in msg, f"rank {r}: {msg}"
        assert f"{key} is {values[0]} on rank 0 but {values[1]} on rank(s) [1]" in msg, msg


@pytest.mark.parametrize("world, mode", [(3, "lossless"), (4, "lossless_hier2")], ids=["w3-flat", "w4-hierarchical-2x2"])
def test_lossless_matches_stock_within_rounding(world, mode):
    """At 3 ranks, or 4 ranks as 2 nodes of 2 (a sum inside each node, then across nodes), the
    summation order differs from gloo's, so equality is within float32 rounding."""
    stock, ours = run("stock", world=world), run(mode, world=world)
    for r in range(world):
        for a, b in zip(ours[r]["losses"], stock[r]["losses"]):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
        for step, (a, b) in enumerate(zip(ours[r]["grads"], stock[r]["grads"])):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
        for x, y in zip(ours[r]["params"][-1], stock[r]["params"][-1]):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        assert not torch.equal(stock[r]["params"][0][0], stock[r]["params"][-1][0])
        if mode.endswith("_hier2"):  # the two hops really ran
            assert ours[r]["stats"]["grad_intra_node_wire_bytes_total"] > 0
            assert ours[r]["stats"]["grad_inter_node_wire_bytes_total"] > 0


def test_compressed_momentum_is_adam_before_the_freeze_and_uses_the_frozen_v_after():
    """compressed_momentum, lossless otherwise, frozen after step 3, momentum sent raw: steps 1-3 equal stock
    ZeRO-3 Adam bit for bit; every step equals a float64 reference of Adam with ZeRO-3's gradient clipping
    (steps 1-3) and of the
    frozen-variance update p <- p (1 - lr wd) - lr m / (sqrt(max(v_hat_3, floor)) + eps) (steps 4-6), with m the
    sum of the ranks' momenta of their own (unclipped) gradients and floor 1% of the mean v_hat over each owner's
    partition."""
    from deepspeed_dgc.momentum import V_FLOOR
    stock, ours = run("stock_adam", timeout_s=300, steps=6), run("momentum_exact", timeout_s=300, steps=6)
    for r in range(2):
        for t in range(4):
            assert all(torch.equal(a, b) for a, b in zip(stock[r]["params"][t], ours[r]["params"][t])), (r, t)
    opt = ours[0]["optimizer"]
    assert opt["type"] in ("Adam", "AdamW")
    lr, (b1, b2), eps = opt["lr"], opt["betas"], opt["eps"]
    wd = opt["weight_decay"] if opt["type"] == "AdamW" else 0.0
    params = [p.double() for p in ours[0]["params"][0]]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    local_m = [torch.zeros_like(p) for p in params]
    inv = None
    for t in range(1, 7):
        grads = [(a.double() + b.double()) / 2 for a, b in zip(ours[0]["local_grads"][t - 1], ours[1]["local_grads"][t - 1])]
        clip = 1.0
        if t <= 3 and opt["gradient_clipping"] > 0:  # ZeRO-3 clips by the global norm; after the freeze it does not
            norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
            clip = max(1.0, (norm + 1e-6) / opt["gradient_clipping"])
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
            for i, (got, want) in enumerate(zip(ours[r]["params"][t], params)):
                torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-6, msg=f"rank {r} step {t} param {i}")
    # the freeze changed the trajectory (the comparison after it is not stock Adam again)
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(stock[0]["params"][6], ours[0]["params"][6]))
    # lossless: no residual; fp32 local momentum (4 B) and this owner's fp32 1/(sqrt(v_hat)+eps) on half the params
    assert ours[0]["stats"]["state_bytes_per_param"] == pytest.approx(4.0 + 4.0 / 2, rel=0.02)


def test_momentum_correction_dense_equals_stock_momentum_sgd():
    """DGC's momentum correction with every element sent and nothing quantized is momentum SGD: the ranks apply the
    momentum to their own gradients, the owners apply it only to the weight-decay term (SGD, momentum 0.9, weight
    decay 0.01, 6 steps, 2 ranks, compared with stock ZeRO-3 at every step)."""
    stock, ours = run("stock_sgd", timeout_s=300, steps=6), run("mc_dense", timeout_s=300, steps=6)
    assert ours[0]["optimizer"]["type"] == "SGD" and ours[0]["optimizer"]["momentum"] == 0.9
    for r in range(2):
        for t in range(7):
            for a, b in zip(ours[r]["params"][t], stock[r]["params"][t]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert ours[r]["skipped"][-1] == 0 and len(ours[r]["momenta"]) == 6
    # momentum really acts: the last step is not lr * (mean gradient + wd p)
    lr, last = 0.05, 5
    mean_g = [(a + b) / 2 for a, b in zip(stock[0]["local_grads"][last], stock[1]["local_grads"][last])]
    plain = [p - lr * (g.view(p.shape) + 0.01 * p) for p, g in zip(stock[0]["params"][last], mean_g)]
    assert max(float((x - y).abs().max()) for x, y in zip(plain, stock[0]["params"][last + 1])) > 1e-4


def test_momentum_correction_masks_the_sent_velocity_and_the_owner_applies_only_what_was_sent():
    """density 0.1, no quantization, local_clip_norm 0.05, weight decay 0.01, 2 ranks, 6 steps, checked in float64
    from what each rank recorded: the velocity is u = 0.9 u + clip(g) / 2 (each tensor's local gradient clipped to
    norm 0.05); error feedback accumulates u; where top-k sent an element its residual and its velocity are 0
    (momentum factor masking), elsewhere both carry on; and every parameter moves by exactly -lr (sum over ranks
    of what they sent + b), b = 0.9 b + wd p (the owner adds momentum to the weight-decay term only)."""
    ranks = run("mc_sparse", timeout_s=300, steps=6)
    lr, m, clip, wd = 0.05, 0.9, 0.05, 0.01
    wd_buf = None
    ids = ranks[0]["ds_ids"]
    shapes = [p.shape for p in ranks[0]["params"][0]]
    clipped = kept_total = 0
    for t in range(6):
        sent_sum = [torch.zeros(s, dtype=torch.float64).reshape(-1) for s in shapes]
        for r in range(2):
            rec = ranks[r]
            for i, key in enumerate(ids):
                g = rec["local_grads"][t][i].double().reshape(-1)
                norm = float(g.norm())
                if norm > clip:
                    g, clipped = g * (clip / norm), clipped + 1
                u_prev = rec["momenta"][t - 1][key].double() if t else torch.zeros_like(g)
                e_prev = rec["residuals"][t - 1][key].double() if t and key in rec["residuals"][t - 1] else torch.zeros_like(g)
                u_pre = m * u_prev + g / 2
                acc = u_pre + e_prev
                e = rec["residuals"][t][key].double()
                u = rec["momenta"][t][key].double()
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
        before = [p.double().reshape(-1) for p in ranks[0]["params"][t]]
        wd_buf = [wd * p for p in before] if wd_buf is None else [m * b + wd * p for b, p in zip(wd_buf, before)]
        for i in range(len(ids)):
            after = ranks[0]["params"][t + 1][i].double().reshape(-1)
            torch.testing.assert_close(after, before[i] - lr * (sent_sum[i] + wd_buf[i]), rtol=1e-5, atol=2e-6)
    assert clipped > 0 and kept_total > 0
