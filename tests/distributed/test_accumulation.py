"""Local gradient accumulation (``dgc.accumulate_locally``, deepspeed_dgc/zero3/accumulation.py): the micro-steps of
an accumulation window add up on each rank and their sum is compressed and sent once, at ZeRO-3's boundary. Oracles:
DeepSpeed's own coalesced reduction (``engine.coalesce_grad_reduction()``, the same sum) under the same codec, and
stock ZeRO-3."""

import pytest
import torch

from dist_launch import run_scenarios
from scenarios import Train

LOSSLESS = {"enabled": True, "density": 1.0, "quantization": "none", "min_numel": 0}
SPARSE = {"enabled": True, "density": 0.1, "quantization": "int4", "min_numel": 256}
DEMO = {"enabled": True, "decoupled_momentum": {"chunk": 16, "topk": 3, "quantization": "int2", "storage": "int8"}}
SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}, "zero_allow_untested_optimizer": True}
# Top-k (in the fixed layout, the device path, and the exact one under the momentum methods) and decoupled momentum's
# int8 storage in one bucket: top-k plans its selection per bucket (the exact layout samples its threshold from each
# bucket), the int8 storage seeds its stochastic rounding per bucket, and with several buckets the two loops' differ
# (backward's order against the coalesced flush's). The default's dense INT4 codes each tensor on its own: several
# buckets here.
ONE_BUCKET = {"zero_optimization": {"reduce_bucket_size": 100000}}
SECTIONS = {  # name -> ("dgc" section, the rest of the config, whether sending every micro-step is allowed)
    "default": ({"enabled": True}, {}, True),
    "topk_int4": (dict(SPARSE, layout="fixed"), ONE_BUCKET, True),
    "decoupled_momentum": (DEMO, ONE_BUCKET, True),
    # one send per optimizer step is what these two need: with the window held they take gradient accumulation
    "compressed_momentum": (dict(SPARSE, compressed_momentum={"freeze_step": 2, "quantization": "int2"}), ONE_BUCKET,
                            False),
    "momentum_correction": (dict(SPARSE, momentum_correction=True, local_clip_norm=1.0), dict(ONE_BUCKET, **SGD), False),
}


def _equal(a, b) -> bool:
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs():
    """Every section's runs, in one launch (its start-up is most of a short run's time): ``"<section>/<run>"``."""
    jobs = {}
    for name, (dgc, extra, every_allowed) in SECTIONS.items():
        jobs[f"{name}/held"] = Train(config=dict(extra, dgc=dgc), gas=4, steps=3)
        jobs[f"{name}/held_caller_boundary"] = Train(config=dict(extra, dgc=dgc), gas=4, steps=3, coalesce=False)
        jobs[f"{name}/coalesced"] = Train(config=dict(extra, dgc=dgc), gas=4, steps=3, coalesce=True)
        if every_allowed:
            jobs[f"{name}/every"] = Train(config=dict(extra, dgc=dict(dgc, accumulate_locally=False)), gas=4, steps=3)
    return run_scenarios(jobs, timeout_s=600)


