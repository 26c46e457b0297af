"""Soak of the main job (issue 52, item 6): the char GPT of ``examples/train_char_gpt.py`` on 2 CPU ranks for many
steps with a checkpoint every ``--checkpoint-every`` steps, run twice:

- interrupted: every ``--resume-every`` steps (once step K's checkpoint is written and step K + 1 has ended) the
  harness SIGKILLs both rank processes in the middle of step K + 2, checks that the launcher exits non-zero and that
  the checkpoint directory's ``latest`` names step K, and starts the job again with ``--resume-from``;
- uninterrupted: the same steps in one launch, with the same checkpoints (the same I/O).

Every rank appends one JSON line per step (``--step-log``: the mean train loss, its resident memory (VmRSS) and the
extension's state bytes, ``deepspeed_dgc.get_stats(engine).state_bytes``). The summary: the largest |loss difference|
between the runs at any step (a resume is meant to be bit-identical: 0 expected), the growth of each rank's resident
memory within each launch (segment) after its warm-up (the first ``--warmup`` steps of the segment) and across
segments, whether the state bytes changed after warm-up, and the time taken. Writes ``--json`` and ``--plot``.

    python -m benchmarks.soak                     # 3000 steps, checkpoint every 100, kill and resume every 500
    python -m benchmarks.soak --steps 60 --checkpoint-every 10 --resume-every 30 --warmup 10 --json ... --plot ...
"""

import argparse
import glob
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = ROOT / "examples" / "train_char_gpt.py"
DEFAULT_CONFIG = "configs/zero3_dgc_adam.json"
WORLD = 2
MIB = 1024 * 1024


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remove_shm_buffers(port: int) -> int:
    """Delete DeepSpeed's ``/dev/shm/deepspeed_allreduce_buffer_*`` files of the job on ``port`` (DeepSpeed never
    unlinks them, and killed ranks cannot); returns how many were deleted."""
    removed = 0
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def launch_env(extra=()) -> dict:
    """The environment of a launch: this Python's bin first on PATH (its ninja) and the checkout's build of DeepSpeed's
    CPU comm op (``build/torch_extensions``, as the tests use: another directory rebuilds it, about 30 s), plus the
    ``KEY=VALUE`` items of ``extra`` (``--env``)."""
    env = dict(os.environ,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               TORCH_EXTENSIONS_DIR=str(ROOT / "build" / "torch_extensions"))
    env.update(item.split("=", 1) for item in extra)
    return env


def job_command(opts: argparse.Namespace, port: int, save_dir: Path, step_log: Path, summary: Path,
                resume: bool) -> list:
    """The deepspeed launcher's command line of one launch of the main job."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(WORLD), "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(TRAIN_SCRIPT), "--deepspeed_config", opts.config,
           "--max-steps", str(opts.steps), "--seed", str(opts.seed), "--eval-interval", str(opts.eval_interval),
           "--save-dir", str(save_dir), "--save-interval", str(opts.checkpoint_every),
           "--step-log", str(step_log), "--summary-json", str(summary),
           "--n-layer", str(opts.n_layer), "--n-embd", str(opts.n_embd)]
    if resume:
        cmd += ["--resume-from", str(save_dir)]
    return cmd


class StepLogReader:
    """Reads the new whole lines of the per-rank step logs (``PREFIX.rankR.jsonl``) as they grow."""

    def __init__(self, prefix: Path):
        self.paths = [Path(f"{prefix}.rank{r}.jsonl") for r in range(WORLD)]
        self.offsets = [p.stat().st_size if p.exists() else 0 for p in self.paths]

    def poll(self) -> list:
        """The records written since the last call (a line not yet ended is left for the next call)."""
        records = []
        for r, path in enumerate(self.paths):
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self.offsets[r])
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offsets[r] += end
            records += [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        return records


def latest_tag(save_dir: Path) -> str | None:
    """The tag the checkpoint directory's ``latest`` names, or None."""
    try:
        return (save_dir / "latest").read_text().strip()
    except FileNotFoundError:
        return None


