"""Per-rank memory of the extension's state next to ZeRO-3's own, measured and projected.

Run from the repository root (CPU ranks; ``make bench-memory``)::

    OMP_NUM_THREADS=1 python -m benchmarks.bench_memory --json runs/bench_memory/results.json --results results

What it does:

1. Trains the main job's char GPT (``configs/zero3_baseline.json`` with bf16 mixed precision, Adam) for ``--steps``
   steps under the deepspeed launcher, for every configuration (``stock``: no ``"dgc"``; ``ef``: ``{"enabled":
   true}``, dense INT4 with error feedback; ``adam``: ``configs/zero3_dgc_adam.json``'s decoupled momentum) on every
   topology: flat at 2 ranks, and hierarchical as N nodes of L ranks (``2x2``, ``4x2``, ``2x4``: ``NxL``), the
   hierarchical rows with the storage the hierarchical study chose (``--hier-storage``).
2. On every rank after the last step: the extension's state (committed residuals, momenta, preconditioner) between
   steps, its peak (the same plus the window's staged fp32 copies, just before the commit), and ZeRO-3's own state
   (:func:`deepspeed_dgc.telemetry.zero3_state_bytes`: parameter partitions, fp32 master copies, Adam's moments,
   gradient partitions), each from the tensors' storage bytes; the table takes the largest rank.
3. The formulas of each row (bytes per parameter per rank; W ranks, L per node) next to what was measured, and the
   same formulas for a 70B-parameter model at W = 64, L = 8.

Buffers of the bucket path (one bucket at a time, ``reduce_bucket_size``) are transient and not counted, as
ZeRO-3's own buckets are not.
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

BASE_CONFIG = ROOT / "configs" / "zero3_baseline.json"
ADAM_CONFIG = ROOT / "configs" / "zero3_dgc_adam.json"
TOPOLOGIES = {"flat": (2, None), "2x2": (4, 2), "4x2": (8, 2), "2x4": (8, 4)}  # name -> (W, L); NxL: N nodes of L
CONFIGS = ("stock", "ef", "adam")
FP8_RESIDUAL = 1.0 + 4.0 / 128  # bytes per element: e4m3 codes and an fp32 scale per 128
STORAGE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": FP8_RESIDUAL}
PROJECTION = {"params": 70e9, "W": 64, "L": 8}


def ds_config(config: str, topology: str, hier_storage: dict) -> dict:
    """The ds_config of one row: the baseline with bf16, plus the configuration's ``"dgc"`` section."""
    ds = json.loads(BASE_CONFIG.read_text())
    ds["bf16"] = {"enabled": True}
    if config == "stock":
        return ds
    dgc = {"enabled": True} if config == "ef" else json.loads(ADAM_CONFIG.read_text())["dgc"]
    W, L = TOPOLOGIES[topology]
    if L is not None:
        dgc = dict(dgc, topology="hierarchical", ranks_per_node=L)
        if config == "ef":
            dgc["residual_dtype"] = hier_storage["ef"]
        else:
            dgc["decoupled_momentum"] = dict(dgc["decoupled_momentum"], storage=hier_storage["adam"])
    ds["dgc"] = dgc
    return ds


def formula(config: str, W: int, L, hier_storage: dict) -> dict:
    """Bytes per parameter per rank. ZeRO-3's own: mixed-precision Adam, (2 + 4 + 8 + 2) / W (bf16 parameters, fp32
    master copies, Adam's two moments, bf16 gradients); with decoupled momentum's sign step the owners keep no Adam
    moments, (2 + 4 + 2) / W. The extension's steady state: its residual or momentum, of full size (flat) or of the
    node-level sums (1/L). Its peak: the same plus the window's staged copy, which the last micro-step stages in the
    storage form (so twice the steady state)."""
    share = 1.0 / (L or 1)
    if config == "stock":
        steady = 0.0
    elif config == "ef":
        steady = STORAGE_BYTES[hier_storage["ef"] if L else "fp8"] * share
    else:
        steady = STORAGE_BYTES[hier_storage["adam"] if L else "fp32"] * share
    return {"zero3": (8.0 if config == "adam" else 16.0) / W, "stock": 16.0 / W, "steady": steady, "peak": 2 * steady}


