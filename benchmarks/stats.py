"""The launches reduced to the benchmark's results (:func:`analyse`): median step times and wire bytes, the mean of a
configuration's loss runs over seeds, steps and time to the target loss, speed-ups against stock."""

import argparse
import statistics

from benchmarks.configs import BY_NAME
from benchmarks.netlink import UNLIMITED, parse_rate_bits


def mean_over_seeds(runs: list[dict]) -> dict:
    """One configuration's loss runs at several seeds as one summary: the first run's, with the validation curve,
    ``final_val_loss`` and ``holdout_val_loss`` (None unless every run has one) replaced by their means over the runs
    and ``seeds`` listing each run's seed and losses. One run is returned as it is. SystemExit when the runs did not
    evaluate at the same steps."""
    if len(runs) == 1:
        return runs[0]
    steps = [st for st, _ in runs[0]["val_losses"]]
    if any([st for st, _ in r["val_losses"]] != steps for r in runs):
        raise SystemExit(f"bench_network.py: the loss runs at seeds {[r.get('seed') for r in runs]} did not evaluate at "
                         "the same steps")
    holdouts = [r.get("holdout_val_loss") for r in runs]
    return dict(runs[0],
                val_losses=[[st, statistics.fmean(r["val_losses"][i][1] for r in runs)] for i, st in enumerate(steps)],
                final_val_loss=statistics.fmean(r["final_val_loss"] for r in runs),
                holdout_val_loss=None if None in holdouts else statistics.fmean(holdouts),
                seeds=[{"seed": r.get("seed"), "final_val_loss": r["final_val_loss"],
                        "holdout_val_loss": r.get("holdout_val_loss")} for r in runs])


def timed(summary: dict, warmup_steps: int) -> tuple[float, float]:
    """(median step time s, median bytes on the wire per step) over the steps after the warm-up."""
    times = summary["step_times_s"][warmup_steps:]
    net = summary["step_net_tx_bytes"][warmup_steps:]
    return statistics.median(times), statistics.median(net)


def final_losses(summaries: list[dict]) -> tuple[str, list[float]]:
    """The loss each loss run ended with, compared across configurations: the whole validation split's
    (``holdout_val_loss``) where every run has one, else the last periodic evaluation's (runs of before it, or
    reused ones without it: one kind for all, never mixed). Returns (the key used, the losses in order)."""
    key = "holdout_val_loss" if all(s.get("holdout_val_loss") is not None for s in summaries) else "final_val_loss"
    return key, [s[key] for s in summaries]


def steps_to_loss(val_losses: list[list[float]], target: float) -> int | None:
    """The first evaluation step with validation loss <= ``target``; None if none reaches it."""
    return next((step for step, loss in val_losses if loss <= target), None)


def loss_at(val_losses: list[list[float]], step: int) -> float:
    """The validation loss evaluated at ``step``; SystemExit if that run did not evaluate there."""
    for at, loss in val_losses:
        if at == step:
            return loss
    raise SystemExit(f"bench_network.py: no evaluation at step {step} (evaluated at {[s for s, _ in val_losses]})")


