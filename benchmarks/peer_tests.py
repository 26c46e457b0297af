"""DeepSpeed's own ZeRO-3 unit tests with a ``"dgc"`` section injected (``make peer-tests``, issue 51 item 4).

The tests are DeepSpeed's, vendored in ``peer/deepspeed_tests`` (its README says from which commit and what changed);
``peer/deepspeed_tests/selected.txt`` lists the ones that build a ZeRO-3 config (``--discover`` wrote it). Each
section runs them once: ``stock`` (DeepSpeed alone: ``deepspeed_dgc`` is not imported), ``enabled`` (``"dgc":
{"enabled": true}``) and ``recommended`` (the ``"dgc"`` section of ``configs/zero3_dgc_adam.json``); the injection is
``benchmarks.peer_inject``. One pytest process per test file and section, each test under ``--timeout`` seconds: a
test that runs longer is killed (its process group) and the file goes on without it.

The report classifies every test of a section against its stock outcome: ``unchanged`` (the same outcome),
``refused`` (it failed with a ``deepspeed_dgc`` error, ``DGCConfigError`` and the other ``DGC*Error`` types, or was
skipped after ``initialize`` raised one: the message is the reason) or ``failed`` (anything else: an assertion, a
``KeyError``, a timeout, another outcome). Records accumulate in ``--out-dir`` (one JSON per section, by test id), so a
subset (``-k``) or one section at a time updates them and the report covers what has run.

    python -m benchmarks.peer_tests                              # all three sections (about 60 min on 2 cores)
    python -m benchmarks.peer_tests --sections recommended -k test_zero_tensor_fragment
    python -m benchmarks.peer_tests --report-only                # the report from the records in --out-dir
    python -m benchmarks.peer_tests --discover --tests-root DIR  # list the tests of DIR that build a ZeRO-3 config
"""

import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from benchmarks import peer_inject
from benchmarks.peer_inject import DISCOVER, SECTIONS

ROOT = peer_inject.ROOT
VENDORED = ROOT / "peer" / "deepspeed_tests"
SELECTED = VENDORED / "selected.txt"
DISCOVER_DIRS = ("unit/v1/zero", "unit/runtime/zero")
DGC_ERROR_MODULE = "deepspeed_dgc."
CLASSES = ("unchanged", "refused", "failed")
MESSAGE_CHARS = 500  # of an error's message in the committed JSON (runs/peer_tests keeps it whole)
SHM = "/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"


@dataclass
class Setup:
    """Where and how the tests run."""
    tests_root: Path = VENDORED
    out_dir: Path = ROOT / "runs" / "peer_tests"
    timeout: float = 600  # seconds per test
    # DeepSpeed's CPU accelerator counts NUMA nodes as devices (1 here) and DistributedTest skips a test that wants
    # more ranks than devices; LOCAL_SIZE is the count it takes instead (the ranks set their own)
    local_size: int = 4
    dgc_root: Optional[Path] = None  # a folder whose deepspeed_dgc/ the ranks import instead of this checkout's


def read_selected(path: Path = SELECTED) -> list:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def by_file(ids: list) -> dict:
    files = defaultdict(list)
    for nodeid in ids:
        files[nodeid.split("::")[0]].append(nodeid)
    return dict(files)


def pytest_env(section: str, run_dir: Path, setup: Setup) -> dict:
    env = dict(os.environ)
    first = [str(setup.dgc_root)] if setup.dgc_root else []
    env.update({
        "PYTHONPATH": os.pathsep.join(first + [str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]),
        "PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),  # the venv's ninja (Makefile)
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": str(ROOT / "build" / "torch_extensions"),  # DeepSpeed's shm op, built by make install
        "DS_UNITTEST_TIMEOUT": str(int(setup.timeout) + 60),  # DeepSpeed's own hang check after the runner's
        "LOCAL_SIZE": str(setup.local_size),
        peer_inject.SECTION_ENV: section,
        peer_inject.LOG_ENV: str(run_dir / "initialize.jsonl"),
        peer_inject.RESULTS_ENV: str(run_dir / "results.jsonl"),
        peer_inject.PORTS_ENV: str(run_dir / "ports.txt"),
    })
    if peer_inject.dgc_section(section) is None:
        env["DEEPSPEED_DGC_AUTOLOAD"] = "0"  # stock: DeepSpeed alone, deepspeed_dgc's start-up hook off too
    return env