# ---- worker: one rank of one row -------------------------------------------------------------------------------

def worker(args) -> None:
    import deepspeed
    import torch
    from deepspeed import comm as dist

    import deepspeed_dgc
    from deepspeed_dgc.telemetry import zero3_state_bytes
    from examples.train_char_gpt import CharGPT, get_batch, load_data

    ds = json.loads(Path(args.worker_config).read_text())
    deepspeed.init_distributed()
    rank = dist.get_rank()
    train, _, vocab = load_data()
    torch.manual_seed(args.seed)
    model = CharGPT(vocab, 64, 4, 128, 4)  # the main job's model
    n_params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    gen = torch.Generator().manual_seed(args.seed + rank)
    for _ in range(args.steps):
        x, y = get_batch(train, engine.train_micro_batch_size_per_gpu(), 64, gen)
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
    stats = deepspeed_dgc.get_stats(engine)
    record = {"rank": rank, "n_params": n_params, "world": dist.get_world_size(), "zero3": zero3_state_bytes(engine),
              "steady": stats.state_bytes if stats else 0, "peak": stats.peak_state_bytes if stats else 0,
              "loss": float(loss)}
    Path(args.worker_out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()


# ---- driver ----------------------------------------------------------------------------------------------------

def run_row(config: str, topology: str, args, port: int) -> dict:
    """Launch one row; the largest rank's figures (bytes per parameter) and every rank's records."""
    W, _ = TOPOLOGIES[topology]
    out = Path(tempfile.mkdtemp(prefix="dgc-mem-"))
    cfg_path = out / "ds_config.json"
    cfg_path.write_text(json.dumps(ds_config(config, topology, args.hier_storage), indent=2))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(W), "--master_port", str(port),
           "--module", "benchmarks.bench_memory", "--worker-config", str(cfg_path), "--worker-out", str(out),
           "--steps", str(args.steps), "--seed", str(args.seed)]
    log = args.out_dir / "logs" / f"{config}_{topology}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, timeout=args.launch_timeout_s)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(W) if (out / f"rank{r}.json").exists()]
    if proc.returncode != 0 or len(ranks) != W:
        raise RuntimeError(f"{config} on {topology} failed with exit code {proc.returncode} (log: {log})")
    n = ranks[0]["n_params"]
    return {"config": config, "topology": topology, "W": W, "L": TOPOLOGIES[topology][1], "n_params": n,
            "zero3": max(r["zero3"]["total"] for r in ranks) / n, "steady": max(r["steady"] for r in ranks) / n,
            "peak": max(r["peak"] for r in ranks) / n,
            "zero3_parts": {k: max(r["zero3"][k] for r in ranks) / n for k in ranks[0]["zero3"]}, "ranks": ranks}


