"""The network benchmark's outputs: the Markdown tables, the plot, the machine's description, and writing them all
(:func:`write_outputs`)."""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.configs import BY_NAME
from benchmarks.netlink import UNLIMITED
from benchmarks.stats import analyse


def seconds(t: float) -> str:
    """Seconds as the tables show them: whole from 100 s, one decimal below."""
    return f"{t:.0f}" if t >= 100 else f"{t:.1f}"


def seed_table(args: argparse.Namespace, results: dict) -> list[str]:
    """Markdown lines of each loss run's loss at every seed, their mean and its gap to stock fp32's mean (none with
    one seed)."""
    if args.seeds < 2:
        return []
    key = results.get("loss_key", "final_val_loss")
    stock = results["configs"]["stock_fp32"]["val_loss"]
    rows = [(name, c["seeds"]) for name, c in results["configs"].items()]
    rows += [(f"{name} ({rate}, its own run)", r["seeds"]) for rate, per in results["rates"].items()
             for name, r in per.items() if r.get("seeds")]
    lines = [f"Loss of each run ({'the whole validation split' if key == 'holdout_val_loss' else 'last evaluation'}) "
             "at every seed, the mean the tables use, and the runs' spread:", "",
             "| configuration | " + " | ".join(f"seed {args.seed + i}" for i in range(args.seeds))
             + " | mean | gap of the mean | max - min |", "|---|" + "---:|" * (args.seeds + 3)]
    for name, seeds in rows:
        by_seed = {s["seed"]: s[key] for s in seeds or []}  # None: one run (the others' seeds not in a reanalysed DIR)
        if not by_seed:
            own = results["configs"].get(name)
            by_seed = {args.seed: own["val_loss"]} if own else {}
        losses = list(by_seed.values())
        mean = statistics.fmean(losses)
        lines.append(f"| {name} | " + " | ".join(f"{by_seed[args.seed + i]:.4f}" if args.seed + i in by_seed else "—"
                                                 for i in range(args.seeds))
                     + f" | {mean:.4f} | {100 * (mean - stock) / stock:+.2f}% | "
                     + (f"{max(losses) - min(losses):.4f} |" if len(losses) > 1 else "— (one run) |"))
    return lines + [""]


