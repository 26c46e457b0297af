"""The recommended method in the jobs DeepSpeed users run (issue 51, item 1): for each job feature, the same edit made
to the two shipped configs, stock ZeRO-3 (``configs/zero3_baseline.json``) and the recommended method
(``configs/zero3_dgc_adam.json``: decoupled momentum, DCT top-2 of 64, INT2, int8 momentum), each trained on the main job
(``examples/train_char_gpt.py``, 2 ranks, seed 1234) for ``--steps``; the table gives both validation losses, the gap
and the compression ratio. Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks.study_jobs --results results

Features (``FEATURES``): ZeRO-Offload (``offload_optimizer`` to the host, DeepSpeed's CPU Adam), parameter offload,
fp16 with dynamic loss scaling, bf16, ``torch_autocast`` (bf16), AdamW with weight decay, SGD with momentum (the
method's run hands its decoded update to SGD: ``update: "optimizer"``), Lion (DeepSpeed's FusedLion, and its CPU Lion
under ZeRO-Offload), gradient accumulation 2 at the same global batch, and ``"policy": "auto"`` (a ``"dgc"`` key: the
method's run only). Before a config trains, a short launch (:mod:`benchmarks.study_jobs_probe`) initializes the engine
with it, steps twice and reports what is on (optimizer class, offload, loss scaler, the dtype the forward ran in, ...);
a run whose facts miss the feature is not trained, and a config DeepSpeed or the extension refuses gets the refusal's
message in the table instead of a loss. Optimizers whose learning rate the main job does not set (``lrs``) first run
stock at each candidate for ``--sweep-steps``; the lowest validation loss there gives the feature's lr (``--lr``
fixes it instead; ``--extra-lr`` adds a row at another lr). Runs, probes and configs go to ``--out-dir`` (reused when present with the same config, unless
``--fresh``); the launches go through :func:`benchmarks.study_convergence.run`, one at a time.
"""

import argparse
import copy
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks import study_convergence as sc
from benchmarks.soak import free_port, launch_env, remove_shm_buffers

ROOT = sc.ROOT
STOCK_CONFIG = ROOT / "configs" / "zero3_baseline.json"
METHOD_CONFIG = ROOT / "configs" / "zero3_dgc_adam.json"
ADAM_BETAS = [0.9, 0.99]  # the shipped configs'
FACTS_PREFIX = "FACTS "  # benchmarks/study_jobs_probe.py's rank 0 prints its facts on one line after it
# DeepSpeed's host optimizers, built once before any launch: two ranks building one op at once can fail to load it
HOST_OPS = ("CPUAdamBuilder", "CPULionBuilder")


@dataclass(frozen=True)
class Feature:
    """One job feature: ``edit`` (dotted key -> value) is made to both shipped configs, ``method_edit`` to the method's
    run only; ``expect`` (fact -> value, dotted for a nested fact) is what the probe must find in both runs,
    ``expect_method`` in the method's only; ``lrs``: stock learning rates to try first (the edit's lr is then set by
    :func:`with_lr`; ``sweep_as``: the name those runs go by, so that features sharing a stock optimizer share them).
    ``method_edit`` holds ``"dgc."`` keys, or :func:`lr_edit`'s where the method's run takes its own lr."""
    name: str
    label: str
    edit: dict = field(default_factory=dict)
    method_edit: dict = field(default_factory=dict)
    expect: dict = field(default_factory=dict)
    expect_method: dict = field(default_factory=dict)
    lrs: tuple = ()
    sweep_as: str = ""
    note: str = ""


def lr_edit(lr: float) -> dict:
    """The keys that set a job's learning rate: the optimizer's and the warm-up's peak (the main job warms up to it)."""
    return {"optimizer.params.lr": lr, "scheduler.params.warmup_max_lr": lr}


def optimizer_edit(type_: str, **params) -> dict:
    """Replace the optimizer by ``type_`` with ``params`` (its lr also the warm-up's peak, when given)."""
    out = {"optimizer": {"type": type_, "params": params}}
    if "lr" in params:
        out["scheduler.params.warmup_max_lr"] = params["lr"]
    return out