def markdown(rows, args) -> str:
    hs = args.hier_storage
    lines = [f"Main job's char GPT ({rows[0]['n_params']:,} parameters), bf16 + Adam, {args.steps} steps; the largest "
             "rank; bytes per parameter per rank; formula in brackets. `ef`: `{\"enabled\": true}` (dense INT4, error "
             f"feedback; fp8 residual flat, {hs['ef']} hierarchical); `adam`: `configs/zero3_dgc_adam.json` "
             f"(decoupled momentum; fp32 flat, {hs['adam']} hierarchical).", "",
             "| config | topology | W | L | ZeRO-3's own | extension, between steps | extension, peak | "
             "extension / stock's ZeRO-3 (16/W) | ZeRO-3 + extension / stock |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    stock = {r["topology"]: r["zero3"] for r in rows if r["config"] == "stock"}
    for r in rows:
        f = formula(r["config"], r["W"], r["L"], hs)
        base = stock.get(r["topology"], f["stock"])
        lines.append(f"| {r['config']} | {r['topology']} | {r['W']} | {r['L'] or ''} | {r['zero3']:.3f} "
                     f"[{f['zero3']:.3f}] | {r['steady']:.3f} [{f['steady']:.3f}] | {r['peak']:.3f} [{f['peak']:.3f}] "
                     f"| {r['steady'] / base:.2f}x | {(r['zero3'] + r['steady']) / base:.2f}x |")
    p = PROJECTION
    W, L, n = p["W"], p["L"], p["params"]
    lines += ["", f"Projected from the same formulas: {n / 1e9:.0f}B parameters, W = {W}, L = {L} (GB per rank):", "",
              "| config | topology | ZeRO-3's own | extension, between steps | extension, peak | "
              "extension / stock's ZeRO-3 | ZeRO-3 + extension / stock |", "|---|---|---:|---:|---:|---:|---:|"]
    for config in CONFIGS:
        for name, level in (("flat", None), (f"hierarchical, L = {L}", L)):
            f = formula(config, W, level, hs)
            lines.append(f"| {config} | {name} | {f['zero3'] * n / 1e9:.2f} | {f['steady'] * n / 1e9:.2f} | "
                         f"{f['peak'] * n / 1e9:.2f} | {f['steady'] / f['stock']:.2f}x | "
                         f"{(f['zero3'] + f['steady']) / f['stock']:.2f}x |")
    lines += ["", "Reading: every measured row equals its formula. The flat topology keeps a full-size residual (fp8, "
              "1.03 B) or momentum (fp32, 4 B) on every rank, which at W = 64 is 4x and 16x ZeRO-3's own 16/W; the "
              "hierarchical topology keeps them for the node-level sums only (1/L), and with the bf16 momentum the "
              "recommended Adam setting holds at L = 8 exactly ZeRO-3's own 16/W = 0.25 B per parameter (the goal: at "
              "most that). The sign step needs no Adam moments, so ZeRO-3's own state is then 8/W, and the two together "
              "are 1.5x stock's. The peak is twice the state between steps: the committed state and the window's "
              "staged copy, which the last micro-step stages in the storage dtype; with gradient accumulation the "
              "earlier micro-steps stage fp32 (4/L B per parameter) for exactness, so their peak is the state plus "
              "that."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), choices=list(TOPOLOGIES))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--hier-storage", type=json.loads, default={"ef": "fp8", "adam": "bf16"},
                    help="JSON: the storage of the hierarchical rows, {\"ef\": residual_dtype, \"adam\": "
                    "decoupled_momentum.storage}")
    ap.add_argument("--out-dir", type=Path, default=Path("runs/bench_memory"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--results", type=Path, help="write DIR/bench_memory.md")
    ap.add_argument("--master-port", type=int, default=29760)
    ap.add_argument("--launch-timeout-s", type=float, default=600.0)
    ap.add_argument("--worker-config", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher passes it
    args = ap.parse_args(argv)
    if args.worker_config:
        worker(args)
        from deepspeed_dgc.comm.communicators import exit_without_finalization
        exit_without_finalization()  # gloo's teardown at exit can abort a rank whose record is written
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    bad = {k: v for k, v in args.hier_storage.items() if v not in STORAGE_BYTES} if isinstance(args.hier_storage, dict) \
        else {"": args.hier_storage}
    if bad or set(args.hier_storage) != {"ef", "adam"} or args.hier_storage["adam"] == "fp8":
        ap.error(f"--hier-storage: keys 'ef' (fp32, bf16, fp8) and 'adam' (fp32, bf16), got {args.hier_storage}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for topology in args.topologies:
        for config in args.configs:
            print(f"  {config} on {topology} ...", flush=True)
            rows.append(run_row(config, topology, args, args.master_port))
    text = markdown(rows, args)
    print(text)
    (args.out_dir / "results.md").write_text(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "hier_storage": args.hier_storage, "steps": args.steps}, indent=2))
    if args.results:
        (args.results / "bench_memory.md").write_text(
            "# Per-rank memory: the extension's state and ZeRO-3's own\n\n`OMP_NUM_THREADS=1 python -m "
            "benchmarks.bench_memory --json runs/bench_memory/results.json --results results` (`make bench-memory`), "
            f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores.\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