@pytest.mark.parametrize("name", list(SECTIONS))
def test_window_sent_once_gives_deepspeeds_coalesced_bits(name, runs):
    """4 micro-steps per step, 3 steps, the engine's own loop and the loop of DeepSpeed's coalescing tests (the
    caller sets the boundary and steps once): the held window gives the parameters of DeepSpeed's coalesced
    reduction under the same codec bit for bit, every step and rank, with the same bytes on the wire (but for the
    buckets' headers); the telemetry counts 4 of stock's reduce-scatters per step against them. Sending every
    micro-step instead (``accumulate_locally: false``) pays the codec 4 times: other parameters and more bytes;
    compressed momentum and momentum correction refuse it, and run with the window held."""
    every_allowed = SECTIONS[name][2]
    runs = {run.split("/", 1)[1]: records for run, records in runs.items() if run.startswith(f"{name}/")}
    for r in range(2):
        held, coalesced = runs["held"][r], runs["coalesced"][r]
        for run in ("held", "held_caller_boundary"):
            for step, (a, b) in enumerate(zip(runs[run][r].params, coalesced.params)):
                assert _equal(a, b), f"{name} {run} rank {r} step {step}: parameters differ from the coalesced ones"
        assert not torch.equal(held.params[0][0], held.params[-1][0])  # it trained
        # the same values; the buckets differ (backward's order against the coalesced flush's), and with them the
        # headers and the scale groups' padding
        assert held.stats["wire_bytes_total"] == pytest.approx(coalesced.stats["wire_bytes_total"], rel=0.05)
        assert held.stats["dense_fp32_bytes_total"] == 4 * coalesced.stats["dense_fp32_bytes_total"]
        assert held.stats["compression_ratio"] == pytest.approx(4 * coalesced.stats["compression_ratio"], rel=0.05)
        # the window's held sum: the model's full size in the accumulation dtype (fp32 here)
        assert held.stats["held_gradient_peak_bytes"] == 4 * held.n_params
        if every_allowed:
            every = runs["every"][r]
            assert not _equal(every.params[-1], held.params[-1])
            assert every.stats["wire_bytes_total"] > 3 * held.stats["wire_bytes_total"]
            assert every.stats["held_gradient_peak_bytes"] == 0


def test_parameter_unused_at_the_windows_end_is_sent_at_its_end():
    """A side layer used in the first of 2 micro-steps and not in the last (nothing of it reaches the last
    micro-step's buckets): lossless, its held gradient is sent at the end of the window's last backward, so the
    parameters are stock's coalesced reduction's bit for bit, and stock's own (every micro-step reduced) to fp32
    summation order; the side layer trained."""
    dgc = {"dgc": LOSSLESS}
    runs = run_scenarios({"stock_coalesced": Train(model="skiplast", gas=2, steps=3, coalesce=True),
                          "held": Train(model="skiplast", config=dgc, gas=2, steps=3),
                          "stock": Train(model="skiplast", gas=2, steps=3)})
    side = [i for i, k in enumerate(runs["held"][0].keys) if k.startswith("side.")]
    assert len(side) == 2
    for r in range(2):
        stock_coalesced, held = runs["stock_coalesced"][r], runs["held"][r]
        for step, (a, b) in enumerate(zip(held.params, stock_coalesced.params)):
            assert _equal(a, b), f"rank {r} step {step}: parameters differ from stock's coalesced reduction's"
        for i in side:
            assert not torch.equal(held.params[0][i], held.params[-1][i])
        for a, b in zip(held.params[-1], runs["stock"][r].params[-1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert held.stats["held_gradient_peak_bytes"] > 0


def test_reentrant_checkpointing_window_sent_whole():
    """Reentrant activation checkpointing in two segments (each recomputed in a backward of its own), 2 micro-steps:
    ZeRO-3 runs its epilogue once per backward (DeepSpeed queues it as autograd's callback), so the window is folded
    and sent whole at the last micro-step's buckets. Lossless, the parameters are stock's coalesced reduction's bit
    for bit and stock's own (every micro-step reduced) to fp32 summation order, every step and rank."""
    dgc = {"dgc": LOSSLESS}
    runs = run_scenarios({"stock_coalesced": Train(model="reentrant", gas=2, steps=3, coalesce=True),
                          "held": Train(model="reentrant", config=dgc, gas=2, steps=3),
                          "stock": Train(model="reentrant", gas=2, steps=3)})
    for r in range(2):
        held = runs["held"][r]
        assert not torch.equal(held.params[0][0], held.params[-1][0])  # it trained
        for step, (a, b) in enumerate(zip(held.params, runs["stock_coalesced"][r].params)):
            assert _equal(a, b), f"rank {r} step {step}: parameters differ from stock's coalesced reduction's"
        for a, b in zip(held.params[-1], runs["stock"][r].params[-1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert held.stats["held_gradient_peak_bytes"] == 4 * held.n_params
