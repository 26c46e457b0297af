"""Convergence study: validation loss against compression ratio on the main job, 2 ranks, same seed.

Run from the repository root::

    python -m benchmarks.study_convergence --json runs/study/results.json --results results

Every setting trains ``examples/train_char_gpt.py`` with ``configs/zero3_baseline.json`` (char GPT
of 0.8M parameters, Adam, 16 x 64 characters per rank per step) and a ``"dgc"`` section:

- stock ZeRO-3 (no ``"dgc"``) and dense INT4 gradients with error feedback;
- *plain error feedback*: top-k gradients at density 0.3, 0.1, 0.03, 0.01 and ``"auto"``, INT4 values;
- *Adam-aware* (``compressed_momentum``, 1-bit Adam's recipe, see ``deepspeed_dgc/memory/momentum.py``):
  dense INT4 gradients for ``--freeze-step`` steps, then the momentum, preconditioned by the frozen
  ``sqrt(v_hat)``, at the same densities with INT4 values, and dense at INT2 and at 1 bit (``adam_int1_w2``:
  the 1-bit setting with dense INT2 gradients in the warm-up);
- *decoupled* (``decoupled_momentum``, DeMo, see ``deepspeed_dgc/codec/dct.py``): every rank's own momentum, a DCT
  top-1/2/4 of each 64-column chunk in INT4 or INT2, the sign update; and the same with the owners' Adam instead of
  the sign, without the DCT, and with the momentum stored in bf16;
- *shared mask* (``shared_mask``, after SCAPE): the owners choose the coordinates from Adam's state, every rank
  sends values only there, at densities 0.2, 0.05, 0.01, and at 0.05 chosen by ``|exp_avg|`` or without the moving
  window;
- ``*_zlib``: a setting with ``entropy_coding: "zlib"`` (lossless: the same losses, fewer bytes);
- the residual stored in fp8 instead of fp32 for the two best settings.

All run ``--steps`` steps; stock and the ``--long-best`` (3) best run ``--long-steps`` as well ("best": the largest
compression ratio among those within 1% of stock's validation loss, then the smallest gaps), or the settings
named by ``--long``. ``--jobs N`` runs N launches at once (results are the same; only wall time changes).
``--merge JSON...`` adds the rows of earlier runs (same seed) for what this run did not run, marked with their date.
Columns: final validation loss, gap to stock, compression ratio of the gradient traffic over the
whole run (warm-up included) against fp32, the extension's state in bytes per parameter per rank, and
wire bits per kept element. Outputs: ``<out-dir>/<setting>_<steps>.json`` per run (reused when present
with the same config, unless ``--fresh``), ``<out-dir>/study.md``, ``<out-dir>/study.png``
(compression ratio, log scale, against the gap; one point per setting) and, with ``--results DIR``,
copies of both as ``DIR/study_convergence.{md,png}``.
"""

import argparse
import concurrent.futures
import json
import queue
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = ROOT / "examples" / "train_char_gpt.py"
BASE_CONFIG = ROOT / "configs" / "zero3_baseline.json"
DENSITIES = (0.3, 0.1, 0.03, 0.01, "auto")
GAP_TARGET_PCT = 1.0
BENCH_MODEL = {"n_layer": 6, "n_embd": 384, "n_head": 6, "block_size": 128, "micro_batch": 8}  # bench_network.py's