def _read_lines(path: Path, offset: int):
    if not path.exists():
        return [], offset
    with open(path) as f:
        f.seek(offset)
        text = f.read()
    complete = text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()], offset + len(complete)


def remove_shm(ports_file: Path) -> None:
    """Delete DeepSpeed's shared-memory buffers of the ports these tests used (nobody unlinks them)."""
    if not ports_file.exists():
        return
    for port in set(ports_file.read_text().split()):
        for path in glob.glob(SHM.format(port=port)):
            try:
                os.unlink(path)
            except OSError:
                pass


def run_pytest(ids: list, section: str, setup: Setup, log) -> dict:
    """One pytest process over ``ids`` (one file's tests); returns records by test id. A test running past
    ``setup.timeout`` kills the process group; it is recorded as a timeout and the rest of the list runs again."""
    records, remaining, timeout, run_dir = {}, list(ids), setup.timeout, setup.out_dir / "run"
    while remaining:
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in ("results.jsonl", "initialize.jsonl", "ports.txt"):
            (run_dir / name).unlink(missing_ok=True)
        basetemp = tempfile.mkdtemp(prefix="basetemp-", dir=run_dir)
        cmd = [sys.executable, "-m", "pytest", "-p", "benchmarks.peer_inject", "-p", "no:cacheprovider",
               f"--basetemp={basetemp}", *remaining]
        proc = subprocess.Popen(cmd, cwd=setup.tests_root, env=pytest_env(section, run_dir, setup), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        offset, current, hung = 0, None, None
        while True:
            done = proc.poll() is not None
            lines, offset = _read_lines(run_dir / "results.jsonl", offset)
            for line in lines:
                if line["event"] == "start":
                    current = line
                else:
                    current = None
                    line.pop("event")
                    records[line["nodeid"]] = line
            if done:
                break
            if current is not None and time.time() - current["time"] > timeout:
                hung = current["nodeid"]
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.5)
        if current is not None:  # killed by the timeout, or pytest ended inside it (pytest.exit, a crash)
            lines, _ = _read_lines(run_dir / "initialize.jsonl", 0)
            records[current["nodeid"]] = {
                "nodeid": current["nodeid"], "outcome": "failed", "when": "call",
                "duration": round(time.time() - current["time"], 2), "injections": lines,
                "error": {"type": "timeout" if hung else "crash",
                          "message": f"killed after {timeout:.0f} s" if hung else
                          f"pytest exited with code {proc.returncode} inside the test"}}
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # ranks left behind by a crash
        except ProcessLookupError:
            pass
        remove_shm(run_dir / "ports.txt")
        shutil.rmtree(basetemp, ignore_errors=True)
        started = [nodeid for nodeid in remaining if nodeid in records]
        if not started:  # pytest ran none of them (a collection error): say so for each, once
            for nodeid in remaining:
                records[nodeid] = {"nodeid": nodeid, "outcome": "failed", "when": "collect", "duration": 0,
                                   "injections": [], "error": {"type": "collection",
                                                               "message": f"pytest exited with code "
                                                               f"{proc.returncode} before running it"}}
        remaining = [nodeid for nodeid in remaining if nodeid not in records]
    return records


def run_section(section: str, ids: list, setup: Setup) -> dict:
    """Every test of ``ids`` under ``section``; returns records by test id and writes them to
    ``<out_dir>/<section>.json`` as they come (merged with the records of earlier runs)."""
    store = setup.out_dir / f"{section}.json"
    records = json.loads(store.read_text()) if store.exists() else {}
    log_path = setup.out_dir / f"{section}.log"
    started = time.time()
    with open(log_path, "a") as log:
        for number, (path, file_ids) in enumerate(by_file(ids).items(), 1):
            t0 = time.time()
            got = run_pytest(file_ids, section, setup, log)
            records.update(got)
            store.write_text(json.dumps(records, indent=1, sort_keys=True))
            tally = Counter(r["outcome"] for r in got.values())
            print(f"[{section}] {number}/{len(by_file(ids))} {path}: {dict(tally)} in {time.time() - t0:.0f} s",
                  flush=True)
    print(f"[{section}] {len(ids)} tests in {time.time() - started:.0f} s (log: {log_path})", flush=True)
    return records


