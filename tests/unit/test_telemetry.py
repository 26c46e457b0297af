"""deepspeed_dgc.telemetry: per-step counters, run totals and the monitor events, with random byte counts."""

import random

from deepspeed_dgc.telemetry import DGCStats, ReduceResult, log_step


class _Monitor:
    enabled = True

    def __init__(self):
        self.events = []

    def write_events(self, events):
        self.events += events


def test_buckets_sent_by_stock_are_counted_per_step_in_the_totals_and_in_the_monitor():
    rng = random.Random()
    stats = DGCStats(world_size=2)
    calls = [(rng.randrange(1, 10**6), rng.randrange(1, 10**6), rng.random() < 0.5) for _ in range(7)]
    for wire, numel, stock in calls:
        stats.record(ReduceResult(wire_bytes=wire, dense_fp32_bytes=numel * 2.0, kept=numel, numel=numel, finite=True,
                                  stock_buckets=int(stock)))
    step = stats.end_step(skipped=False, residual_norm=None)
    assert step.stock_buckets == sum(s for _, _, s in calls)
    assert step.wire_bytes == sum(w for w, _, _ in calls)
    stats.policy = {"1x10 torch.float32": {"choice": "stock"}}
    out = stats.to_dict()
    assert out["stock_buckets_total"] == step.stock_buckets and out["policy"] == stats.policy
    assert stats.totals()["stock_buckets_total"] == step.stock_buckets  # kept in a checkpoint's totals
    monitor = _Monitor()
    log_step(step, 0, monitor, global_samples=5)
    assert ("Train/dgc/stock_buckets", step.stock_buckets, 5) in monitor.events