OFFLOAD_OPTIMIZER = {"zero_optimization.offload_optimizer": {"device": "cpu"}}
LION = optimizer_edit("Lion", lr=3e-4, betas=ADAM_BETAS, weight_decay=0.0)
SGD = dict(optimizer_edit("SGD", lr=0.3, momentum=0.9), zero_allow_untested_optimizer=True)  # DeepSpeed asks for it
SGD_LRS = (0.1, 0.3, 1.0, 3.0)
# Lion steps on u, the decoded sum of the ranks' momenta: a shorter momentum (decay 0.9, Lion's own integrates it)
# and twice the coefficients of the Adam config kept stock Lion's loss (docs/methods.md, "Lion")
LION_ON_U = {"dgc.decoupled_momentum.update": "optimizer", "dgc.decoupled_momentum.decay": 0.9,
             "dgc.decoupled_momentum.topk": 4}
FEATURES = [
    Feature("main", "the main job (no edit)", expect={"optimizer": "AdamW", "forward_dtype": ["float32"]}),
    Feature("offload_optimizer", "ZeRO-Offload: optimizer on the host, DeepSpeed's CPU Adam",
            dict(OFFLOAD_OPTIMIZER, **{"optimizer.params.torch_adam": False}),
            expect={"offload_optimizer": True, "optimizer": "DeepSpeedCPUAdam"},
            note="with `torch_adam` DeepSpeed would step torch's AdamW on the host instead"),
    Feature("offload_param", "parameter offload to the host",
            {"zero_optimization.offload_param": {"device": "cpu"}}, expect={"offload_param": True}),
    Feature("fp16", "fp16, dynamic loss scaling from 2^16", {"fp16": {"enabled": True, "initial_scale_power": 16}},
            expect={"fp16": True, "dynamic_loss_scale": True, "forward_dtype": ["float16"]}),
    Feature("bf16", "bf16", {"bf16": {"enabled": True}},
            expect={"bf16": True, "partition_dtype": "bfloat16", "forward_dtype": ["bfloat16"]}),
    Feature("torch_autocast", "torch_autocast, bf16", {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
            expect={"torch_autocast": True, "partition_dtype": "float32", "forward_dtype": ["bfloat16"]}),
    Feature("adamw_wd", "AdamW, weight decay 0.1",
            optimizer_edit("AdamW", lr=0.003, betas=ADAM_BETAS, eps=1e-8, weight_decay=0.1, torch_adam=True),
            expect={"optimizer": "AdamW", "weight_decay": 0.1}),
    Feature("sgd", "SGD, momentum 0.9, the method's update handed to SGD", SGD,
            {"dgc.decoupled_momentum.update": "optimizer"}, expect={"optimizer": "SGD", "momentum": 0.9},
            lrs=SGD_LRS, note="`update: \"optimizer\"`: SGD steps on the decoded momentum sum, at stock's lr"),
    Feature("sgd_sign", "SGD, momentum 0.9, the method's sign step at its own lr", SGD, lr_edit(0.003),
            expect={"optimizer": "SGD", "momentum": 0.9}, lrs=SGD_LRS, sweep_as="sgd",
            note="the default sign step takes the optimizer's lr, which for SGD moves every coordinate by far too much; "
            "its run takes the main job's peak lr instead, the sign step's own (SGD's rule and state go unused)"),
    Feature("lion", "Lion (DeepSpeed's FusedLion)", LION, expect={"optimizer": "FusedLion"},
            note="DeepSpeed builds FusedLion on CUDA-like accelerators only"),
    Feature("lion_offload", "Lion under ZeRO-Offload (DeepSpeed's CPU Lion)", dict(LION, **OFFLOAD_OPTIMIZER),
            expect={"optimizer": "DeepSpeedCPULion", "offload_optimizer": True}, lrs=(1e-4, 3e-4, 1e-3, 3e-3),
            note="the method's sign step at Lion's lr"),
    Feature("lion_offload_optimizer",
            "Lion under ZeRO-Offload (DeepSpeed's CPU Lion), the method's update handed to Lion",
            dict(LION, **OFFLOAD_OPTIMIZER), LION_ON_U,
            expect={"optimizer": "DeepSpeedCPULion", "offload_optimizer": True}, lrs=(1e-4, 3e-4, 1e-3, 3e-3),
            sweep_as="lion_offload", note="Lion's own step on its momentum of u; the momentum's decay 0.9, top-4 of 64"),
    Feature("grad_accum", "gradient accumulation 2, micro-batch 8 (same global batch)",
            {"gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 8},
            expect={"gradient_accumulation_steps": 2, "micro_batch": 8}),
    Feature("policy_auto", "`\"policy\": \"auto\"` (per bucket: dense by stock's collective where that is faster)",
            method_edit={"dgc.policy": "auto"}, expect_method={"dgc.policy": "auto"}),
]
BY_NAME = {f.name: f for f in FEATURES}


def apply_edit(config: dict, edit: dict) -> dict:
    """A copy of ``config`` with every ``dotted.key -> value`` of ``edit`` set (sections made where missing; the
    value copied). Raises ValueError where a key's section is not a dict."""
    out = copy.deepcopy(config)
    for key, value in edit.items():
        *sections, leaf = key.split(".")
        node = out
        for name in sections:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ValueError(f"edit {key}: {name!r} is not a section")
        node[leaf] = copy.deepcopy(value)
    return out


def with_lr(feature: Feature, lr: float) -> Feature:
    """``feature`` with its optimizer's lr (and the warm-up's peak) set to ``lr``."""
    edit = dict(feature.edit)
    edit["optimizer"] = apply_edit(edit["optimizer"], {"params.lr": lr})
    return replace(feature, edit=dict(edit, **{"scheduler.params.warmup_max_lr": lr}))


def feature_configs(feature: Feature, stock_base: dict, method_base: dict) -> tuple[dict, dict]:
    """(stock + feature, method + feature): ``edit`` made to each shipped config, then ``method_edit`` to the method's."""
    return apply_edit(stock_base, feature.edit), apply_edit(apply_edit(method_base, feature.edit), feature.method_edit)


def edit_text(edit: dict) -> str:
    """The edit as the table shows it: ``key = JSON`` items joined by ``; `` ("none" when empty)."""
    return "; ".join(f"`{k} = {json.dumps(v)}`" for k, v in edit.items()) or "none"


def fact(facts: dict, key: str):
    """``facts[a][b]`` for ``key`` ``"a.b"``; None where a level is missing."""
    node = facts
    for name in key.split("."):
        node = node.get(name) if isinstance(node, dict) else None
    return node


def check_facts(facts: dict, expect: dict, dgc_on: bool) -> list[str]:
    """What the probe's ``facts`` lack of ``expect`` (and of the extension being on or off as it should): one
    ``"key: want X, got Y"`` per mismatch (a float compared to 1e-9)."""
    want = dict(expect, dgc_on=dgc_on)
    bad = []
    for key, value in want.items():
        got = fact(facts, key)
        same = (isinstance(got, (int, float)) and isinstance(value, float) and abs(got - value) <= 1e-9) or got == value
        if not same:
            bad.append(f"{key}: want {json.dumps(value)}, got {json.dumps(got)}")
    return bad


ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b: .+)$")


def error_message(log_text: str) -> str | None:
    """The last ``SomethingError: message`` line of a launch's log (a rank's ``[rankN]:`` prefix removed): the
    exception that ended the run; None where there is none."""
    found = [m.group(1).strip() for m in map(ERROR_LINE.match, log_text.splitlines()) if m]
    return found[-1] if found else None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sweep-steps", type=int, default=100, help="steps of the stock lr candidates (0: no sweep; "
                        "then each feature's lr is its edit's unless --lr)")
    parser.add_argument("--lr", action="append", default=[], metavar="FEATURE=LR", help="fix a feature's lr (no sweep)")
    parser.add_argument("--extra-lr", action="append", default=[], metavar="FEATURE=LR",
                        help="also run the feature at this lr, a row of its own (e.g. the runner-up of the sweep)")
    parser.add_argument("--only", nargs="+", choices=list(BY_NAME), help="run only these features")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out-dir", type=Path, default=Path("runs/study_jobs"))
    parser.add_argument("--results", type=Path, help="also write the table and the runs here as study_jobs.{md,json} "
                        "(always in --out-dir)")
    parser.add_argument("--fresh", action="store_true", help="rerun runs and probes whose results already exist")
    parser.add_argument("--probe-only", action="store_true", help="check what each config switches on; train nothing")
    args = parser.parse_args(argv)
    for option in ("lr", "extra_lr"):
        flag = "--" + option.replace("_", "-")
        try:
            pairs = [(k, float(v)) for k, v in (item.split("=", 1) for item in getattr(args, option))]
        except ValueError:
            parser.error(f"{flag} expects FEATURE=LR, e.g. {flag} sgd=0.3")
        unknown = [k for k, _ in pairs if k not in BY_NAME or not BY_NAME[k].lrs]
        if unknown:
            parser.error(f"{flag}: {unknown} have no lr to set; choose from {[f.name for f in FEATURES if f.lrs]}")
        setattr(args, option, dict(pairs) if option == "lr" else pairs)
    if args.steps < 1 or args.sweep_steps < 0:
        parser.error("--steps must be >= 1, --sweep-steps >= 0")
    args.model, args.num_gpus = "main", 2  # what benchmarks.study_convergence.run reads besides these
    return args


def probe(tag: str, config: dict, args: argparse.Namespace) -> tuple[dict | None, str | None]:
    """The engine's facts under ``config`` (:mod:`benchmarks.study_jobs_probe`; reused from ``probes/<tag>.json`` when
    made with the same config, unless ``--fresh``): ``(facts, None)``, or ``(None, the error)`` where the launch
    failed."""
    path = args.out_dir / "probes" / f"{tag}.json"
    if not args.fresh and path.exists():
        kept = json.loads(path.read_text())
        if kept["config"] == config:
            return kept["facts"], kept["error"]
    config_path = args.out_dir / "configs" / f"{tag}_probe.json"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    port = free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port), "--module",
           "benchmarks.study_jobs_probe", "--deepspeed_config", str(config_path)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    remove_shm_buffers(port)
    log = args.out_dir / "logs" / f"{tag}_probe.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(result.stdout + result.stderr)
    lines = [line for line in result.stdout.splitlines() if line.startswith(FACTS_PREFIX)]
    if result.returncode == 0 and lines:
        facts, error = json.loads(lines[-1][len(FACTS_PREFIX):]), None
    else:
        facts = None
        error = error_message(result.stdout + result.stderr) or f"exit code {result.returncode} (log: {log})"
    path.parent.mkdir(parents=True, exist_ok=True)  # a fresh --out-dir has no probes/ yet
    path.write_text(json.dumps({"config": config, "facts": facts, "error": error}, indent=2) + "\n")
    return facts, error