# ---- classification and report --------------------------------------------------------------------------------------


def first_line(text) -> str:
    lines = [line for line in str(text or "").splitlines() if line.strip()]
    return lines[0].strip() if lines else ""


def said(t: dict) -> str:
    """The first line of an error's message, or where it was raised when it has none (a bare ``assert``)."""
    return first_line(t.get("message")) or (f"(no message) at {t['where']}" if t.get("where") else "")


def dgc_refusal(record: dict):
    """The deepspeed_dgc error that refused this test, if one did: the test's own exception, or (a test that skips
    when ``initialize`` raises) the error the injection wrapper saw ``initialize`` raise."""
    error = record.get("error") or {}
    if record["outcome"] == "failed" and str(error.get("type")).startswith(DGC_ERROR_MODULE):
        return error
    if record["outcome"] in ("failed", "skipped"):
        for call in record.get("injections", []):
            if str(call.get("error", {}).get("type")).startswith(DGC_ERROR_MODULE):
                return call["error"]
    return None


def classify(stock: dict, record: dict) -> dict:
    """``unchanged``, ``refused`` or ``failed`` for one test's record under a section against its stock record."""
    refusal = dgc_refusal(record)
    if refusal is not None:
        return {"class": "refused", "type": refusal["type"], "message": refusal["message"]}
    if stock is not None and record["outcome"] == stock["outcome"]:
        error, stock_error = record.get("error") or {}, stock.get("error") or {}
        if record["outcome"] == "failed" and error.get("type") != stock_error.get("type"):
            return {"class": "unchanged", "note": "fails as stock does, with another error",
                    "type": error.get("type"), "message": error.get("message"), "where": error.get("where")}
        return {"class": "unchanged"}
    error = record.get("error") or {}
    detail = {"class": "failed", "outcome": record["outcome"],
              "stock_outcome": stock["outcome"] if stock else None}
    if record["outcome"] == "failed":
        detail.update(type=error.get("type"), message=error.get("message"), where=error.get("where"))
    elif record["outcome"] == "skipped":
        detail.update(type="skipped", message=record.get("skip_reason"))
    else:
        detail.update(type="passed", message=f"stock {stock['outcome'] if stock else 'has no record'}")
    return detail


def build_report(results: dict, ids: list) -> dict:
    """``results``: records by section and test id. Per section: each test's class and the counts."""
    stock = results.get("stock", {})
    sections = {}
    for section, records in results.items():
        if section == "stock":
            continue
        tests = {nodeid: classify(stock.get(nodeid), records[nodeid]) for nodeid in ids if nodeid in records}
        counts = Counter(t["class"] for t in tests.values())
        sections[section] = {"counts": {c: counts.get(c, 0) for c in CLASSES}, "tests": tests}
    stock_counts = Counter(stock[nodeid]["outcome"] for nodeid in ids if nodeid in stock)
    return {"tests": len(ids), "stock": dict(stock_counts), "sections": sections}


def _cell(text, width=300) -> str:
    text = " ".join(str(text or "").split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 1] + "…"


def _minutes(seconds) -> str:
    return f"{seconds / 60:.0f} min" if seconds is not None else ""


def _rows(tests: dict, ids: list, cls: str, stock: dict, whole: bool, each: bool = True) -> list:
    """The tests of class ``cls``: their errors grouped (how many of each; ``whole``: the whole message), then (``each``)
    one row per test."""
    rows = [(nodeid, tests[nodeid]) for nodeid in ids if tests.get(nodeid, {}).get("class") == cls]
    kinds, example = Counter(), {}
    for _, t in rows:  # grouped by type and first line, its numbers aside
        key = (t.get("type"), re.sub(r"\d+", "N", said(t)))
        kinds[key] += 1
        example.setdefault(key, t.get("message") if whole else said(t))
    out = [f"| tests | error | message ({'whole' if whole else 'first line'}; the first test's where numbers differ) |",
           "| --- | --- | --- |"]
    out += [f"| {n} | `{key[0]}` | {_cell(example[key], 1000)} |" for key, n in kinds.most_common()]
    if not each:
        return out
    out += ["", "| test | stock | error | message (first line) |", "| --- | --- | --- | --- |"]
    out += [f"| `{nodeid}` | {stock.get(nodeid, {}).get('outcome', 'no record')} | `{t.get('type')}` | "
            f"{_cell(said(t), 160)} |" for nodeid, t in rows]
    return out