def run_job(opts: argparse.Namespace, name: str, kill_after: list, rng: random.Random) -> dict:
    """Run the main job for ``opts.steps`` steps, killing both ranks once per step K of ``kill_after`` (mid-step K + 2,
    after step K's checkpoint) and resuming from the checkpoint each time.

    Returns the job's record: ``segments`` (one per launch: first step, last logged step, launcher exit code, wall
    time, the step after which it was killed or None), ``records`` (every step record of every rank, with the index of
    the segment that wrote it) and ``wall_s``.

    Raises RuntimeError when a launch fails, hangs, is not killed in time, or its checkpoint is not the expected one.
    """
    job_dir = opts.out_dir / name
    shutil.rmtree(job_dir, ignore_errors=True)
    job_dir.mkdir(parents=True)
    save_dir, step_log = job_dir / "ckpt", job_dir / "steps"
    pending = sorted(kill_after)
    segments, records = [], []
    job_start = time.time()
    while True:
        index = len(segments)
        port = free_port()
        summary = job_dir / f"summary_{index}.json"
        cmd = job_command(opts, port, save_dir, step_log, summary, resume=index > 0)
        reader = StepLogReader(step_log)
        seg = {"index": index, "first_step": None, "last_step": None, "killed_after_step": None,
               "kill_target": pending[0] if pending else None, "launcher_rc": None, "pids": {}}
        seg_records = []
        start = time.time()
        with open(job_dir / f"launch_{index}.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(opts.env), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                killed = False
                while proc.poll() is None:
                    if time.time() - start > opts.launch_timeout_s:
                        raise RuntimeError(f"{name} launch {index}: still running after {opts.launch_timeout_s} s")
                    new = reader.poll()
                    seg_records += new
                    target = seg["kill_target"]
                    if target is not None and not killed and new:
                        done = {r: max((x["step"] for x in seg_records if x["rank"] == r), default=0)
                                for r in range(WORLD)}
                        if min(done.values()) >= target + 1:
                            if latest_tag(save_dir) != f"global_step{target}":
                                raise RuntimeError(f"{name}: step {target + 1} ended but 'latest' is "
                                                   f"{latest_tag(save_dir)!r}, not global_step{target}")
                            times = sorted(x["time"] for x in seg_records if x["rank"] == 0)[-6:]
                            step_s = statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 2 \
                                else 0.2
                            time.sleep(rng.uniform(0.2, 0.8) * step_s)  # into step target + 2
                            pids = {x["rank"]: x["pid"] for x in seg_records}
                            for pid in pids.values():
                                try:
                                    os.kill(pid, signal.SIGKILL)
                                except ProcessLookupError:
                                    pass
                            killed = True
                            seg["pids"] = pids
                            seg["kill_time"] = time.time()
                    time.sleep(0.02)
                seg["launcher_rc"] = proc.wait()
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                seg["shm_buffers_removed"] = remove_shm_buffers(port)
        seg_records += reader.poll()
        seg["wall_s"] = time.time() - start
        for x in seg_records:
            x["segment"] = index
        records += seg_records
        steps = [x["step"] for x in seg_records if x["rank"] == 0]
        seg["first_step"], seg["last_step"] = (min(steps), max(steps)) if steps else (None, None)
        seg["pids"] = seg["pids"] or {x["rank"]: x["pid"] for x in seg_records}
        segments.append(seg)
        tail = (job_dir / f"launch_{index}.log").read_text()[-3000:]
        if seg["kill_target"] is not None:
            if not killed:
                raise RuntimeError(f"{name} launch {index} ended (rc {seg['launcher_rc']}) before the kill after step "
                                   f"{seg['kill_target'] + 1}:\n{tail}")
            if seg["launcher_rc"] == 0:
                raise RuntimeError(f"{name} launch {index}: ranks killed but the launcher exited 0")
            seg["killed_after_step"] = seg["last_step"]
            if latest_tag(save_dir) != f"global_step{seg['kill_target']}":
                raise RuntimeError(f"{name}: after the kill 'latest' is {latest_tag(save_dir)!r}")
            print(f"  {name} segment {index}: steps {seg['first_step']}-{seg['last_step']}, killed mid-step "
                  f"{seg['last_step'] + 1}, launcher exit {seg['launcher_rc']}, {seg['wall_s']:.0f} s", flush=True)
            pending.pop(0)
            continue
        if seg["launcher_rc"] != 0:
            raise RuntimeError(f"{name} launch {index} exited {seg['launcher_rc']}:\n{tail}")
        print(f"  {name} segment {index}: steps {seg['first_step']}-{seg['last_step']}, exit 0, "
              f"{seg['wall_s']:.0f} s", flush=True)
        break
    final_summary = json.loads(summary.read_text())
    if not opts.keep_checkpoints:
        shutil.rmtree(save_dir, ignore_errors=True)
    return {"segments": segments, "records": records, "wall_s": time.time() - job_start,
            "val_losses": final_summary["val_losses"], "final_val_loss": final_summary["final_val_loss"],
            "n_params": final_summary["n_params"]}


def final_series(records: list, steps: int) -> dict:
    """Per step 1..steps and rank: the record of the last segment that logged it (the one the run went on from).

    Returns ``{"loss": [...], "rss_bytes": [[rank 0...], [rank 1...]], "state_bytes": [[...], [...]],
    "segment": [...]}``, each list indexed by step - 1.
    """
    last = {}
    for x in records:
        key = (x["step"], x["rank"])
        if key not in last or x["segment"] >= last[key]["segment"]:
            last[key] = x
    missing = [s for s in range(1, steps + 1) for r in range(WORLD) if (s, r) not in last]
    if missing:
        raise RuntimeError(f"no record of step(s) {missing[:5]}...")
    return {"loss": [last[(s, 0)]["loss"] for s in range(1, steps + 1)],
            "rss_bytes": [[last[(s, r)]["rss_bytes"] for s in range(1, steps + 1)] for r in range(WORLD)],
            "state_bytes": [[last[(s, r)]["state_bytes"] for s in range(1, steps + 1)] for r in range(WORLD)],
            "segment": [last[(s, 0)]["segment"] for s in range(1, steps + 1)]}


def memory_growth(job: dict, warmup: int) -> list:
    """Per segment and rank: resident memory at the end of the segment's warm-up (its ``warmup``-th step), its largest
    and last value after that, the growth of each against the warm-up value (percent), and the state bytes' range
    after warm-up. A segment of ``warmup`` steps or fewer gets None growths."""
    out = []
    for seg in job["segments"]:
        for r in range(WORLD):
            rows = sorted((x for x in job["records"] if x["segment"] == seg["index"] and x["rank"] == r),
                          key=lambda x: x["step"])
            after = rows[warmup - 1:] if len(rows) > warmup else []
            entry = {"segment": seg["index"], "rank": r, "first_step": rows[0]["step"] if rows else None,
                     "last_step": rows[-1]["step"] if rows else None, "warmup_step": None, "rss_at_warmup": None,
                     "rss_max_after": None, "rss_last": None, "max_growth_pct": None, "last_growth_pct": None,
                     "state_bytes_min": None, "state_bytes_max": None}
            if after:
                base = after[0]["rss_bytes"]
                rss_max = max(x["rss_bytes"] for x in after)
                states = [x["state_bytes"] for x in after]
                entry.update(warmup_step=after[0]["step"], rss_at_warmup=base, rss_max_after=rss_max,
                             rss_last=after[-1]["rss_bytes"], max_growth_pct=100.0 * (rss_max - base) / base,
                             last_growth_pct=100.0 * (after[-1]["rss_bytes"] - base) / base,
                             state_bytes_min=min(states), state_bytes_max=max(states))
            out.append(entry)
    return out


def analyse(interrupted: dict, uninterrupted: dict, opts: argparse.Namespace) -> dict:
    """The soak's findings from the two jobs (see the module docstring)."""
    a, b = final_series(interrupted["records"], opts.steps), final_series(uninterrupted["records"], opts.steps)
    diffs = [abs(x - y) for x, y in zip(a["loss"], b["loss"])]
    # steps a killed segment ran past its checkpoint ran twice: the replay must give the same loss as the first time
    by_step = {}
    for x in interrupted["records"]:
        if x["rank"] == 0:
            by_step.setdefault(x["step"], []).append(x["loss"])
    replayed = sorted(s for s, losses in by_step.items() if len(losses) > 1)
    replay_mismatch = [s for s in replayed if len(set(by_step[s])) > 1]
    growth = {"interrupted": memory_growth(interrupted, opts.warmup),
              "uninterrupted": memory_growth(uninterrupted, opts.warmup)}
    measured = [g for job in growth.values() for g in job if g["max_growth_pct"] is not None]
    # across segments: each segment's resident memory at its warm-up step against the first segment's (same rank)
    first = {g["rank"]: g["rss_at_warmup"] for g in growth["interrupted"] if g["segment"] == 0}
    across = [{"segment": g["segment"], "rank": g["rank"],
               "pct_vs_segment_0": 100.0 * (g["rss_at_warmup"] - first[g["rank"]]) / first[g["rank"]]}
              for g in growth["interrupted"] if g["rss_at_warmup"] is not None and first.get(g["rank"])]
    states_after = [s for job in (a, b) for rank in job["state_bytes"] for s in rank[opts.warmup - 1:]]
    return {
        "steps_compared": opts.steps,
        "max_abs_loss_diff": max(diffs),
        "steps_with_loss_diff": sum(1 for d in diffs if d != 0),
        "first_step_with_loss_diff": next((i + 1 for i, d in enumerate(diffs) if d != 0), None),
        "val_losses_equal": interrupted["val_losses"] == uninterrupted["val_losses"],
        "final_val_loss": {"interrupted": interrupted["final_val_loss"],
                           "uninterrupted": uninterrupted["final_val_loss"]},
        "replayed_steps": replayed,
        "replayed_steps_with_other_loss": replay_mismatch,
        "memory_growth": growth,
        "max_growth_pct_after_warmup": max((g["max_growth_pct"] for g in measured), default=None),
        "rss_across_segments": across,
        "max_abs_pct_across_segments": max((abs(x["pct_vs_segment_0"]) for x in across), default=None),
        "state_bytes_after_warmup": sorted(set(states_after)),
        "state_bytes_constant": len(set(states_after)) == 1,
        "kills": [s["killed_after_step"] for s in interrupted["segments"] if s["killed_after_step"] is not None],
        "launcher_rc_after_kill": [s["launcher_rc"] for s in interrupted["segments"]
                                   if s["killed_after_step"] is not None],
        "uninterrupted_growth_from_step": growth_from_steps(b, opts),
        "wall_s": {"interrupted": interrupted["wall_s"], "uninterrupted": uninterrupted["wall_s"]},
    }, a, b


def growth_from_steps(series: dict, opts: argparse.Namespace) -> dict:
    """Whether one launch's memory levels off: per rank, the largest growth (percent) of its resident memory after step
    S against its value at step S, for S at every ``--resume-every`` steps from the warm-up on (the uninterrupted
    run's series, :func:`final_series`). Returns ``{S: [rank 0 %, rank 1 %]}``."""
    out = {}
    for s in [opts.warmup] + list(range(opts.resume_every, opts.steps, opts.resume_every)):
        out[s] = [100.0 * (max(rss[s - 1:]) - rss[s - 1]) / rss[s - 1] for rss in series["rss_bytes"]]
    return out


def plot(path: Path, a: dict, b: dict, interrupted: dict, opts: argparse.Namespace, found: dict) -> None:
    """Loss of both runs, and each rank's resident memory and the extension's state bytes, against the step; kills
    as red dashed lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, opts.steps + 1))
    kills = [s["killed_after_step"] + 1 for s in interrupted["segments"] if s["killed_after_step"] is not None]
    fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    ax = axes[0]
    ax.plot(steps, b["loss"], color="tab:blue", lw=1.6, label="uninterrupted")
    ax.plot(steps, a["loss"], color="tab:orange", lw=0.8, ls="--", label="killed and resumed")
    ax.set_ylabel("train loss (mean of ranks)")
    ax.set_title(f"Soak: {opts.steps} steps, checkpoint every {opts.checkpoint_every}, SIGKILL + resume every "
                 f"{opts.resume_every} ({opts.config}, {WORLD} CPU ranks); max |loss diff| = "
                 f"{found['max_abs_loss_diff']:g}", fontsize=10)
    ax.legend()
    ax = axes[1]
    for r, color in zip(range(WORLD), ("tab:blue", "tab:green")):
        ax.plot(steps, [v / MIB for v in b["rss_bytes"][r]], color=color, lw=1.4, label=f"rank {r}, uninterrupted")
        for seg in interrupted["segments"]:  # each launch apart: a killed one's last steps ran again after it
            rows = sorted((x["step"], x["rss_bytes"]) for x in interrupted["records"]
                          if x["rank"] == r and x["segment"] == seg["index"])
            ax.plot([x for x, _ in rows], [v / MIB for _, v in rows], color=color, lw=0.9, ls="--", alpha=0.8,
                    label=f"rank {r}, killed and resumed" if seg["index"] == 0 else None)
    ax.set_ylabel("resident memory (MiB)")
    ax.legend(fontsize=8, ncol=2)
    ax = axes[2]
    for r, color in zip(range(WORLD), ("tab:blue", "tab:green")):
        ax.plot(steps, [v / MIB for v in b["state_bytes"][r]], color=color, lw=1.4, label=f"rank {r}, uninterrupted")
        ax.plot(steps, [v / MIB for v in a["state_bytes"][r]], color=color, lw=0.9, ls="--",
                label=f"rank {r}, killed and resumed")
    ax.set_ylabel("extension state (MiB)")
    ax.set_xlabel("step")
    ax.legend(fontsize=8, ncol=2)
    starts = [1] + [s["first_step"] for s in interrupted["segments"][1:]]
    for ax in axes:
        for first in starts:  # each launch's warm-up (the uninterrupted run's is the first)
            ax.axvspan(first, first + opts.warmup - 1, color="0.9", zorder=0)
        for i, k in enumerate(kills):
            ax.axvline(k, color="red", ls=":", lw=1, label="SIGKILL" if i == 0 and ax is axes[0] else None)
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    """The soak's options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--resume-every", type=int, default=500, help="kill and resume after each multiple of this")
    p.add_argument("--warmup", type=int, default=200,
                   help="steps of each launch (segment) before its memory counts: growth is measured from the "
                   "segment's warmup-th step")
    p.add_argument("--eval-interval", type=int, help="validation every this many steps (default: --checkpoint-every)")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--seed", type=int, default=1234, help="the training seed; also seeds the kills' moments")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "soak", help="checkpoints, step logs, launch logs")
    p.add_argument("--json", type=Path, default=ROOT / "results" / "soak.json")
    p.add_argument("--plot", type=Path, default=ROOT / "results" / "soak.png")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set this variable for the launches (repeatable), e.g. MALLOC_MMAP_THRESHOLD_=131072")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the checkpoints (removed after each job)")
    p.add_argument("--launch-timeout-s", type=float, default=3600.0, help="limit of one launch")
    opts = p.parse_args(argv)
    if any("=" not in item for item in opts.env):
        p.error("--env expects KEY=VALUE")
    opts.eval_interval = opts.eval_interval or opts.checkpoint_every
    if opts.resume_every % opts.checkpoint_every:
        p.error("--resume-every must be a multiple of --checkpoint-every (a kill follows a checkpoint)")
    if not 1 <= opts.warmup < opts.resume_every:
        p.error("--warmup must be >= 1 and below --resume-every")
    if opts.steps < opts.resume_every + 2:
        p.error("--steps must be at least --resume-every + 2 (a kill lands in step K + 2)")
    return opts


