"""``make gpu-check``: the device path on a machine with a GPU, one table, under 8 minutes.

1. ``pytest tests/gpu``: the CUDA op against the torch ops and the CPU reference, the bucket path under
   ``torch.cuda.set_sync_debug_mode("error")``.
2. The main job (``examples/train_char_gpt.py``, one rank, NCCL) for stock ZeRO-3 and every method: from step 3 on,
   every call of the extension (the compressed reduce-scatter of each bucket, the quantized weight gather and its
   wait) runs under ``set_sync_debug_mode("error")`` (a host synchronisation raises; DeepSpeed's own are not ours);
   ``max_memory_allocated`` of each run beside stock's; CUDA kernel launches per bucket from a profile of step 4
   (``cudaLaunchKernel`` calls inside the extension's ``dgc_bucket`` ranges).
3. The CUDA op's GB/s (fixed-layout encode and decode of a 64M-element bucket, dense INT4 and top-k 0.01) against the
   device's copy bandwidth measured the same way.

Needs a CUDA build of torch and DeepSpeed in the Python that runs it (``GPU_PYTHON``, default ``python3``; on a
machine without DeepSpeed or pydantic and without a network, the wheels of ``make gpu-wheels``, see the Makefile); the
op is JIT-built once for the visible GPU into ``build/torch_extensions`` (the tests' directory, which the jobs share),
or prebuilt by ``DS_BUILD_DGC=1 pip install .``. A step that runs past its time is recorded as failed with what it
printed, and the table is still written; a job left out for the 8-minute budget is shown as skipped (the exit status
is then 2; 1 where something failed). Writes ``runs/gpu_check.json``.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYNC_FROM_STEP = 3  # steps 1-2 make each bucket shape's constants and the process groups
PROFILE_STEP = 4

# momentum correction's owners step with momentum SGD (no warm-up schedule)
SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}, "zero_allow_untested_optimizer": True,
       "scheduler": None}
# name -> (ds_config, "dgc" keys set on top, top-level keys set on top: None removes one)
JOBS = {
    "stock ZeRO-3": ("configs/zero3_baseline.json", [], {}),
    "dense INT4 (default)": ("configs/zero3_int4.json", [], {}),
    "top-k 0.1 INT4": ("configs/zero3_dgc_int4_d01.json", [], {}),
    # bf16 gradients: a bf16 owner matrix, which the CUDA op's gather and encode take
    "top-k 0.1 INT4, bf16 engine": ("configs/zero3_dgc_int4_d01.json", [], {"bf16": {"enabled": True}}),
    "top-k 0.01 FP8, INT8 weights": ("configs/zero3_dgc_int4.json",
                                     ['density=0.01', 'quantization="fp8_e4m3"', 'weights={"quantization": "int8"}'],
                                     {}),
    "decoupled momentum": ("configs/zero3_dgc_adam.json", [], {}),
    "shared mask": ("configs/zero3_baseline.json", ['enabled=true', 'shared_mask={"density": 0.05}'], {}),
    "compressed momentum": ("configs/zero3_dgc_int4.json", ['compressed_momentum={"freeze_step": 2}'], {}),
    "momentum correction (SGD)": ("configs/zero3_dgc_int4.json", ["momentum_correction=true"], SGD),
}

HOOK = r'''
import os, runpy, sys, json, torch
from torch.profiler import profile, ProfilerActivity, record_function
if os.environ.get("DRY"):  # the harness on a CPU: no sync debug mode, no device memory, CPU events only
    torch.cuda.set_sync_debug_mode = lambda mode: None
    torch.cuda.max_memory_allocated = lambda *a: 0
    torch.cuda.synchronize = lambda *a: None
ACTIVITIES = [ProfilerActivity.CPU] + ([] if os.environ.get("DRY") else [ProfilerActivity.CUDA])
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed_dgc.zero3.reduce_scatter import CompressedReduceScatter
from deepspeed_dgc.zero3 import allgather

SYNC_FROM, PROFILE_STEP, OUT = int(os.environ["SYNC_FROM"]), int(os.environ["PROFILE_STEP"]), os.environ["OUT"]
steps = {"n": 0, "profiled_buckets": 0}
prof = None

def guarded(fn, name):
    def call(*args, **kwargs):
        on = steps["n"] + 1 >= SYNC_FROM  # the step being computed
        steps["calls_" + name] = steps.get("calls_" + name, 0) + 1
        if on:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with record_function(name):
                return fn(*args, **kwargs)
        finally:
            if on:
                torch.cuda.set_sync_debug_mode(0)
    return call

CompressedReduceScatter.reduce_scatter = guarded(CompressedReduceScatter.reduce_scatter, "dgc_bucket")
allgather.QuantizedAllGather.quantized = guarded(allgather.QuantizedAllGather.quantized, "dgc_gather")
allgather._DequantizeOnWait.wait = guarded(allgather._DequantizeOnWait.wait, "dgc_gather_wait")
step = DeepSpeedEngine.step

def counted_step(self, *args, **kwargs):
    global prof
    out = step(self, *args, **kwargs)
    steps["n"] += 1
    if steps["n"] + 1 == PROFILE_STEP:  # from here: step PROFILE_STEP's forward, backward (its buckets) and step
        prof = profile(activities=ACTIVITIES)
        prof.__enter__()
    elif prof is not None and steps["n"] == PROFILE_STEP:
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        ranges = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.name == "dgc_bucket"]
        launches = sum(1 for e in prof.events() if e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC",
                       "cuLaunchKernel", "cudaMemcpyAsync", "cudaMemsetAsync")
                       and any(a <= e.time_range.start <= b for a, b in ranges))
        steps["launches_per_bucket"] = launches / max(1, len(ranges))
        steps["profiled_buckets"] = len(ranges)
        prof = None
    with open(OUT, "w") as f:
        json.dump(dict(steps=steps["n"], max_memory_allocated=torch.cuda.max_memory_allocated(),
                       launches_per_bucket=steps.get("launches_per_bucket"), profiled_buckets=steps["profiled_buckets"],
                       calls={k[6:]: v for k, v in steps.items() if k.startswith("calls_")}), f)
    return out

DeepSpeedEngine.step = counted_step
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _run(cmd, env, timeout_s) -> subprocess.CompletedProcess:
    """``cmd`` in the project's root; one that runs past ``timeout_s`` is killed and returned as failed (exit 124) with
    what it printed, so that the table is still written."""
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        text = lambda b: (b.decode(errors="replace") if isinstance(b, bytes) else b) or ""  # noqa: E731
        return subprocess.CompletedProcess(cmd, 124, text(err.stdout),
                                           text(err.stderr) + f"\ngpu_check: killed after {timeout_s:.0f} s")


def run_job(name, config, sets, top, steps, timeout_s, dry=False):
    """One rank of the main job with the hook (``config`` with ``top``'s top-level keys set, a None removing one, and
    ``sets`` as ``--dgc-set``); returns its record (or the error)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, summary = os.path.join(tmp, "out.json"), os.path.join(tmp, "summary.json")
        hook = os.path.join(tmp, "hook.py")
        Path(hook).write_text(HOOK)
        if top:
            ds = {k: v for k, v in dict(json.loads((ROOT / config).read_text()), **top).items() if v is not None}
            config = os.path.join(tmp, "config.json")
            Path(config).write_text(json.dumps(ds))
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(29500 + os.getpid() % 1000), SYNC_FROM=str(SYNC_FROM_STEP),
                   PROFILE_STEP=str(PROFILE_STEP), OUT=out, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
                   **({"DRY": "1"} if dry else {}))
        cmd = [sys.executable, hook, "examples/train_char_gpt.py", "--deepspeed_config", config, "--max-steps",
               str(steps), "--eval-interval", "100000", "--summary-json", summary]
        for s in sets:
            cmd += ["--dgc-set", s]
        started = time.time()
        proc = _run(cmd, env, timeout_s)
        record = {"name": name, "seconds": round(time.time() - started, 1), "ok": proc.returncode == 0}
        if os.path.exists(out):
            record.update(json.loads(Path(out).read_text()))
        if os.path.exists(summary):
            record["final_loss"] = json.loads(Path(summary).read_text()).get("final_train_loss")
        if proc.returncode != 0:
            record["error"] = (proc.stderr or proc.stdout)[-3000:]
        return record