def markdown(args: argparse.Namespace, results: dict, meta: dict) -> str:
    """The result tables (one per rate) and the gradient-only bound, as Markdown: command, machine and date once at
    the top."""
    where = (f"{2 * args.ranks_per_node} ranks as 2 nodes of {args.ranks_per_node} (benchmarks/two_nodes.py: only the "
             "path between the nodes is rate-limited, each direction at the rate; wire bytes are those that crossed "
             "it)" if args.nodes else "2 ranks")
    lines = ([f"Command: `{meta['command']}`", ""] if meta.get("command") else []) + (
        [f"Tables made again from its launches: `{meta['reanalysed']}`", ""] if meta.get("reanalysed") else []) + [f"{meta['date']}, {meta['machine']}; {meta['n_params']:,} parameters, {where}, "
             f"{args.micro_batch} x {args.block_size} tokens per rank per step, validation loss at step "
             f"{args.converge_steps} " + (f"over the whole validation split ({results['holdout_tokens']:,} tokens)"
                                           if results.get("loss_key") == "holdout_val_loss" else
                                           f"over {args.eval_batches} validation batches")
             + (f", the mean of each configuration's runs at seeds {args.seed}-{args.seed + args.seeds - 1} "
                "(validation curves too; every run's loss in the table after the time to target)" if args.seeds > 1
                else "")
             + f" (stock fp32: {results['configs']['stock_fp32']['val_loss']:.4f}); "
             f"step times: median of {args.timed_steps} steps after {args.warmup_steps}, median of "
             f"{args.repeats} interleaved rounds. Target: stock fp32's validation loss at step "
             f"{results['target']['step']}, {results['target']['loss']:.4f}; time to target = the first evaluation "
             f"(every {args.eval_interval} steps) at or below it x the median step time at that rate (evaluation "
             "not counted). Link use = wire bytes per step / (rate x step time). Losses are from "
             + ("one run" if args.seeds == 1 else f"{args.seeds} runs (seeds)") + " on the "
             "unlimited link, except where marked (*: that configuration's own run at that rate: what it sends "
             "depends on the link).", ""]
    for rate, per in results["rates"].items():
        shared = " between the nodes, each direction" if args.nodes else " (shared by both ranks)"
        wire = "MB/step between the nodes" if args.nodes else "wire MB/step (all ranks)"
        lines += [f"**{rate}**" + (" (no rate limit)" if rate == UNLIMITED else shared), "",
                  f"| configuration | step s | speed-up vs fp32 | vs bf16 | {wire} | wire vs fp32 | link use "
                  "| grad / param KB per step (rank 0) | val loss | gap | steps to target | time to target s "
                  "| vs stock fp32's |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, r in per.items():
            c = dict(results["configs"][name])
            c.update({k: r[k] for k in ("grad_bytes_per_step", "param_bytes_per_step") if k in r})  # its own run's
            split = "—" if c["grad_bytes_per_step"] is None else (
                f"{c['grad_bytes_per_step'] / 1e3:,.0f} / "
                + ("stock" if c["param_bytes_per_step"] is None else f"{c['param_bytes_per_step'] / 1e3:,.0f}"))
            mark = "*" if r["loss_run"] != UNLIMITED else ""
            if r["time_to_target_s"] is None:
                reach = f"not reached in {args.converge_steps} | — | —"
            else:
                vs = r["time_to_target_vs_fp32"]
                reach = f"{r['steps_to_target']} | {seconds(r['time_to_target_s'])} | "
                reach += "—" if vs is None else f"{vs:.2f}x"
            use = "—" if r["link_utilisation"] is None else f"{100 * r['link_utilisation']:.0f}%"
            lines.append(f"| {c['label']} | {r['step_s']:.2f} | {r['speedup_vs_fp32']:.2f}x | {r['speedup_vs_bf16']:.2f}x "
                         f"| {r['net_bytes_per_step'] / 1e6:.2f} | "
                         + ("—" if r["wire_vs_stock_fp32"] is None else f"{r['wire_vs_stock_fp32']:.1f}x")
                         + f" | {use} | {split} "
                         f"| {r['val_loss']:.4f}{mark} | {r['val_gap_pct']:+.2f}% | {reach} |")
        lines.append("")
    lines += ["Time to target, s (and against stock fp32's at the same rate): the first evaluation at or below stock "
              "fp32's loss at each target step x the median step time" + (" (* its own loss run at that rate)"
                                                                          if any(r["loss_run"] != UNLIMITED for per in
                                                                                 results["rates"].values()
                                                                                 for r in per.values()) else "")
              + ":", "",
              "| configuration | " + " | ".join(f"step {t['step']} ({t['loss']:.4f}), {rate}" for t in results["targets"]
                                                for rate in results["rates"]) + " |",
              "|---|" + "---:|" * (len(results["targets"]) * len(results["rates"]))]
    for name, c in results["configs"].items():
        cells = []
        for i in range(len(results["targets"])):
            for rate, per in results["rates"].items():
                t = per[name]["targets"][i]
                mark = "*" if per[name]["loss_run"] != UNLIMITED else ""
                if t["time_to_target_s"] is None:
                    cells.append(f"not reached in {args.converge_steps} steps{mark}")
                else:
                    vs = t["time_to_target_vs_fp32"]
                    cells.append(f"{seconds(t['time_to_target_s'])}{mark} (step {t['steps_to_target']}"
                                 + ("" if vs is None else f", {vs:.2f}x") + ")")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += seed_table(args, results)
    rates = [r for r in results["rates"] if r != UNLIMITED]
    if UNLIMITED in results["rates"]:
        ceiling = results["rates"][UNLIMITED]
        lines += ["Each rate's step time over the unlimited link's (the ceiling of what compression can win back):", "",
                  "| configuration | unlimited step s | " + " | ".join(f"{r} / unlimited" for r in rates) + " |",
                  "|---|---:|" + "---:|" * len(rates)]
        for name, c in results["configs"].items():
            ratios = " | ".join(f"{results['rates'][r][name]['step_s'] / ceiling[name]['step_s']:.2f}x" for r in rates)
            lines.append(f"| {c['label']} | {ceiling[name]['step_s']:.2f} | {ratios} |")
        lines.append("")
    for rate, per in results["rates"].items():
        grads_only = [n for n in per if BY_NAME[n].grads_only and "dgc" in n and rate != UNLIMITED]
        for name in grads_only:
            # gradient-only compression can remove at most the traffic that is not the weights' all-gather:
            # its bound is stock's bytes over the bytes left when the gradients cost (almost) nothing
            bound = per["stock_fp32"]["net_bytes_per_step"] / per[name]["net_bytes_per_step"]
            lines.append(f"- {rate}: gradient-only {BY_NAME[name].label}: {per[name]['speedup_vs_fp32']:.2f}x faster "
                         f"than stock fp32; it leaves the weights' all-gather as stock, so its bound is stock's bytes "
                         f"over its own, {bound:.2f}x.")
    return "\n".join(lines) + "\n"


def plot(args: argparse.Namespace, results: dict, path: Path) -> None:
    """One panel per rate: validation loss against modelled wall-clock time (evaluation step x median step time at
    that rate), the target as a dashed line. Last panel: median step time per configuration and rate (log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = list(results["rates"])
    panels = len(rates) + 1
    cols = min(panels, 2)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 5.2 * rows), squeeze=False)
    axes = axes.ravel()
    for ax, rate in zip(axes, rates):
        for name, r in results["rates"][rate].items():
            steps, losses = zip(*r["val_losses"])
            ax.plot([st * r["step_s"] for st in steps], losses, marker=".", markersize=3,
                    label=name + (" (own run at this rate)" if r["loss_run"] != UNLIMITED else ""))
        for t in results["targets"]:
            ax.axhline(t["loss"], color="grey", linestyle="--", linewidth=0.8,
                       label=f"target: stock fp32 at step {t['step']}")
        ax.set_xlabel("modelled wall-clock (s) = step x median step time at this rate")
        ax.set_ylabel("validation loss")
        ax.set_title(f"validation loss against time, {rate}" + (" (no rate limit)" if rate == UNLIMITED else ""))
        ax.set_ylim(top=max(t["loss"] for t in results["targets"]) * 1.2)  # the early losses (4 and more) hide the rest
        ax.legend(fontsize=7)
    ax = axes[len(rates)]
    names = list(results["configs"])
    width = 0.8 / len(rates)
    for i, rate in enumerate(rates):
        values = [results["rates"][rate][n]["step_s"] for n in names]
        ax.bar([j + i * width for j in range(len(names))], values, width, label=rate)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=35, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("median step time (s)")
    ax.set_title("step time per configuration and link rate")
    ax.legend()
    for extra in axes[panels:]:
        extra.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SIMD_NAMES = {"avx512f": "AVX-512", "avx2": "AVX2", "avx": "AVX", "sse4_2": "SSE4.2"}  # /proc/cpuinfo flag, widest first


def cpu_description(cpuinfo: str | None = None) -> str:
    """The CPU as /proc/cpuinfo names it, with its family and model numbers, clock and widest vector extension
    (hosts that all call themselves "AMD EPYC" differ 2x in this benchmark's step time)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "unknown CPU"
    fields = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    if "model name" not in fields:
        return "unknown CPU"
    flags = set(fields.get("flags", "").split())
    simd = next((name for flag, name in SIMD_NAMES.items() if flag in flags), "no AVX")
    details = [f"family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields and "model" in fields
               else None, f"{float(fields['cpu MHz']):.0f} MHz" if "cpu MHz" in fields else None, simd]
    return f"{fields['model name']} ({', '.join(d for d in details if d)})"


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """One thread's fp32 matrix-product rate, GFLOP/s (the median of ``repeats`` n x n products): what the step
    times' compute part scales with."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2 * n**3 / statistics.median(times) / 1e9


def machine() -> str:
    return (f"{os.cpu_count()} cores ({cpu_description()}; one core's fp32 matmul {matmul_gflops():.0f} GFLOP/s), "
            "no GPU use (gloo over the namespace loopback)")


def write_outputs(args: argparse.Namespace, convergence: dict, timing: dict, per_rate: dict, meta: dict) -> None:
    """Analyse the launches; write ``results.md``, ``bench_network.png`` and ``results.json`` under ``--out-dir`` (and
    ``--json``), and print the tables."""
    results = analyse(args, convergence, timing, per_rate)
    table = markdown(args, results, meta)
    (args.out_dir / "results.md").write_text(table)
    plot(args, results, args.out_dir / "bench_network.png")
    payload = {"meta": meta, "results": results, "timing_rounds": timing}
    for path in filter(None, [args.out_dir / "results.json", args.json]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n")
    print("\n" + table, end="")
    print(f"wrote {args.out_dir / 'results.md'}, {args.out_dir / 'bench_network.png'}"
          + (f", {args.json}" if args.json else ""), flush=True)