# why the failures seen so far fail, by the part of the test id that has them (shown under a section's failures)
WHY_FAILED = {
    "test_coalesce_issues_fewer_collectives": (
        "it counts DeepSpeed's collectives (`all_reduce`, `reduce`, `reduce_scatter_fn`) issued during the backward "
        "passes of 4 micro-steps, once with the gradients reduced every micro-step and once coalesced "
        "(`engine.coalesce_grad_reduction()`), and asserts fewer when coalesced. Under the extension there is no "
        "reduction per micro-step to save: the micro-steps are held and their sum sent once, by the extension's own "
        "all-to-all, in both runs (`dgc.accumulate_locally`), so the run without coalescing issues no more of DeepSpeed's "
        "collectives than the coalesced one (no reduce-scatter in either; under `enabled` none at all, and the test "
        "first asserts the baseline issued some). The same file's bit-exactness "
        "tests (the coalesced weights equal the others to 1e-6) pass: the held sum is the coalesced one"),
    "test_zero_linear_direct_init.py": (
        "it asserts `safe_get_full_grad` equal to the uncompressed gradient to torch's float32 tolerance (1.3e-6 "
        "relative); under the default codec (dense INT4 with error feedback) it is the averaged gradient as the "
        "owners decoded it, within a quantization step"),
}


def _why(tests: dict, ids: list) -> list:
    """Lines saying why the failures of :data:`WHY_FAILED`'s tests fail (how many of each)."""
    out = []
    for part, why in WHY_FAILED.items():
        n = sum(1 for nodeid in ids if part in nodeid and tests.get(nodeid, {}).get("class") == "failed")
        if n:
            out += ["", f"Why the {n} of `{part}` fail: {why}."]
    return out