def op_bandwidth(numel: int = 1 << 26):
    """GB/s of the CUDA op's fixed-layout encode and decode (dense INT4; top-k 0.01 INT4) and of a device copy."""
    import torch

    from deepspeed_dgc.codec import fixed
    from deepspeed_dgc.codec.kernels import FusedCUDAOps, load_fused_op
    from deepspeed_dgc.codec.layout import Workspace
    ops = FusedCUDAOps(load_fused_op("cuda"))

    def timed(fn, reps=5):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    x = torch.randn(numel, device="cuda")
    y = torch.empty_like(x)
    copy_s = timed(lambda: y.copy_(x))
    rows = [{"what": "device copy", "GB/s": round(2 * 4 * numel / copy_s / 1e9, 1)}]
    for label, density in (("encode+decode dense INT4", 1.0), ("encode+decode top-k 0.01 INT4", 0.01)):
        sizes = [numel // 8] * 8
        plan = fixed.FixedPlan.build(sizes, 8, list(range(8)), [True] * 8, density, True, "int4", 128, torch.float32)
        L = plan.layout
        A = fixed.owner_matrix(L.rows, L.columns, "cuda")
        ws = Workspace([torch.empty(8 * A.numel(), dtype=torch.uint8, device="cuda")])
        gen = torch.Generator(device="cuda").manual_seed(0)

        def step():
            L.gather([x[i * (numel // 8):(i + 1) * (numel // 8)] for i in range(8)], A)
            mark = ws.mark()
            payloads = fixed.encode(A, plan, 1, ws, sample_generator=gen, ops=ops)
            fixed.decode_sum(payloads, plan, 1, 0, ws, ops=ops)
            ws.release(mark)
        seconds = timed(step)
        moved = 4 * A.numel() * 3  # gather writes A, encode reads it and writes the residual (decode: one row)
        rows.append({"what": label, "GB/s": round(moved / seconds / 1e9, 1), "ms": round(seconds * 1e3, 2)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", type=Path, default=ROOT / "runs" / "gpu_check.json")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run the jobs' harness on the CPU (no sync debug mode, no device memory, no op timing)")
    args = ap.parse_args()
    import torch
    if args.cpu_dry_run:
        jobs = [run_job(name, *job, args.steps, 300, dry=True) for name, job in JOBS.items()]
        for j in jobs:
            print(json.dumps(j)[:600])
        sys.exit(0 if all(j["ok"] for j in jobs) else 1)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "build" / "torch_extensions"))  # one JIT build for all
    if not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device (this Python's torch: %s); run it where one is, with a CUDA "
                 "build of torch (GPU_PYTHON=...)" % torch.__version__)
    deadline = time.time() + 8 * 60
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if not args.skip_tests:
        t = _run([sys.executable, "-m", "pytest", "-q", "-rf", "tests/gpu"], dict(os.environ), 240)
        log = ROOT / "runs" / "gpu_check_tests.log"  # the whole output, failures' tracebacks included
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(t.stdout + "\n" + t.stderr)
        report["tests_gpu"] = t.stdout.strip().splitlines()[-1] if t.stdout.strip() else t.stderr[-500:]
        report["tests_gpu_ok"] = t.returncode == 0
        print("tests/gpu:", report["tests_gpu"], flush=True)
        if t.returncode != 0:  # the short summary of what failed (the tracebacks: the log)
            print("\n".join(line for line in t.stdout.splitlines() if line.startswith(("FAILED", "ERROR")))[-6000:],
                  f"\n(whole output: {log})", flush=True)
    report["jobs"] = []
    for name, job in JOBS.items():
        left = deadline - time.time() - 60
        if left < 30:
            report["jobs"].append({"name": name, "ok": None, "error": "skipped: out of the 8-minute budget"})
            continue
        record = run_job(name, *job, args.steps, min(150, left))
        report["jobs"].append(record)
        print(json.dumps(record)[:400], flush=True)
    try:
        report["op"] = op_bandwidth()
    except Exception as err:  # noqa: BLE001 -- the jobs' table is still printed and written
        report["op"], report["op_error"] = [], f"{type(err).__name__}: {err}"[-2000:]
        print("the CUDA op's timing failed:", report["op_error"], flush=True)
    stock = next((j.get("max_memory_allocated") for j in report["jobs"] if j["name"] == "stock ZeRO-3"), None)
    print(f"\n{report['device']}, torch {report['torch']}; tests/gpu: {report.get('tests_gpu', 'skipped')}")
    print("| job | sync-debug from step 3 | final loss | max_memory_allocated MB (x stock) | launches per bucket |")
    print("|---|---|---:|---:|---:|")
    for j in report["jobs"]:
        mem = j.get("max_memory_allocated")
        ratio = f" ({mem / stock:.2f}x)" if mem and stock else ""
        state = "skipped (8-minute budget)" if j["ok"] is None else "ok" if j["ok"] else "FAILED"
        print(f"| {j['name']} | {state} | {j.get('final_loss', '-')} | "
              f"{(mem or 0) / 2**20:.1f}{ratio} | {j.get('launches_per_bucket', '-')} |")
    print("| CUDA op | GB/s |\n|---|---:|")
    for row in report["op"]:
        print(f"| {row['what']} | {row['GB/s']} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    failed = [j["name"] for j in report["jobs"] if j["ok"] is False]
    if failed or not report.get("tests_gpu_ok", True) or "op_error" in report:
        for j in report["jobs"]:
            if j["ok"] is False:
                print(f"--- {j['name']}:\n{j.get('error', '')}")
        sys.exit(1)
    if any(j["ok"] is None for j in report["jobs"]):
        sys.exit(2)


if __name__ == "__main__":
    main()
