"""Hugging Face Trainer and Accelerate + DeepSpeed ZeRO-3 + deepspeed_dgc: examples/hf_trainer_gpt2.py and
examples/accelerate_gpt2.py on 2 ranks, started as the test launches of tests/dist_launch.py start their workers (the
Trainer and Accelerate read the ranks from the environment, as under the deepspeed launcher).

transformers and accelerate are in requirements-test.txt, so CI runs this; it skips only where they are absent.
"""

import itertools
import json
import math
import os

import pytest

from dist_launch import ROOT, check_ok, launch

pytest.importorskip("transformers")

# the recommended method's Trainer job: the Trainer's own schedule (linear warm-up, cosine decay to 0), 2 micro-steps
# per optimizer step, clipping at 1.0, a bf16 engine; HF_STEPS optimizer steps of a 0.41M-parameter GPT-2
HF_STEPS = 200
HF_WARMUP = 60
# the bound (item 3): the method's final loss within 1% of stock's, the mean gap over HF_SEEDS. Measured on
# this job (docs/huggingface.md): the sign step at the job's own rate trailed by +1.00% over 20 seeds; at the config's
# "lr_scale" 1.25 (chosen on seeds 10 to 19: -0.23%), these three end +0.14%, +1.49% and -0.69% (+0.31%); one seed's
# gap spreads over about 3 points, so the mean of three, not one
HF_GAP = 0.01
HF_SEEDS = (1234, 1, 2)
# the job's settings but its length: peak lr 3e-3, cosine decay, 2 micro-steps per step, clipping at 1.0, bf16
JOB_SETTINGS = ["--lr", "3e-3", "--lr-scheduler", "cosine", "--grad-accum", "2", "--max-grad-norm", "1.0", "--bf16"]
HF_JOB = ["--max-steps", str(HF_STEPS), "--warmup-steps", str(HF_WARMUP), *JOB_SETTINGS]


def run_example(script: str, argv: list[str], name: str) -> dict:
    """Run ``examples/<script>`` on 2 ranks; returns the ``DGC_TELEMETRY`` line rank 0 printed."""
    argv = [*argv, "--output-dir", os.path.join(ROOT, "runs", f"test_{name}")]
    ranks = launch(2, os.path.join(ROOT, "examples", script), argv, timeout_s=600)
    check_ok(ranks)
    line = [ln for ln in ranks[0].stdout.splitlines() if ln.startswith("DGC_TELEMETRY ")]
    assert len(line) == 1, ranks[0].stdout[-3000:]
    return json.loads(line[0].split(" ", 1)[1])


def check_job(t: dict, steps: int, warmup: int) -> None:
    """The run took ``steps`` optimizer steps of 2 micro-steps each on a bf16 engine clipping at 1.0, with a linear
    warm-up over ``warmup`` steps to 3e-3 and a cosine decay to 0, and its losses are finite."""
    assert len(t["losses"]) == steps and all(math.isfinite(x) for x in t["losses"]), t["losses"]
    assert t["bf16"] is True and t["grad_accum"] == 2 and t["gradient_clipping"] == 1.0, t
    lrs = t["lrs"]
    assert lrs[warmup - 1] == pytest.approx(3e-3) and lrs[0] == pytest.approx(3e-3 / warmup), lrs[:warmup]
    assert all(a < b for a, b in itertools.pairwise(lrs[:warmup])), lrs[:warmup]
    assert all(a >= b for a, b in itertools.pairwise(lrs[warmup - 1:])) and lrs[-1] < 1e-6, lrs[warmup - 1:]


def check_compressed(t: dict, steps: int, micro_steps: int) -> None:
    """Every optimizer step went through the recommended method's HF config (decoupled momentum, DCT top-2 of 64 in
    FP8 e4m3: about 71x fewer bytes than stock fp32's reduce-scatter), its micro-steps held and their sum sent once:
    the telemetry counts stock's bytes for every micro-step (stock reduce-scatters each), so the ratio is about 71x
    per micro-step of a step."""
    world = t["world_size"]
    assert t.get("dgc_steps") == steps and t.get("kernels") == "fused-cpu", t  # "dgc": null when nothing compressed
    assert t["dense_fp32_bytes_total"] == round(micro_steps * (world - 1) / world * 4 * t["n_params"]), t
    per_step = micro_steps / steps
    assert 65 * per_step < t["compression_ratio"] < 75 * per_step, t