def markdown(report: dict, results: dict, meta: dict) -> str:
    ids, stock, runs = meta["ids"], results.get("stock", {}), meta["runs"]
    # the machine of the sections' full runs (a run recorded before runs named theirs: this one's)
    machine = " and ".join(sorted({run.get("machine", meta["machine"]) for run in runs.values()})) or meta["machine"]
    out = ["# DeepSpeed's ZeRO-3 unit tests with a `\"dgc\"` section (issue 51, item 4)", "",
           f"The {report['tests']} tests of DeepSpeed's `tests/unit/v1/zero/` and `tests/unit/runtime/zero/` that "
           f"build a ZeRO-3 config (commit {meta['deepspeed_commit']}, vendored in "
           "[peer/deepspeed_tests](../peer/deepspeed_tests/README.md), which says how they were found), run with "
           f"DeepSpeed {meta['deepspeed']} and torch {meta['torch']} on the CPU accelerator (gloo, "
           f"`LOCAL_SIZE={meta['local_size']}`), {machine}, one pytest process per file, "
           f"{meta['timeout']} s per test at most (`make peer-tests`, `benchmarks/peer_tests.py`). Each section "
           "injects its `\"dgc\"` section into every ZeRO-3 config that reaches `deepspeed.initialize` (`enabled`: "
           "`{\"enabled\": true}`; `recommended`: the section of `configs/zero3_dgc_adam.json`); `stock` is "
           "DeepSpeed alone. Each test against its stock outcome: *unchanged* (the same outcome), *refused* (a "
           "`deepspeed_dgc` error, whose message says why) or *failed* (anything else).", "",
           "| section | tests | unchanged | refused | failed | time | deepspeed_dgc | command |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for section in ["stock", *report["sections"]]:
        run = runs.get(section, {})
        tail = f"{_minutes(run.get('seconds'))} | {run.get('deepspeed_dgc', '')} | `{run.get('command', '')}` |"
        if section == "stock":
            outcomes = ", ".join(f"{n} {o}" for o, n in sorted(report["stock"].items()))
            out.append(f"| stock | {sum(report['stock'].values())} | ({outcomes}) | | | {tail}")
        else:
            c = report["sections"][section]["counts"]
            out.append(f"| {section} | {sum(c.values())} | {c['unchanged']} | {c['refused']} | {c['failed']} | {tail}")
    out += ["", "Times are wall clock on 2 CPU cores shared with other jobs."]
    for section in report["sections"]:
        unreached = [i for i in ids if i in results[section] and not any(
            call.get("stage") == 3 for call in results[section][i].get("injections", []))]
        if unreached:
            how = Counter(results[section][i]["outcome"] for i in unreached)
            out += ["", f"In the {section} run, {len(unreached)} tests ({', '.join(f'{n} {o}' for o, n in how.items())}"
                       ") ended before any ZeRO-3 config reached `deepspeed.initialize` (on this CPU), so the section "
                       "never took effect in them: they count as unchanged."]
    for section, run in runs.items():
        for rerun in run.get("reruns", []):
            on = f", on {rerun['machine']}" if rerun.get("machine") else ""
            out += ["", f"{section}: {rerun['tests']} tests run again since, by `{rerun['command']}` "
                       f"(deepspeed_dgc {rerun['deepspeed_dgc']}{on}); their records replace the first ones."]
    for section, data in report["sections"].items():
        for cls in ("refused", "failed"):
            n = data["counts"][cls]
            if n:
                out += ["", f"## {section}: {cls} ({n})", "", *_rows(data["tests"], ids, cls, stock, cls == "refused")]
                if cls == "failed":
                    out += _why(data["tests"], ids)
    failing = [nodeid for nodeid in ids if stock.get(nodeid, {}).get("outcome") == "failed"]
    if failing:
        out += ["", f"## Tests that fail stock ({len(failing)})", "",
                "On this CPU (the tests are listed in *Every test* below); a section's *unchanged* for them says it "
                "fails too (where with another error, the tests are listed).", "",
                *_rows({i: {"class": "x", **stock[i]["error"]} for i in failing}, ids, "x", stock, False, False)]
        for section, data in report["sections"].items():
            other = {i: t for i, t in data["tests"].items() if t.get("note")}
            if other:
                out += ["", f"{section}: {len(other)} of them fail with another error than stock's", "",
                        *_rows({i: {**t, "class": "x"} for i, t in other.items()}, ids, "x", stock, False)]
    out += ["", "## Every test", "", "| test | stock | " + " | ".join(report["sections"]) + " |",
            "| --- | --- | " + " | ".join("---" for _ in report["sections"]) + " |"]
    for nodeid in ids:
        cells = [stock.get(nodeid, {}).get("outcome", "")]
        cells += [data["tests"].get(nodeid, {}).get("class", "") for data in report["sections"].values()]
        out.append(f"| `{nodeid}` | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()


def dgc_label(setup: Setup) -> str:
    """Which deepspeed_dgc the ranks import."""
    if setup.dgc_root is not None:
        return f"{setup.dgc_root.name.removeprefix('dgc-')} (`--dgc-commit`)"
    dirty = _git("status", "--porcelain", "--", "deepspeed_dgc", "op_builder", "csrc").splitlines()
    return f"the checkout at {_git('rev-parse', '--short', 'HEAD')}" + (
        f" with {len(dirty)} uncommitted changes in deepspeed_dgc/, op_builder/ or csrc/" if dirty else "")


def versions() -> dict:
    import deepspeed
    import torch
    readme = (VENDORED / "README.md").read_text() if (VENDORED / "README.md").exists() else ""
    commit = next((w.strip("`.,") for w in readme.split() if w.startswith("`") and len(w.strip("`.,")) == 40),
                  "unknown")
    cpuinfo = Path("/proc/cpuinfo")
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")), "unknown CPU") if cpuinfo.exists() else "unknown CPU"
    return {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "deepspeed_commit": commit[:9],
            "machine": f"{os.cpu_count()} CPU cores ({cpu})"}


def note_run(setup: Setup, section: str, command: str, seconds, tests: int) -> None:
    """``<out_dir>/runs.json``: for each section, its last full run (the command, which deepspeed_dgc, the seconds it
    took) and the subsets run since (``reruns``)."""
    path = setup.out_dir / "runs.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    run = {"command": command, "deepspeed_dgc": dgc_label(setup), "tests": tests, "timeout": setup.timeout,
           "local_size": setup.local_size, "commit": _git("rev-parse", "--short", "HEAD"),
           "ended": time.strftime("%Y-%m-%d %H:%M"), "machine": versions()["machine"]}
    if seconds is None and section in runs:
        runs[section].setdefault("reruns", []).append(run)
    else:
        runs[section] = {**run, "seconds": seconds}
    path.write_text(json.dumps(runs, indent=1))


def brief(record: dict) -> dict:
    """A test's record for the committed JSON: its outcome, time, error (message cut) and skip reason, and how many
    ZeRO-3 configs reached ``deepspeed.initialize`` (with the errors it raised)."""
    out = {k: record[k] for k in ("outcome", "duration", "when") if k in record}
    if record.get("error"):
        out["error"] = {**record["error"], "message": str(record["error"].get("message"))[:MESSAGE_CHARS]}
    if record.get("skip_reason"):
        out["skip_reason"] = first_line(record["skip_reason"])[:MESSAGE_CHARS]
    calls = record.get("injections", [])
    out["zero3_initialize"] = sum(1 for c in calls if c.get("stage") == 3)
    errors = [c["error"] for c in calls if c.get("error")]
    if errors:
        out["initialize_errors"] = errors
    return out


def write_report(setup: Setup, ids: list, md_path: Path, json_path: Path) -> dict:
    results = {s: json.loads((setup.out_dir / f"{s}.json").read_text()) for s in SECTIONS
               if (setup.out_dir / f"{s}.json").exists()}
    runs_path = setup.out_dir / "runs.json"
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    report = build_report(results, ids)
    meta = {**versions(), "runs": runs, "ids": ids,
            "timeout": "/".join(sorted({f"{r['timeout']:.0f}" for r in runs.values()})) or f"{setup.timeout:.0f}",
            "local_size": "/".join(sorted({str(r["local_size"]) for r in runs.values()})) or setup.local_size}
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown(report, results, meta))
    classes = {section: {"counts": data["counts"], "class": {i: t["class"] for i, t in data["tests"].items()}}
               for section, data in report["sections"].items()}
    meta.pop("ids")  # the order of selected.txt; the records are keyed by test id
    json_path.write_text(json.dumps({"meta": meta, "stock": report["stock"], "sections": classes, "records": {
        section: {nodeid: brief(record) for nodeid, record in records.items() if nodeid in ids}
        for section, records in results.items()}}, indent=1))
    return report