def prebuild_host_ops() -> None:
    """Build (or find built) DeepSpeed's ``HOST_OPS`` in this environment's extension folder, in one process."""
    code = ("from deepspeed.accelerator import get_accelerator\n"
            f"for name in {HOST_OPS!r}:\n    get_accelerator().create_op_builder(name).load()")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)


def train(tag: str, config: dict, steps: int, args: argparse.Namespace) -> tuple[dict | None, str | None]:
    """``(summary, None)`` of ``config`` trained for ``steps`` by :func:`benchmarks.study_convergence.run`, or
    ``(None, the error)``."""
    port = free_port()
    try:
        return sc.run(tag, None, steps, args, port=port, base=config), None
    except RuntimeError as exc:
        log = args.out_dir / "logs" / f"{tag}_{steps}.log"
        return None, (error_message(log.read_text()) if log.exists() else None) or str(exc)
    finally:
        remove_shm_buffers(port)


def sweep(feature: Feature, stock_base: dict, method_base: dict, args: argparse.Namespace) -> tuple[float, list]:
    """Stock + ``feature`` at each of its ``lrs`` for ``--sweep-steps``: (the lr of the lowest validation loss, the
    rows). Where every candidate fails, the feature's own lr."""
    rows, name = [], feature.sweep_as or feature.name
    for lr in feature.lrs:
        stock, _ = feature_configs(with_lr(feature, lr), stock_base, method_base)
        summary, error = train(f"{name}_lr{lr:g}_stock", stock, args.sweep_steps, args)
        rows.append({"feature": name, "lr": lr, "steps": args.sweep_steps, "error": error,
                     "val_loss": None if summary is None else summary["final_val_loss"]})
        print(f"  sweep {feature.name} lr {lr:g}: " + (error or f"val {summary['final_val_loss']:.4f}"), flush=True)
    done = [r for r in rows if r["val_loss"] is not None]
    lr = min(done, key=lambda r: r["val_loss"])["lr"] if done else feature.edit["optimizer"]["params"]["lr"]
    return lr, rows