def check_short_run(t: dict, steps: int, warmup: int) -> None:
    """A short run of the recommended method: :func:`check_job`, :func:`check_compressed` for its 2 micro-steps a
    step, and the mean loss of its last 5 steps more than 0.5 below its first 5's."""
    check_job(t, steps, warmup)
    check_compressed(t, steps, 2 * steps)
    losses = t["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses


def test_hf_trainer_runs_with_dgc_compressing():
    argv = ["--deepspeed", "configs/hf_zero3_dgc.json", "--max-steps", "10", "--lr-scheduler", "linear"]
    t = run_example("hf_trainer_gpt2.py", argv, "hf_trainer")
    assert t["steps"] == 10 and t["dgc_steps"] == 10 and t["kernels"] == "fused-cpu"
    # every parameter of every step went through our reduce-scatter: stock fp32's bytes for the model's size
    world = t["world_size"]
    assert t["dense_fp32_bytes_total"] == round(10 * (world - 1) / world * 4 * t["n_params"])
    # dense INT4 (the config's density 1.0): 4 bits per value plus an fp32 scale per 128 values, 4.25 bits per
    # parameter, so at most 32 / 4.25 = 7.53x; payload headers take a little of it (a sparse or raw payload is far off)
    assert 7.0 < t["compression_ratio"] <= 7.53, t
    assert 0 < t["train_loss"] < 4.5  # finite, and below ln(65) = 4.17 plus slack at the start


def test_hf_trainer_recommended_method_compresses_and_trains():
    """The recommended method (configs/hf_zero3_dgc_adam.json) under the Trainer, 30 steps: the Trainer's schedule
    reaches the method at every step, its 2 micro-steps are held and sent once at about 71x (143x against stock's
    two), clipping and bf16 are on, and the loss is finite and falls (the comparison with stock is the next test's,
    a long one)."""
    steps, warmup = 30, 10
    t = run_example("hf_trainer_gpt2.py", ["--max-steps", str(steps), "--warmup-steps", str(warmup), *JOB_SETTINGS],
                    "hf_trainer_method_short")
    check_short_run(t, steps, warmup)


@pytest.mark.slow
def test_hf_trainer_recommended_method_within_1pct_of_stock():
    """The recommended method (configs/hf_zero3_dgc_adam.json) with the Trainer's schedule, gradient accumulation,
    clipping and bf16 ends within 1% of the same job on stock ZeRO-3 (the same config without its "dgc" section,
    the same seed): the mean training loss of the last 10 optimizer steps, the gap averaged over 3 seeds. Six runs
    of 200 steps (about 18 minutes on 2 cores): `make hf-gap`, not `make test` (the previous test runs the method
    under the Trainer in CI)."""
    gaps, said = [], []
    for seed in HF_SEEDS:
        job = [*HF_JOB, "--seed", str(seed)]
        stock = run_example("hf_trainer_gpt2.py", ["--stock", *job], f"hf_trainer_stock_{seed}")
        method = run_example("hf_trainer_gpt2.py", job, f"hf_trainer_method_{seed}")
        assert stock["dgc"] is None and stock["steps"] == method["steps"] == HF_STEPS
        for t in (stock, method):
            check_job(t, HF_STEPS, HF_WARMUP)
        assert method["lrs"] == stock["lrs"]  # the Trainer's schedule drives the method's sign step as it drives Adam
        check_compressed(method, HF_STEPS, 2 * HF_STEPS)
        gaps.append(method["final_loss"] / stock["final_loss"] - 1)
        said.append(f"seed {seed}: {method['final_loss']:.4f} vs stock {stock['final_loss']:.4f} ({gaps[-1]:+.2%})")
    gap = sum(gaps) / len(gaps)
    said = f"final loss, {'; '.join(said)}; mean gap {gap:+.2%}"
    assert gap < HF_GAP, f"not within {HF_GAP:.0%} of stock at {HF_STEPS} steps (issue 51, item 3): {said}"


def test_accelerate_recommended_method_compresses_and_trains():
    """examples/accelerate_gpt2.py (Accelerate's DeepSpeedPlugin, a plain loop with accelerator.accumulate and
    accelerator.backward, the loop's own AdamW and schedule) with the recommended method, 2 micro-steps per step,
    clipping and bf16: every step is compressed, the schedule is the loop's, the loss is finite and falls."""
    pytest.importorskip("accelerate")
    steps, warmup = 30, 10
    t = run_example("accelerate_gpt2.py", ["--max-steps", str(steps), "--warmup-steps", str(warmup), *JOB_SETTINGS],
                    "accelerate")
    check_short_run(t, steps, warmup)
    assert t["global_steps"] == steps and t["num_processes"] == t["world_size"] == 2, t
    assert all(math.isfinite(x) and x > 0 for x in t["grad_norms"]), t["grad_norms"]