def run_soak(opts: argparse.Namespace) -> dict:
    """Run both jobs, analyse them, write ``opts.json`` and ``opts.plot`` (each unless None); returns the result."""
    rng = random.Random(opts.seed)
    kill_after = list(range(opts.resume_every, opts.steps - 1, opts.resume_every))
    start = time.time()
    print(f"soak: {opts.steps} steps, checkpoint every {opts.checkpoint_every}, kill + resume after steps "
          f"{kill_after}; {opts.config}, {opts.n_layer} layers; launch env {opts.env}", flush=True)
    interrupted = run_job(opts, "interrupted", kill_after, rng)
    uninterrupted = run_job(opts, "uninterrupted", [], rng)
    found, a, b = analyse(interrupted, uninterrupted, opts)
    found["total_wall_s"] = time.time() - start
    result = {
        "command": getattr(opts, "command", None),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items() if k != "command"},
        "n_params": interrupted["n_params"],
        "summary": found,
        "segments": {"interrupted": interrupted["segments"], "uninterrupted": uninterrupted["segments"]},
        "series": {"interrupted": a, "uninterrupted": b},
        "val_losses": {"interrupted": interrupted["val_losses"], "uninterrupted": uninterrupted["val_losses"]},
    }
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(result) + "\n")
    if opts.plot:
        plot(opts.plot, a, b, interrupted, opts, found)
    return result