def run_feature(feature: Feature, stock_base: dict, method_base: dict, args: argparse.Namespace, done: dict) -> dict:
    """Probe, check and train both runs of ``feature``; ``done`` (config JSON -> (summary, error, facts)) lets a config
    met before (the main job's stock under ``policy_auto``) reuse its run. Returns the feature's row."""
    out = {"feature": feature.name, "label": feature.label, "edit": feature.edit, "method_edit": feature.method_edit,
           "note": feature.note}
    for side, config, expect in zip(("stock", "method"), feature_configs(feature, stock_base, method_base),
                                    (feature.expect, dict(feature.expect, **feature.expect_method))):
        key = json.dumps(config, sort_keys=True)
        if key not in done:
            tag = f"{feature.name}_{side}"
            facts, error = probe(tag, config, args)
            missing = check_facts(facts, expect, side == "method") if facts else []
            summary = None
            if facts and missing:
                error = "not active: " + "; ".join(missing)
            elif facts and not args.probe_only:
                summary, error = train(tag, config, args.steps, args)
            done[key] = (summary, error, facts)
            if error or args.probe_only:
                print(f"  {tag}: {error or 'active: ' + evidence({'facts': facts, 'expect': expect})}", flush=True)
        summary, error, facts = done[key]
        out[side] = {"config": config, "facts": facts, "error": error, "expect": expect,
                     "val_loss": None if summary is None else summary["final_val_loss"],
                     "train_loss": None if summary is None else summary["final_train_loss"],
                     "compression_ratio": None if summary is None else summary["compression_ratio"],
                     "skipped_steps": None if summary is None else summary["skipped_steps"],
                     "wall_s": None if summary is None else summary["wall_s"],
                     "dgc_stats": None if summary is None else {k: summary["dgc_stats"][k] for k in (
                         "host_state_bytes", "device_state_bytes", "stock_buckets_total", "policy")
                         if k in (summary["dgc_stats"] or {})}}
    s, m = out["stock"], out["method"]
    out["gap_pct"] = (None if s["val_loss"] is None or m["val_loss"] is None
                      else 100.0 * (m["val_loss"] - s["val_loss"]) / s["val_loss"])
    return out