def export_commit(rev: str, out_dir: Path) -> Path:
    """``deepspeed_dgc`` (with ``op_builder``, ``csrc``) as committed at ``rev``, exported under ``out_dir``, with this
    checkout's prebuilt fused op: the runs see one commit, not files others are editing meanwhile."""
    sha = _git("rev-parse", rev)
    if not sha:
        raise SystemExit(f"--dgc-commit {rev}: not a commit of {ROOT}")
    dest = out_dir / f"dgc-{sha[:9]}"
    if not (dest / "deepspeed_dgc").exists():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha, "deepspeed_dgc", "op_builder", "csrc"], cwd=ROOT,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        for built in (ROOT / "deepspeed_dgc" / "_prebuilt").glob("*.so"):
            shutil.copy2(built, dest / "deepspeed_dgc" / "_prebuilt" / built.name)
    return dest


# ---- discovery ----------------------------------------------------------------------------------------------------


def collect(setup: Setup, paths) -> list:
    """The tests under ``paths``: ``{"nodeid", "stage_param"}`` (the ZeRO stage a test is parametrized with)."""
    env = pytest_env(DISCOVER, setup.out_dir, setup)
    Path(env[peer_inject.RESULTS_ENV]).unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-p", "benchmarks.peer_inject", "-p",
                    "no:cacheprovider", *paths], cwd=setup.tests_root, env=env, capture_output=True, check=False)
    lines, _ = _read_lines(Path(env[peer_inject.RESULTS_ENV]), 0)
    return [line for line in lines if line["event"] == "collected"]