def settings(freeze_step: int) -> dict:
    """name -> (family, label, "dgc" section or None)."""
    # fp32 residuals unless a setting says (the table's rows were measured so; "auto", the default since, stores fp8)
    base = {"enabled": True, "quantization": "int4", "group_size": 128, "error_feedback": True, "residual_dtype": "fp32",
            "min_numel": 2048, "stats_interval": 1000000}
    out = {"stock": ("stock", "stock ZeRO-3 (fp32)", None),
           "int4_dense": ("plain EF", "dense INT4 + error feedback", dict(base, density=1.0))}
    for d in DENSITIES:
        out[f"ef_d{d}"] = ("plain EF", f"top-k {d} INT4 + error feedback", dict(base, density=d))
    for d in DENSITIES:
        out[f"adam_d{d}"] = ("Adam-aware", f"compressed momentum, top-k {d} INT4",
                             dict(base, density=1.0, compressed_momentum={"freeze_step": freeze_step,
                                                                         "quantization": "int4", "density": d}))
    for q in ("int2", "int1"):
        out[f"adam_{q}"] = ("Adam-aware", f"compressed momentum, dense {q.upper()}",
                            dict(base, density=1.0, compressed_momentum={"freeze_step": freeze_step, "quantization": q}))
    out["adam_int1_w2"] = ("Adam-aware", "compressed momentum, dense INT1, INT2 warm-up",
                           dict(base, density=1.0, quantization="int2",
                                compressed_momentum={"freeze_step": freeze_step, "quantization": "int1"}))
    out["adam_int2_zlib"] = ("Adam-aware", "compressed momentum, dense INT2, zlib-coded",
                             dict(out["adam_int2"][2], entropy_coding="zlib"))
    out["int4_dense_zlib"] = ("plain EF", "dense INT4 + error feedback, zlib-coded",
                              dict(out["int4_dense"][2], entropy_coding="zlib"))
    out["ef_d0.1_r8"] = ("plain EF", "top-k 0.1 INT4 + error feedback, threshold reused for 8 steps",
                         dict(base, density=0.1, threshold_reuse_steps=8))
    for g in (512, 1024):  # fewer scales after the freeze: preconditioned momenta share one magnitude
        dgc = out["adam_int2_zlib"][2]
        out[f"adam_int2_zlib_g{g}"] = ("Adam-aware", f"compressed momentum, dense INT2 in groups of {g}, zlib-coded",
                                       dict(dgc, compressed_momentum=dict(dgc["compressed_momentum"], group_size=g)))
    demo = {"enabled": True, "stats_interval": 1000000}  # decoupled_momentum has its own codec: no top-level codec keys
    for k in (1, 2, 4):
        out[f"demo_k{k}"] = ("decoupled", f"decoupled momentum (DeMo), DCT top-{k} of 64, INT4, sign update",
                             dict(demo, decoupled_momentum={"topk": k}))
    for k in (1, 2):
        out[f"demo_k{k}_int2"] = ("decoupled", f"decoupled momentum (DeMo), DCT top-{k} of 64, INT2, sign update",
                                  dict(demo, decoupled_momentum={"topk": k, "quantization": "int2"}))
    out["demo_k2_int2_bf16"] = ("decoupled", "decoupled momentum (DeMo), DCT top-2 of 64, INT2, sign update, bf16 "
                                "momentum", dict(demo, decoupled_momentum={"quantization": "int2", "storage": "bf16"}))
    out["demo_k2_int2_int8"] = ("decoupled", "decoupled momentum (DeMo), DCT top-2 of 64, INT2, sign update, int8 "
                                "momentum (stochastic rounding)",
                                dict(demo, decoupled_momentum={"quantization": "int2", "storage": "int8"}))
    out["demo_k2_adam"] = ("decoupled", "decoupled momentum, DCT top-2 of 64, INT4, the owners' Adam on the sum",
                           dict(demo, decoupled_momentum={"update": "adam"}))
    out["demo_k2_none"] = ("decoupled", "decoupled momentum, top-2 of 64 without the DCT, INT4, sign update",
                           dict(demo, decoupled_momentum={"transform": "none"}))
    for d in (0.2, 0.05, 0.01):
        out[f"mask_d{d}"] = ("shared mask", f"owner-chosen shared masks (SCAPE), density {d}, INT4, Adam step sizes",
                             dict(demo, shared_mask={"density": d}))
    out["mask_d0.05_m"] = ("shared mask", "owner-chosen shared masks (SCAPE), density 0.05, INT4, first-moment magnitudes",
                           dict(demo, shared_mask={"density": 0.05, "score": "exp_avg"}))
    out["mask_d0.05_e0"] = ("shared mask", "owner-chosen shared masks (SCAPE), density 0.05, INT4, no moving window",
                            dict(demo, shared_mask={"density": 0.05, "explore": 0.0}))
    # the hierarchical topology (run with --num-gpus 4: 2 nodes of 2): the storage of its node-level state
    hier = {"topology": "hierarchical", "ranks_per_node": 2}
    for dtype in ("fp32", "bf16", "fp8"):
        out[f"h_int4_dense_{dtype}"] = ("hierarchical", f"hierarchical 2x2, dense INT4 + error feedback, {dtype} residual",
                                        dict(out["int4_dense"][2], residual_dtype=dtype, **hier))
    for storage in ("fp32", "bf16", "int8"):
        out[f"h_demo_k2_int2_{storage}"] = ("hierarchical", f"hierarchical 2x2, decoupled momentum, DCT top-2 of 64, "
                                            f"INT2, {storage} momentum",
                                            dict(demo, decoupled_momentum={"quantization": "int2", "storage": storage},
                                                 **hier))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--long-steps", type=int, default=1000, help="0: no long runs")
    parser.add_argument("--long-best", type=int, default=3, help="how many of the best settings also run --long-steps")
    parser.add_argument("--long", nargs="+", metavar="SETTING", help="run these at --long-steps instead of the best")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                        help="add the rows of earlier runs' --json for settings and steps this run does not have "
                        "(same seed and main job; marked with their run's date in the table)")
    parser.add_argument("--jobs", type=int, default=1, help="launches at once (each on its own port; 2 ranks each)")
    parser.add_argument("--master-port", type=int, default=29720, help="first master port (launch i uses it + i)")
    parser.add_argument("--freeze-step", type=int, default=60, help="Adam-aware settings: steps before the freeze")
    parser.add_argument("--only", nargs="+", help="run only these settings (stock is always run)")
    parser.add_argument("--fp8-residual-best", type=int, default=2, help="also run the best N with residual_dtype fp8")
    parser.add_argument("--fp8-residual", nargs="+", metavar="SETTING",
                        help="run these with residual_dtype fp8 instead of the best")
    parser.add_argument("--bf16-residual", nargs="+", metavar="SETTING", help="also run these with residual_dtype bf16")
    parser.add_argument("--model", choices=("main", "bench"), default="main",
                        help="main: the main job's char GPT (0.8M parameters, 16 x 64 characters per rank); bench: the "
                        "network benchmark's (10.7M: 6 layers x 384, 6 heads, 8 x 128 characters per rank)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--num-gpus", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=Path("runs/study"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--results", type=Path, help="copy the table and plot here as study_convergence.{md,png}")
    parser.add_argument("--fresh", action="store_true", help="rerun settings whose summary already exists")
    args = parser.parse_args(argv)
    known = settings(args.freeze_step)
    for option in ("only", "long", "fp8_residual", "bf16_residual"):
        unknown = [n for n in getattr(args, option) or [] if n not in known]
        if unknown:
            parser.error(f"--{option.replace('_', '-')}: unknown {unknown}; choose from {list(known)}")
    if args.steps < 1 or args.long_steps < 0 or args.freeze_step < 1 or min(args.fp8_residual_best, args.long_best) < 0:
        parser.error("--steps and --freeze-step must be >= 1, --long-steps, --long-best and --fp8-residual-best >= 0")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    return args


def run_all(jobs: list[tuple[str, dict | None, int]], args: argparse.Namespace) -> dict:
    """Run every ``(name, dgc, steps)`` of ``jobs``, ``--jobs`` at a time (each launch on its own master port);
    returns ``{(name, steps): summary}``. Results do not depend on what runs beside them (CPU runs are
    deterministic); only their wall time does.

    Raises RuntimeError when a run fails.
    """
    ports = queue.Queue()
    for i in range(args.jobs):
        ports.put(args.master_port + i)

    def one(job):
        port = ports.get()
        try:
            return run(*job, args, port=port)
        finally:
            ports.put(port)

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        summaries = list(pool.map(one, jobs))
    return {(name, steps): s for (name, _, steps), s in zip(jobs, summaries)}


def run(name: str, dgc: dict | None, steps: int, args: argparse.Namespace, port: int = 29720,
        base: dict | None = None) -> dict:
    """Train one setting for ``steps`` (or reuse its summary); returns the summary dict. ``base``: the ds_config to
    start from instead of ``configs/zero3_baseline.json`` (benchmarks/study_jobs.py's edited configs), not modified.

    Raises RuntimeError when the run fails.
    """
    ds = json.loads(json.dumps(base) if base is not None else BASE_CONFIG.read_text())
    if dgc is not None:
        ds["dgc"] = dgc
    model_args = []
    if args.model == "bench":
        ds["train_micro_batch_size_per_gpu"] = BENCH_MODEL["micro_batch"]
        model_args = [a for k in ("n_layer", "n_embd", "n_head", "block_size")
                      for a in ("--" + k.replace("_", "-"), str(BENCH_MODEL[k]))]
    tag = f"{name}_{steps}"
    config_path = args.out_dir / "configs" / f"{tag}.json"
    summary_path = args.out_dir / f"{tag}.json"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(ds, indent=2) + "\n"
    if not args.fresh and summary_path.exists() and config_path.exists() and config_path.read_text() == text:
        summary = json.loads(summary_path.read_text())
        if summary.get("steps") == steps and summary.get("seed") == args.seed:
            print(f"  {tag}: reusing {summary_path}", flush=True)
            return summary
    config_path.write_text(text)
    summary_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.num_gpus), "--master_port", str(port),
           str(TRAIN_SCRIPT), "--deepspeed_config", str(config_path), "--max-steps", str(steps), "--seed", str(args.seed),
           "--eval-interval", str(max(1, steps // 10)), "--summary-json", str(summary_path)] + model_args
    log_path = args.out_dir / "logs" / f"{tag}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(log_path, "w") as log:
        result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    if result.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"{tag} failed with exit code {result.returncode} (log: {log_path})")
    summary = json.loads(summary_path.read_text())
    print(f"  {tag}: val {summary['final_val_loss']:.4f}, ratio {summary['compression_ratio']:.1f}x "
          f"({time.time() - started:.0f} s)", flush=True)
    return summary


def row(name: str, family: str, label: str, s: dict, stock: dict) -> dict:
    gap = 100.0 * (s["final_val_loss"] - stock["final_val_loss"]) / stock["final_val_loss"]
    return {"name": name, "family": family, "label": label, "steps": s["steps"], "val_loss": s["final_val_loss"],
            "gap_pct": gap, "compression_ratio": s["compression_ratio"],
            "state_bytes_per_param": s.get("state_bytes_per_param") or 0.0,
            "bits_per_kept_element": s.get("bits_per_kept_element"), "skipped_steps": s["skipped_steps"]}


def merged_rows(rows: list[dict], paths: list[Path], seed: int, freeze_step: int = 60) -> list[dict]:
    """``rows`` plus the rows of each earlier results JSON in ``paths`` whose (setting, steps) is not in them yet,
    each tagged ``"run": "<that run's date>, <file name>"``; an Adam-aware row of a run with another ``--freeze-step`` is renamed
    ``<name>_f<step>`` (its label says the step). SystemExit when a file is missing or has another seed."""
    have = {(r["name"], r["steps"]) for r in rows}
    out = list(rows)
    for path in paths:
        if not path.is_file():
            raise SystemExit(f"study_convergence.py: --merge: no {path}")
        earlier = json.loads(path.read_text())
        if earlier["meta"]["seed"] != seed:
            raise SystemExit(f"study_convergence.py: --merge: {path} was made with seed {earlier['meta']['seed']}, "
                             f"this run with {seed}")
        other_freeze = earlier["meta"].get("freeze_step", freeze_step)
        for r in earlier["rows"]:
            if r["family"] == "Adam-aware" and other_freeze != freeze_step:
                r = dict(r, name=f"{r['name']}_f{other_freeze}", label=f"{r['label']}, frozen after step {other_freeze}")
            if (r["name"], r["steps"]) not in have:
                have.add((r["name"], r["steps"]))
                out.append(dict(r, run=r.get("run") or f"{earlier['meta']['date']}, {path.name}"))
    return out


def best(rows: list[dict], n: int) -> list[str]:
    """Names of the n best compressed settings: within the gap target by ratio, then the rest by gap."""
    cands = [r for r in rows if r["family"] != "stock"]
    within = sorted((r for r in cands if r["gap_pct"] <= GAP_TARGET_PCT), key=lambda r: -r["compression_ratio"])
    rest = sorted((r for r in cands if r["gap_pct"] > GAP_TARGET_PCT), key=lambda r: r["gap_pct"])
    return [r["name"] for r in (within + rest)[:n]]


def markdown(rows: list[dict], meta: dict) -> str:
    """The results page: command, machine and date once at the top, then one row per setting and length. Rows merged
    from other runs' JSON (``--merge``) name their file in the last column; those files hold their own commands."""
    command = meta.get("command")
    lines = [f"Command: `{command}`" if command else "", "",
             f"{meta['date']}, {meta['machine']}; main job (char GPT, {meta['n_params']:,} parameters, Adam), "
             f"{meta.get('ranks', 2)} ranks, seed {meta['seed']}; ratio = fp32 reduce-scatter bytes over wire bytes for the whole run "
             f"(warm-up included); state = the extension's bytes per parameter per rank after the last step.", "",
             "| setting | family | steps | final val loss | gap vs stock | compression vs fp32 | state B/param "
             "| bits per kept element | from |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: r["steps"]):
        bits = "" if not r["bits_per_kept_element"] else f"{r['bits_per_kept_element']:.1f}"
        source = r["run"].split(", ")[-1] if r.get("run") else "this run"
        lines.append(f"| {r['label']} (`{r['name']}`) | {r['family']} | {r['steps']} | {r['val_loss']:.4f} "
                     f"| {r['gap_pct']:+.2f}% | {r['compression_ratio']:.1f}x | {r['state_bytes_per_param']:.2f} | {bits} "
                     f"| {source} |")
    return "\n".join(lines).lstrip("\n") + "\n"


def plot(rows: list[dict], path: Path, steps: int) -> None:
    """Ratio (log) against gap, one point per setting at ``steps``: the whole range, and beside it the
    region around the 1% gap line, enlarged."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [1, 1.3]})
    markers = {"stock": "k*", "plain EF": "o", "Adam-aware": "s", "decoupled": "^", "shared mask": "D", "hierarchical": "v"}
    at_steps = [r for r in rows if r["steps"] == steps]
    zoom = {"x": (-1.5, 4.0), "y": (10.0, 300.0)}
    for ax, window in zip(axes, (None, zoom)):
        for family, marker in markers.items():
            pts = [r for r in at_steps if r["family"] == family]
            if window:
                pts = [r for r in pts if window["x"][0] <= r["gap_pct"] <= window["x"][1]
                       and window["y"][0] <= r["compression_ratio"] <= window["y"][1]]
            if not pts:
                continue
            ax.plot([r["gap_pct"] for r in pts], [r["compression_ratio"] for r in pts], marker, label=family, ms=8,
                    linestyle="none")
            for i, r in enumerate(sorted(pts, key=lambda r: (r["compression_ratio"], r["gap_pct"]))):
                # neighbours in ratio get labels at staggered heights, so clustered points stay readable
                ax.annotate(r["name"], (r["gap_pct"], r["compression_ratio"]), fontsize=6 if window else 7,
                            xytext=(5, 4 + 9 * (i % 4)), textcoords="offset points",
                            arrowprops=dict(arrowstyle="-", lw=0.3, color="grey"))
        ax.axvline(GAP_TARGET_PCT, color="grey", linestyle=":", label=f"{GAP_TARGET_PCT:g}% gap")
        ax.axhline(32, color="grey", linestyle="--", label="32x")
        ax.axhline(100, color="grey", linestyle="-.", label="100x")
        ax.set_yscale("log")
        ax.set_xlabel(f"validation-loss gap to stock after {steps} steps (%)")
        ax.set_ylabel("compression ratio vs fp32 (log)")
        if window:
            from matplotlib.ticker import NullFormatter, ScalarFormatter
            ax.set_xlim(*window["x"])
            ax.set_ylim(*window["y"])
            ax.set_yticks([10, 16, 32, 64, 100, 150, 250])
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_title("the same, around 1% gap")
        else:
            ax.set_title("compression against convergence, main job, 2 ranks")
            ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    known = settings(args.freeze_step)
    names = ["stock"] + [n for n in known if n != "stock" and (not args.only or n in args.only)]
    started = time.time()
    summaries, rows = {}, []
    print(f"{len(names)} settings x {args.steps} steps, {args.jobs} at a time", flush=True)
    summaries.update(run_all([(n, known[n][2], args.steps) for n in names], args))
    stock = summaries[("stock", args.steps)]
    rows = [row(n, known[n][0], known[n][1], summaries[(n, args.steps)], stock) for n in names]
    cheap_names = []
    for dtype, names in (("fp8", args.fp8_residual or best(rows, args.fp8_residual_best)), ("bf16", args.bf16_residual)):
        for name in names or []:
            family, label, dgc = known[name]
            known[f"{name}_r{dtype}"] = (family, f"{label}, {dtype} residual", dict(dgc, residual_dtype=dtype))
            cheap_names.append(f"{name}_r{dtype}")
    summaries.update(run_all([(n, known[n][2], args.steps) for n in cheap_names], args))
    rows += [row(n, known[n][0], known[n][1], summaries[(n, args.steps)], stock) for n in cheap_names]
    if args.long_steps:
        long_names = list(dict.fromkeys(["stock"] + (args.long or best(rows, args.long_best))))  # once each
        summaries.update(run_all([(n, known[n][2], args.long_steps) for n in long_names], args))
        long_stock = summaries[("stock", args.long_steps)]
        rows += [row(n, known[n][0], known[n][1], summaries[(n, args.long_steps)], long_stock) for n in long_names]
    if args.merge:
        rows = merged_rows(rows, args.merge, args.seed, args.freeze_step)
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime(started)), "seed": args.seed, "ranks": args.num_gpus, "n_params": stock["n_params"],
            "machine": f"{__import__('os').cpu_count()} CPU cores, gloo", "elapsed_s": time.time() - started,
            "freeze_step": args.freeze_step,
            "command": " ".join(["python", "-m", "benchmarks.study_convergence"] + list(argv if argv is not None else sys.argv[1:]))}
    table = markdown(rows, meta)
    (args.out_dir / "study.md").write_text(table)
    plot(rows, args.out_dir / "study.png", args.steps)
    payload = {"meta": meta, "rows": rows}
    for path in filter(None, [args.out_dir / "results.json", args.json]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n")
    if args.results:
        args.results.mkdir(parents=True, exist_ok=True)
        shutil.copy(args.out_dir / "study.md", args.results / "study_convergence.md")
        shutil.copy(args.out_dir / "study.png", args.results / "study_convergence.png")
    print("\n" + table, end="")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as exc:
        sys.exit(f"study_convergence.py: {exc}")