def evidence(side: dict) -> str:
    """What the probe found of what was expected, and what the run itself showed (skipped steps under fp16, the
    momentum on the host, buckets sent by stock's collective)."""
    if side["facts"] is None:
        return ""
    items = [f"{k}={fact(side['facts'], k)}" for k in side["expect"]]
    stats = side.get("dgc_stats") or {}
    if side.get("skipped_steps"):
        items.append(f"{side['skipped_steps']} skipped steps")
    if stats.get("host_state_bytes"):
        items.append(f"momentum on the host ({stats['host_state_bytes']:,} B)")
    if stats.get("policy"):
        items.append(f"{stats['stock_buckets_total']} buckets by stock")
    return ", ".join(items)


def markdown(rows: list[dict], sweeps: list[dict], meta: dict) -> str:
    """The results page: command, date, machine, then one row per feature and the lr sweeps."""
    lines = [f"Command: `{meta['command']}`", "",
             f"{meta['date']}, {meta['machine']}, commit {meta['commit']}; main job (`examples/train_char_gpt.py`, "
             f"char GPT, 818,241 parameters), 2 ranks, seed {meta['seed']}, {meta['steps']} steps; stock = "
             "`configs/zero3_baseline.json`, method = `configs/zero3_dgc_adam.json` (decoupled momentum, DCT top-2 of "
             "64, INT2, int8 momentum), each with the feature's edit. Loss: validation loss after the last step; "
             "gap = method against stock with the same feature; ratio: the method's gradient bytes against fp32 "
             f"reduce-scatter's. {meta['elapsed_s'] / 60:.0f} min in all.", "",
             "| feature | edit (both runs) | method's run also | checked in the run (stock / method) | stock loss "
             "| method loss | gap | ratio | s per run (stock / method) |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        s, m = r["stock"], r["method"]
        cells = [r["label"] + (f" ({r['note']})" if r["note"] else ""), edit_text(r["edit"]),
                 edit_text(r["method_edit"]),
                 " / ".join(evidence(x) or "-" for x in (s, m))]
        for x in (s, m):
            cells.append(f"{x['val_loss']:.4f}" if x["val_loss"] is not None else
                         x["error"] if x["error"].startswith("not active") else f"refused: {x['error']}")
        cells.append("" if r["gap_pct"] is None else f"{r['gap_pct']:+.2f}%")
        cells.append("" if m["compression_ratio"] is None else f"{m['compression_ratio']:.1f}x")
        cells.append(" / ".join("-" if x["wall_s"] is None else f"{x['wall_s']:.0f}" for x in (s, m)))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if sweeps:
        lines += ["", f"Stock learning rates tried first ({sweeps[0]['steps']} steps; the lowest validation loss "
                  "gives the feature's lr):", "", "| feature | lr | val loss |", "|---|---:|---:|"]
        lines += [f"| {w['feature']} | {w['lr']:g} | " + (f"{w['val_loss']:.4f}" if w["val_loss"] is not None
                                                           else f"failed: {w['error']}") + " |" for w in sweeps]
    return "\n".join(lines) + "\n"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else the architecture."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                platform.machine())


def git_commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "deepspeed_dgc"], cwd=ROOT, capture_output=True,
                           text=True).stdout
    return head.strip() + (" (deepspeed_dgc/ with uncommitted changes)" if dirty.strip() else "")


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(launch_env())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    prebuild_host_ops()
    stock_base, method_base = (json.loads(p.read_text()) for p in (STOCK_CONFIG, METHOD_CONFIG))
    rows, sweeps, done = [], [], {}
    for feature in FEATURES:
        if args.only and feature.name not in args.only:
            continue
        if feature.lrs:
            if feature.name in args.lr:
                lr = args.lr[feature.name]
            elif args.sweep_steps and not args.probe_only:
                lr, tried = sweep(feature, stock_base, method_base, args)
                sweeps += [r for r in tried if r not in sweeps]
            else:
                lr = feature.edit["optimizer"]["params"]["lr"]
            feature = with_lr(feature, lr)
        rows.append(run_feature(feature, stock_base, method_base, args, done))
        for name, lr in args.extra_lr:
            if name == feature.name:
                extra = replace(with_lr(feature, lr), name=f"{name}_lr{lr:g}", label=f"{feature.label}, lr {lr:g}")
                rows.append(run_feature(extra, stock_base, method_base, args, done))
    if args.probe_only:
        return 0
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime(started)), "seed": args.seed, "steps": args.steps,
            "machine": f"{os.cpu_count()} CPU cores ({cpu_model()}), gloo, no GPU",
            "commit": git_commit(), "elapsed_s": time.time() - started,
            "command": " ".join(["python", "-m", "benchmarks.study_jobs"] + list(argv if argv is not None
                                                                                  else sys.argv[1:]))}
    table = markdown(rows, sweeps, meta)
    texts = {".md": table, ".json": json.dumps({"meta": meta, "rows": rows, "sweeps": sweeps}, indent=2) + "\n"}
    for folder in filter(None, (args.out_dir, args.results)):
        folder.mkdir(parents=True, exist_ok=True)
        for suffix, text in texts.items():
            (folder / "study_jobs").with_suffix(suffix).write_text(text)
    print("\n" + table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