def discover(setup: Setup, keys) -> tuple:
    """The tests under ``setup.tests_root``'s ZeRO directories that build a ZeRO-3 config: the ones parametrized with
    ``zero_stage`` (or ``stage``) 3, without running them, and of those parametrized with no stage, the ones that pass
    a ZeRO-3 config to ``deepspeed.initialize`` (each runs stock until its first such call, where the wrapper records
    it and skips the test); those parametrized with another stage are left out. Returns the ids (in collection order)
    and a line that counts them."""
    items = [i for i in collect(setup, DISCOVER_DIRS) if not keys or any(k in i["nodeid"] for k in keys)]
    run = [i["nodeid"] for i in items if i["stage_param"] is None]
    records = run_section(DISCOVER, run, setup)
    found = {nodeid for nodeid in run
             if any(call.get("stage") == 3 for call in records.get(nodeid, {}).get("injections", []))}
    stage3 = [i["nodeid"] for i in items if i["stage_param"] == 3]
    return [i["nodeid"] for i in items if i["nodeid"] in found or i["stage_param"] == 3], (
        f"{len(items)} tests collected: {len(stage3)} parametrized with ZeRO stage 3 (taken), "
        f"{len(items) - len(stage3) - len(run)} with another stage (left out), {len(run)} with none (run stock until "
        f"their first ZeRO-3 deepspeed.initialize: {len(found)} reach one, taken)")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("-k", dest="keys", action="append", default=[],
                        help="only the tests whose id contains this string (repeatable: any of them)")
    parser.add_argument("--timeout", type=float, default=Setup.timeout, help="seconds per test before it is killed")
    parser.add_argument("--local-size", type=int, default=Setup.local_size,
                        help="LOCAL_SIZE: how many CPU devices DeepSpeed's tests may use")
    parser.add_argument("--dgc-commit", help="run deepspeed_dgc as committed at this revision (an export under "
                        "--out-dir) rather than this checkout's files")
    parser.add_argument("--tests-root", type=Path, default=Setup.tests_root)
    parser.add_argument("--out-dir", type=Path, default=Setup.out_dir)
    parser.add_argument("--report", type=Path, default=ROOT / "results" / "peer_tests.md")
    parser.add_argument("--json", type=Path, default=ROOT / "results" / "peer_tests.json")
    parser.add_argument("--report-only", action="store_true", help="no run: the report from --out-dir's records")
    parser.add_argument("--discover", action="store_true",
                        help=f"run every test of --tests-root's {' and '.join(DISCOVER_DIRS)} until its first "
                        "ZeRO-3 initialize and write the ids of those that reach one to --selected")
    parser.add_argument("--selected", type=Path, default=SELECTED)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    setup = Setup(tests_root=args.tests_root.resolve(), out_dir=args.out_dir.resolve(), timeout=args.timeout,
                  local_size=args.local_size,
                  dgc_root=export_commit(args.dgc_commit, args.out_dir.resolve()) if args.dgc_commit else None)
    command = " ".join(["python -m benchmarks.peer_tests", *argv])
    if args.discover:
        found, counts = discover(setup, args.keys)
        args.selected.write_text(f"# {command}\n# {counts}:\n" + "".join(f"{i}\n" for i in found))
        print(f"{counts}: {args.selected}")
        return
    ids = read_selected(args.selected)
    chosen = [i for i in ids if not args.keys or any(k in i for k in args.keys)]
    if not args.report_only:
        for section in args.sections:
            t0 = time.time()
            run_section(section, chosen, setup)
            note_run(setup, section, command, None if args.keys else round(time.time() - t0), len(chosen))
    report = write_report(setup, ids, args.report, args.json)
    for section, data in report["sections"].items():
        print(f"{section}: {data['counts']}")
    print(f"report: {args.report}, {args.json}")


if __name__ == "__main__":
    main()