def print_summary(result: dict) -> None:
    """The soak's findings, readable."""
    s, o = result["summary"], result["options"]
    print(f"\nsoak of {o['steps']} steps ({result['n_params']:,} parameters, {o['config']}), warm-up: the first "
          f"{o['warmup']} steps of each launch")
    print(f"  SIGKILLs in steps {[k + 1 for k in s['kills']]} (each after the checkpoint of a multiple of "
          f"{o['resume_every']}); the launcher's exit codes {s['launcher_rc_after_kill']}")
    print(f"  max |loss difference|, killed and resumed vs uninterrupted, over {s['steps_compared']} steps: "
          f"{s['max_abs_loss_diff']:g} (steps that differ: {s['steps_with_loss_diff']}); val losses equal: "
          f"{s['val_losses_equal']}; replayed steps {s['replayed_steps']} with another loss: "
          f"{s['replayed_steps_with_other_loss']}")
    print("  resident memory growth after warm-up, per launch (segment) and rank:")
    print("    job            seg rank  steps        RSS@warm-up  max after   growth(max)  growth(last)  state bytes")
    for job, rows in s["memory_growth"].items():
        for g in rows:
            if g["max_growth_pct"] is None:
                print(f"    {job:<14} {g['segment']:>3} {g['rank']:>4}  {g['first_step']}-{g['last_step']}: "
                      "shorter than the warm-up")
                continue
            print(f"    {job:<14} {g['segment']:>3} {g['rank']:>4}  {g['first_step']:>5}-{g['last_step']:<5}  "
                  f"{g['rss_at_warmup'] / MIB:9.1f} MiB {g['rss_max_after'] / MIB:7.1f} MiB  "
                  f"{g['max_growth_pct']:+9.2f}%  {g['last_growth_pct']:+10.2f}%   "
                  f"{g['state_bytes_min']}..{g['state_bytes_max']}")
    print(f"  largest growth after warm-up: {s['max_growth_pct_after_warmup']:+.2f}%; RSS at warm-up across segments "
          f"vs segment 0: at most {s['max_abs_pct_across_segments']:.2f}% apart")
    print("  uninterrupted run, largest growth after step S against step S: " + ", ".join(
        f"S={k}: " + "/".join(f"{v:+.2f}%" for v in vals) for k, vals in s["uninterrupted_growth_from_step"].items()))
    print(f"  state bytes after warm-up: {s['state_bytes_after_warmup']} (constant: {s['state_bytes_constant']})")
    print(f"  wall: interrupted {s['wall_s']['interrupted']:.0f} s, uninterrupted {s['wall_s']['uninterrupted']:.0f} s, "
          f"total {s['total_wall_s']:.0f} s")


def main(argv=None) -> None:
    """Run the soak from the command line and print its summary."""
    opts = parse_args(argv)
    opts.command = " ".join(["python -m benchmarks.soak", *(sys.argv[1:] if argv is None else argv)])
    print_summary(run_soak(opts))


if __name__ == "__main__":
    main()