def analyse(args: argparse.Namespace, convergence: dict, timing: dict, per_rate: dict | None = None) -> dict:
    """Reduce the launches to per-rate, per-configuration results (see the module docstring).

    ``convergence``: name -> summary of its run on the unlimited link; ``per_rate``: rate -> name -> summary of the
    ``loss_per_rate`` configurations' runs at that rate (their loss there; the unlimited run stands for the unlimited
    link); ``timing``: rate -> rounds -> name -> (step s, wire bytes per step).
    """
    per_rate = per_rate or {}
    loss_runs = [convergence[n] for n in args.configs] + [s for runs in per_rate.values() for s in runs.values()]
    loss_key, _ = final_losses(loss_runs)
    stock_loss = convergence["stock_fp32"][loss_key]
    targets = [{"step": st, "loss": loss_at(convergence["stock_fp32"]["val_losses"], st), "of": "stock_fp32"}
               for st in args.target_steps]
    results = {"rates": {}, "configs": {}, "target": targets[0], "targets": targets, "loss_key": loss_key,
               "holdout_tokens": convergence["stock_fp32"].get("holdout_tokens") if loss_key == "holdout_val_loss" else None}
    for name in args.configs:
        c = convergence[name]
        steps = c["steps"]
        grad = c.get("grad_wire_bytes_total")
        param = c.get("param_wire_bytes_total")
        measured_dgc = c.get("dgc_stats") is not None
        results["configs"][name] = {
            "label": BY_NAME[name].label,
            "val_loss": c[loss_key],
            "val_gap_pct": 100.0 * (c[loss_key] - stock_loss) / stock_loss,
            "val_loss_last_evaluation": c["final_val_loss"],  # the periodic evaluation's --eval-batches
            "seeds": c.get("seeds"),  # each seed's losses, where the run had several (mean_over_seeds)
            "val_losses": c["val_losses"],
            # rank 0's bytes sent through the extension per step (gradients, parameters); None where not counted
            "grad_bytes_per_step": grad / steps if measured_dgc else None,
            "param_bytes_per_step": param / steps if measured_dgc and param else None,
            "grad_compression_ratio": c.get("compression_ratio") if measured_dgc else None,
        }
    for rate, rounds in timing.items():
        per = {}
        rate_bits = parse_rate_bits(rate) if rate != UNLIMITED else None
        for name in args.configs:
            runs = [r[name] for r in rounds]
            step_s = statistics.median(t for t, _ in runs)
            net = statistics.median(b for _, b in runs)
            vs_fp32 = statistics.median(r["stock_fp32"][0] / r[name][0] for r in rounds)
            vs_bf16 = statistics.median(r["stock_bf16"][0] / r[name][0] for r in rounds)
            own = per_rate.get(rate, {}).get(name)  # a loss_per_rate configuration's own run at this rate
            val_losses = own["val_losses"] if own else results["configs"][name]["val_losses"]
            val_loss = own[loss_key] if own else results["configs"][name]["val_loss"]
            reached = [steps_to_loss(val_losses, t["loss"]) for t in targets]
            per[name] = {"step_s": step_s, "net_bytes_per_step": net, "speedup_vs_fp32": vs_fp32,
                         "speedup_vs_bf16": vs_bf16,
                         "val_losses": val_losses, "val_loss": val_loss,
                         "val_gap_pct": 100.0 * (val_loss - stock_loss) / stock_loss,
                         "loss_run": "this rate" if own else UNLIMITED,
                         "seeds": own.get("seeds") if own else None,
                         "targets": [{"step": t["step"], "steps_to_target": n,
                                      "time_to_target_s": None if n is None else n * step_s} for t, n in zip(targets, reached)],
                         # the share of the link's capacity the step used: wire bytes / (rate x step time)
                         "link_utilisation": None if rate_bits is None else net / (rate_bits / 8 * step_s),
                         "step_s_rounds": [r[name][0] for r in rounds]}
            if own and own.get("dgc_stats"):
                per[name]["stock_buckets_total"] = own["dgc_stats"].get("stock_buckets_total")
                per[name]["grad_bytes_per_step"] = (own.get("grad_wire_bytes_total") or 0) / own["steps"]
                param = own.get("param_wire_bytes_total")
                per[name]["param_bytes_per_step"] = param / own["steps"] if param else None
        for name in args.configs:
            # None where nothing was counted (--nodes without a limit: no shaping class to count in)
            own = per[name]["net_bytes_per_step"]
            per[name]["wire_vs_stock_fp32"] = per["stock_fp32"]["net_bytes_per_step"] / own if own else None
            for mine, stock in zip(per[name]["targets"], per["stock_fp32"]["targets"]):
                a, b = mine["time_to_target_s"], stock["time_to_target_s"]
                mine["time_to_target_vs_fp32"] = None if a is None or b is None else a / b
            first = per[name]["targets"][0]  # the tables' target
            per[name].update({k: first[k] for k in ("steps_to_target", "time_to_target_s", "time_to_target_vs_fp32")})
        results["rates"][rate] = per
    return results
