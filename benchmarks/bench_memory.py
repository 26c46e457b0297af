"""Per-rank memory of the extension's state next to ZeRO-3's own: measured for every storage and placement, inside a
step as well as between steps, and projected to 7B and 70B parameters.

Run from the repository root (CPU ranks over gloo; ``make bench-memory``)::

    OMP_NUM_THREADS=1 python -m benchmarks.bench_memory --json results/bench_memory.json --results results

What it does:

1. Trains the main job's char GPT (``configs/zero3_baseline.json`` with bf16 mixed precision, Adam) for ``--steps``
   steps under the deepspeed launcher, for every row: ``stock`` (no ``"dgc"``); ``ef`` (``{"enabled": true, "layout":
   "fixed"}``, dense INT4 with error feedback in the layout ``"auto"`` takes on a GPU) with every residual storage
   (``residual_dtype``: fp32, bf16, fp8, int8); ``adam`` (``configs/zero3_dgc_adam.json``'s decoupled momentum,
   DeMo's sign step) with every momentum storage (``decoupled_momentum.storage``: fp32, bf16, int8); each of those
   with its state on the device or on the host (``residual_offload``, ``decoupled_momentum.offload``). Every
   topology is one launch whose ranks train the rows one after the other (one engine at a time): flat at 2 ranks and
   hierarchical as N nodes of L ranks (``2x2`` by default; ``4x2`` and ``2x4``, 8 ranks, on request); flat also has
   ef and adam in their default storage with half the ``reduce_bucket_size``. A row the installed extension refuses
   is listed with the refusal instead of measured.
2. On every rank, from the extension's own accounting (:func:`deepspeed_dgc.get_stats`) after the last step: its
   committed state (``state_bytes``), what it holds in host memory (``host_state_bytes``), and its state's peak
   (committed plus the window's staged copies, ``peak_state_bytes``); and ZeRO-3's own state
   (:func:`deepspeed_dgc.telemetry.zero3_state_bytes`). The tables take the largest rank.
3. The tensors themselves: a dispatch mode (:class:`LiveBytes`, on from before ``deepspeed.initialize``) follows
   every tensor that the extension's code or ZeRO-3's own code makes, from its creation until it is freed, on the
   device and in host memory apart (host: what went through the accelerator's ``pin_memory``); per owner, the bytes
   alive at the last step's start and the most alive at once during it (forward, backward with the bucket path,
   optimizer step). The extension's peak less its state's peak is what its bucket path (payloads, owner matrices,
   decoded copies) and its workspaces add.
4. The formulas of each row (:func:`formula`: bytes per parameter per rank; W ranks, L per node) next to what was
   measured, and the same formulas at 7B and 70B parameters for W = 8, 64 and 512, flat and hierarchical with L = 8,
   device and host apart, with issue 53's floor.

Units: bytes per parameter of the model per rank in the measured tables, GB (1e9 bytes) per rank in the projection.
"""

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent

BASE_CONFIG = ROOT / "configs" / "zero3_baseline.json"
ADAM_CONFIG = ROOT / "configs" / "zero3_dgc_adam.json"
TOPOLOGIES = {"flat": (2, None), "2x2": (4, 2), "4x2": (8, 2), "2x4": (8, 4)}  # name -> (W, L); NxL: N nodes of L
DEFAULT_TOPOLOGIES = ("flat", "2x2")  # at most 4 ranks a launch: the whole benchmark in minutes on 2 cores
CONFIGS = ("stock", "ef", "adam")
# bytes per element of each storage between steps: fp8, e4m3 codes and an fp32 scale per 128; int8, int8 codes and
# a bf16 absmax scale per 64 (stochastically rounded)
STORAGE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4.0 / 128, "int8": 1.0 + 2.0 / 64}
STORAGES = {"ef": ("fp32", "bf16", "fp8", "int8"), "adam": ("fp32", "bf16", "int8")}  # fp8 is for residuals only
PLACEMENTS = ("device", "host")  # host: ef's "residual_offload", adam's "decoupled_momentum.offload"
PROJECTION = {"params": (7e9, 70e9), "W": (8, 64, 512), "L": 8}
FLOOR = {"config": "adam", "W": 64, "L": 8}  # issue 53's floor: adam holds at most 16/W B per parameter on the device


@dataclass(frozen=True)
class Row:
    """One measured configuration: ``config`` (stock, ef, adam), the storage of its state between steps and where
    that state lives between steps (``"device"`` or ``"host"``); stock has neither (None). ``bucket``: another
    ``zero_optimization.reduce_bucket_size`` (elements) than the baseline's, or None."""
    config: str
    storage: Optional[str] = None
    placement: Optional[str] = None
    bucket: Optional[int] = None

    @property
    def name(self) -> str:
        name = self.config if self.config == "stock" else f"{self.config}_{self.storage}_{self.placement}"
        return name + (f"_bucket{self.bucket}" if self.bucket else "")


def default_storage(config: str) -> str:
    """The storage a row of ``config`` has by default: ef's ``residual_dtype: "auto"`` is fp8; adam's is what
    ``configs/zero3_dgc_adam.json`` names (fp32 where it names none)."""
    if config == "ef":
        return "fp8"
    return json.loads(ADAM_CONFIG.read_text())["dgc"]["decoupled_momentum"].get("storage", "fp32")


def all_rows(configs=CONFIGS, storages=None, placements=PLACEMENTS, bucket_check: bool = False) -> List[Row]:
    """Every row of ``configs``: stock once, ef and adam with every storage (of ``storages``, default all) and
    placement (of ``placements``); with ``bucket_check``, ef and adam in their default storage on the device once
    more with half the baseline's ``reduce_bucket_size`` (whether the bucket path's buffers follow the bucket)."""
    rows = []
    for config in configs:
        if config == "stock":
            rows.append(Row("stock"))
        else:
            rows += [Row(config, s, p) for s in STORAGES[config] if storages is None or s in storages
                     for p in placements]
    if bucket_check:
        half = json.loads(BASE_CONFIG.read_text())["zero_optimization"]["reduce_bucket_size"] // 2
        rows += [Row(c, default_storage(c), "device", half) for c in configs if c != "stock"]
    return rows


def ds_config(row: Row, topology: str) -> dict:
    """The ds_config of one row: the baseline with bf16, plus the configuration's ``"dgc"`` section with its storage,
    placement and topology."""
    ds = json.loads(BASE_CONFIG.read_text())
    ds["bf16"] = {"enabled": True}
    if row.bucket:
        ds["zero_optimization"]["reduce_bucket_size"] = row.bucket
    if row.config == "stock":
        return ds
    if row.config == "ef":
        dgc = {"enabled": True, "layout": "fixed", "residual_dtype": row.storage}
        if row.placement == "host":
            dgc["residual_offload"] = True
    else:
        dgc = json.loads(ADAM_CONFIG.read_text())["dgc"]
        dgc["decoupled_momentum"] = dict(dgc["decoupled_momentum"], storage=row.storage,
                                         offload=row.placement == "host")
    W, L = TOPOLOGIES[topology]
    if L is not None:
        dgc.update(topology="hierarchical", ranks_per_node=L)
    ds["dgc"] = dgc
    return ds


def refusal(row: Row, topology: str) -> Optional[str]:
    """Why the installed extension refuses this row's ``"dgc"`` section (its configuration check), or None."""
    if row.config == "stock":
        return None
    from deepspeed_dgc.config import DGCConfig
    try:
        DGCConfig.model_validate(ds_config(row, topology)["dgc"])
    except Exception as err:  # pydantic's ValidationError: its first error's message, without pydantic's own words
        errors = getattr(err, "errors", lambda: [])()
        return errors[0]["msg"].removeprefix("Value error, ") if errors else str(err)
    return None


def formula(row: Row, W: int, L: Optional[int]) -> Dict[str, float]:
    """Bytes per parameter per rank.

    - ``zero3``: ZeRO-3's own state between steps. Mixed-precision Adam: ``(2 + 4 + 8 + 2) / W`` (bf16 parameters,
      fp32 master copies, Adam's two moments, bf16 gradients); with decoupled momentum's sign step the owners keep no
      Adam moments: ``(2 + 4 + 2) / W``. ``stock``: stock's ``16 / W``.
    - ``steady``: the extension's committed state between steps, its residual (ef) or momentum (adam) of full size
      (flat) or of the node-level sums (1/L, hierarchical), in the row's storage.
    - ``device`` and ``host``: what it holds between steps on each. On the device: the committed state. On the host
      (``residual_offload``, ``decoupled_momentum.offload``): two buffers per bucket's block, the committed one and
      the one the next window's staged state is written back into, so twice ``steady``; the device then holds none
      (but the first bucket's block, fetched ahead of the next step: one bucket, outside the formula).
    - ``peak``: its state's peak, the committed state plus the window's staged copy, which the last micro-step stages
      in the storage form (twice ``steady``). ``peak_device`` and ``peak_host``: on the device both, or with the
      state on the host none (each bucket's block is fetched for its reduce and written back as it is staged: a
      bucket or two at a time, outside the formula) and the host's two buffers.
    """
    zero3 = (8.0 if row.config == "adam" else 16.0) / W
    steady = 0.0 if row.config == "stock" else STORAGE_BYTES[row.storage] / (L or 1)
    on_host = row.placement == "host"
    return {"zero3": zero3, "stock": 16.0 / W, "steady": steady, "device": 0.0 if on_host else steady,
            "host": 2 * steady if on_host else 0.0, "peak": 2 * steady, "peak_device": 0.0 if on_host else 2 * steady,
            "peak_host": 2 * steady if on_host else 0.0}


# ---- inside a step: live bytes by owner ----------------------------------------------------------------------------

DGC_DIR = str(ROOT / "deepspeed_dgc") + os.sep
DEEPSPEED_DIR = os.sep + "deepspeed" + os.sep
# DeepSpeed's helpers (collectives, accelerator, utilities) charge what they make to their caller
NEUTRAL = tuple(os.sep + "deepspeed" + os.sep + d + os.sep for d in ("comm", "accelerator", "utils"))
# the model's compute: its forward, autograd's backward, and ZeRO-3's linear layer (the model's F.linear, forward and
# backward, in DeepSpeed's file)
MODEL_FILES = (str(ROOT / "examples" / "train_char_gpt.py"), os.sep + "torch" + os.sep + "autograd" + os.sep,
               os.sep + os.path.join("deepspeed", "runtime", "zero", "linear.py"))


def owner_of(filename: str) -> Optional[str]:
    """The owner a frame's file stands for: ``"dgc"`` (deepspeed_dgc), ``"model"`` (the model's forward, autograd's
    backward, ZeRO-3's linear layer), ``"zero3"`` (the rest of DeepSpeed, its helpers aside), or None (look further
    out)."""
    if filename.startswith(DGC_DIR):
        return "dgc"
    if filename.startswith(MODEL_FILES[0]) or any(m in filename for m in MODEL_FILES[1:]):
        return "model"
    if DEEPSPEED_DIR in filename:
        return None if any(n in filename for n in NEUTRAL) else "zero3"
    return None


class LiveBytes:
    """Bytes of the tensors each owner's aten ops make, from their creation until they are freed, on the device and
    in (pinned) host memory apart.

    A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op of this thread; an op is charged to
    the innermost frame of the call stack that :func:`owner_of` names (so the extension's bucket path, which ZeRO-3's
    hook calls, is the extension's; autograd's gradients and the forward's activations are the model's). Every
    storage an op returns that is not the storage of one of its inputs (in-place ops and views are not new) counts,
    ``empty`` allocations included, until the storage is freed. A storage that goes through the accelerator's
    ``pin_memory`` (:meth:`pinned`: how DeepSpeed and the extension make host buffers) counts as its owner's host
    memory (``"<owner>_host"``), the rest as device memory; ``"<owner>_all"`` is both. Bytes on this rank.

    Use: ``with LiveBytes() as live: ...``; :meth:`mark` starts a peak; ``live.now[k]``, ``live.peak[k]`` (the most
    alive at once since the mark) per key ``k``.
    """

    OWNERS = ("dgc", "zero3", "model")

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        self.now: Dict[str, int] = {f"{o}{k}": 0 for o in self.OWNERS for k in ("", "_host", "_all")}
        self.peak: Dict[str, int] = dict(self.now)
        self._alive: Dict[int, Tuple[str, int]] = {}  # storage's data_ptr -> (key, bytes)
        self._lock = threading.RLock()  # a finalizer may free a storage while an op is being counted
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                frame, who = sys._getframe(1), None
                while frame is not None and who is None:
                    who, frame = owner_of(frame.f_code.co_filename), frame.f_back
                if who is None:
                    return out
                inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor) and t.device.type != "meta"}
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        outer._add(who, t.untyped_storage(), inputs)
                return out

        self._mode = Mode()

    def _move(self, key: str, nbytes: int) -> None:
        """Add ``nbytes`` (negative: free) to ``key`` and to its owner's total, keeping the peaks (lock held)."""
        total = key.split("_")[0] + "_all"
        for k in (key, total):
            self.now[k] += nbytes
            self.peak[k] = max(self.peak[k], self.now[k])

    def _add(self, who: str, storage, inputs) -> None:
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            if nbytes == 0 or ptr in inputs or ptr in self._alive:
                return
            self._alive[ptr] = (who, nbytes)
            self._move(who, nbytes)
        weakref.finalize(storage, self._free, ptr)  # the storage's Python object lives as long as the storage

    def _free(self, ptr: int) -> None:
        with self._lock:
            entry = self._alive.pop(ptr, None)
            if entry is not None:
                self._move(entry[0], -entry[1])

    def pinned(self, tensor) -> None:
        """``tensor`` (what the accelerator's ``pin_memory`` returned) is host memory of whoever made it."""
        ptr = tensor.untyped_storage().data_ptr()
        with self._lock:
            entry = self._alive.get(ptr)
            if entry is not None and not entry[0].endswith("_host"):
                self._move(entry[0], -entry[1])
                self._alive[ptr] = (entry[0] + "_host", entry[1])
                self._move(entry[0] + "_host", entry[1])

    def mark(self) -> Dict[str, int]:
        """Start a new peak from what is alive now; returns the bytes alive now per key."""
        gc.collect()
        with self._lock:
            self.peak = dict(self.now)
            return dict(self.now)

    def __enter__(self):
        LiveBytes.current = self
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        LiveBytes.current = None

    current: Optional["LiveBytes"] = None

    @staticmethod
    def watch_pin_memory() -> None:
        """Let the accelerator's ``pin_memory`` tell the current :class:`LiveBytes` what it pinned (once a process)."""
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        if getattr(acc.pin_memory, "_bench_memory", False):
            return
        original = acc.pin_memory

        def pin_memory(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            if LiveBytes.current is not None:
                LiveBytes.current.pinned(out)
            return out
        pin_memory._bench_memory = True
        acc.pin_memory = pin_memory


# ---- worker: one rank of one topology, every row in turn -------------------------------------------------------

def worker(args) -> None:
    """One rank: every row of the plan (``--worker-config``) in turn, ``--steps`` steps each under :class:`LiveBytes`;
    writes ``rank<r>.json`` into ``--worker-out`` (one record per row, bytes on this rank)."""
    import deepspeed
    import torch
    from deepspeed import comm as dist

    import deepspeed_dgc
    from deepspeed_dgc.telemetry import zero3_state_bytes
    from examples.train_char_gpt import CharGPT, get_batch, load_data

    plan = json.loads(Path(args.worker_config).read_text())
    deepspeed.init_distributed()
    rank = dist.get_rank()
    train, _, vocab = load_data()
    LiveBytes.watch_pin_memory()
    records = []
    for item in plan:
        t0 = time.perf_counter()
        torch.manual_seed(args.seed)
        model = CharGPT(vocab, 64, 4, 128, 4)  # the main job's model
        n_params = sum(p.numel() for p in model.parameters())
        with LiveBytes() as live:
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=item["ds_config"])
            t_init = time.perf_counter() - t0
            gen = torch.Generator().manual_seed(args.seed + rank)
            for step in range(args.steps):
                x, y = get_batch(train, engine.train_micro_batch_size_per_gpu(), 64, gen)
                if step == args.steps - 1:
                    start = live.mark()
                loss = engine(x.to(engine.device), y.to(engine.device))
                engine.backward(loss)
                engine.step()
            peak = dict(live.peak)
        stats = deepspeed_dgc.get_stats(engine)
        records.append({"row": item["row"], "rank": rank, "n_params": n_params, "world": dist.get_world_size(),
                        "zero3": zero3_state_bytes(engine), "steady": stats.state_bytes if stats else 0,
                        "host": stats.host_state_bytes if stats else 0,
                        "peak": stats.peak_state_bytes if stats else 0, "live_start": start, "live_peak": peak,
                        "loss": float(loss.detach()), "init_s": t_init, "row_s": time.perf_counter() - t0})
        engine.destroy()
        del engine, model, stats
        gc.collect()
        dist.barrier()
    Path(args.worker_out, f"rank{rank}.json").write_text(json.dumps(records))
    dist.barrier()


# ---- driver ----------------------------------------------------------------------------------------------------

def run_topology(rows: List[Row], topology: str, args, port: int) -> List[dict]:
    """Launch one topology with ``rows`` (each accepted by the extension); one result per row: the largest rank's
    figures in bytes per parameter, and every rank's records."""
    W, L = TOPOLOGIES[topology]
    out = Path(tempfile.mkdtemp(prefix="dgc-mem-"))
    plan = [{"row": asdict(r), "ds_config": ds_config(r, topology)} for r in rows]
    (out / "plan.json").write_text(json.dumps(plan, indent=2))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(W), "--master_port", str(port),
           "--module", "benchmarks.bench_memory", "--worker-config", str(out / "plan.json"), "--worker-out", str(out),
           "--steps", str(args.steps), "--seed", str(args.seed)]
    log = args.out_dir / "logs" / f"{topology}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    from benchmarks.soak import remove_shm_buffers
    with open(log, "w") as f:  # a session of its own: a launch past its time is ended with all its ranks
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        late = False
        try:
            proc.wait(timeout=args.launch_timeout_s)
        except BaseException as err:  # past its time, or the driver interrupted
            late = isinstance(err, subprocess.TimeoutExpired)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if not late:
                raise
        finally:
            remove_shm_buffers(port)  # DeepSpeed's CPU all-reduce buffers (about 69 MB a rank) outlive the job
    files = [out / f"rank{r}.json" for r in range(W)]
    if proc.returncode != 0 or not all(p.exists() for p in files):
        why = f"ran past {args.launch_timeout_s:.0f} s" if late else f"failed with exit code {proc.returncode}"
        raise RuntimeError(f"{topology} {why} (log: {log})")
    per_rank = [json.loads(p.read_text()) for p in files]
    results = []
    for i, row in enumerate(rows):
        ranks = [recs[i] for recs in per_rank]
        assert all(r["row"] == asdict(row) for r in ranks), (row, ranks[0]["row"])
        n = ranks[0]["n_params"]
        worst = lambda get: max(get(r) for r in ranks) / n  # noqa: E731  the largest rank, per parameter
        results.append({
            **asdict(row), "name": row.name, "topology": topology, "W": W, "L": L, "n_params": n,
            "zero3": worst(lambda r: r["zero3"]["total"]), "steady": worst(lambda r: r["steady"]),
            "host": worst(lambda r: r["host"]), "peak": worst(lambda r: r["peak"]),
            "zero3_parts": {k: worst(lambda r, k=k: r["zero3"][k]) for k in ranks[0]["zero3"]},
            "step": {f"{key}_{when}": worst(lambda r, key=key, when=when: r[f"live_{when}"][key])
                     for key in ranks[0]["live_start"] for when in ("start", "peak")},
            "ranks": ranks})
    return results


def measured_rows(args) -> Tuple[List[dict], List[dict]]:
    """Every topology's rows: the measured ones, and the refused ones (``{"row", "topology", "refusal"}``)."""
    measured, refused = [], []
    for i, topology in enumerate(args.topologies):
        rows = []
        bucket_check = topology == "flat" and not args.no_bucket_check
        for row in all_rows(args.configs, args.storages, args.placements, bucket_check):
            why = refusal(row, topology)
            if why:
                refused.append({**asdict(row), "name": row.name, "topology": topology, "refusal": why})
            else:
                rows.append(row)
        print(f"  {topology}: {len(rows)} rows ({len(refused)} refused so far) ...", flush=True)
        t0 = time.time()
        measured += run_topology(rows, topology, args, args.master_port + i)
        print(f"  {topology}: {time.time() - t0:.0f} s", flush=True)
    return measured, refused


# ---- tables ----------------------------------------------------------------------------------------------------

def _label(r) -> str:
    """The storage and placement cells of a row (empty for stock), with its bucket where it is not the baseline's."""
    cells = " | " if r["config"] == "stock" else f"{r['storage']} | {r['placement']}"
    return cells + (f", bucket {r['bucket']:,}" if r.get("bucket") else "")


def row_of(r: dict) -> Row:
    return Row(r["config"], r["storage"], r["placement"], r.get("bucket"))


def bucket_elements(r: dict) -> int:
    """The row's ``reduce_bucket_size`` (elements): the most a bucket holds."""
    return r.get("bucket") or json.loads(BASE_CONFIG.read_text())["zero_optimization"]["reduce_bucket_size"]


def in_step(r: dict) -> Dict[str, float]:
    """What the extension's tensors held at their peak inside the last step beyond its state's peak
    (``peak_state_bytes``), bytes per parameter (``extra``) and per element of ``reduce_bucket_size``
    (``extra_per_bucket_element``)."""
    extra = r["step"]["dgc_all_peak"] - r["peak"] if r["config"] != "stock" else 0.0
    return {"extra": extra, "extra_per_bucket_element": extra * r["n_params"] / bucket_elements(r)}


def markdown(rows: List[dict], refused: List[dict], args) -> str:
    """The measured tables, the projection and a reading computed from both."""
    n_params = rows[0]["n_params"]
    lines = [f"Main job's char GPT ({n_params:,} parameters), bf16 + Adam, {args.steps} steps, `reduce_bucket_size` "
             f"{bucket_elements({}):,} elements; the largest rank; bytes per parameter per rank; formula in brackets. "
             "`ef`: `{\"enabled\": true, \"layout\": \"fixed\"}` (dense INT4 with error feedback, the layout "
             "`\"auto\"` takes on a GPU) with `residual_dtype` = storage, and placement `host`: `residual_offload`; "
             "`adam`: `configs/zero3_dgc_adam.json` (decoupled momentum, sign step) with `decoupled_momentum.storage` "
             "= storage, and placement `host`: `decoupled_momentum.offload`.", "",
             "Two measurements: the extension's own accounting (`deepspeed_dgc.get_stats`: `state_bytes`, "
             "`host_state_bytes`, `peak_state_bytes`), and the tensors themselves: a dispatch mode follows every "
             "tensor the extension's code and ZeRO-3's own code make, from its creation until it is freed, and "
             "counts as host memory the ones that go through the accelerator's `pin_memory` (how both make host "
             "buffers). On this CPU-only machine device and host are the same memory: the split is where the code "
             "puts each tensor, not two memories measured apart. The rows of a topology run one after the other in "
             "the same processes: a cache the extension makes once per process (the DCT basis) counts in the first "
             "row that makes it.", "",
             "### Between steps", "",
             "| config | topology | storage | placement | ZeRO-3's own | committed state (`state_bytes`) | host "
             "memory (`host_state_bytes`) | extension's tensors on the device | on the host | device / stock's 16/W |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f, s = formula(row_of(r), r["W"], r["L"]), r["step"]
        lines.append(f"| {r['config']} | {r['topology']} | {_label(r)} | {r['zero3']:.3f} [{f['zero3']:.3f}] "
                     f"| {r['steady']:.3f} [{f['steady']:.3f}] | {r['host']:.3f} [{f['host']:.3f}] "
                     f"| {s['dgc_start']:.3f} [{f['device']:.3f}] | {s['dgc_host_start']:.3f} [{f['host']:.3f}] "
                     f"| {s['dgc_start'] / f['stock']:.2f}x |")
    lines += ["", "### Inside the last step", "",
              "ZeRO-3's own: the tensors DeepSpeed's code made (its partitions, master copies, Adam's moments and "
              "step, gathered parameters, gradient buckets; the model's activations and gradients are not in it), "
              "at the step's start and at their peak. The extension's: the state's peak by its accounting, then its "
              "tensors at their peak on the device and on the host, and what its tensors held at their peak (device "
              "and host together) beyond the state's peak, per parameter and per element of `reduce_bucket_size`.", "",
              "| config | topology | storage | placement | ZeRO-3's own at the start | ZeRO-3's own, peak | state's "
              "peak (`peak_state_bytes`) | extension's tensors, peak on the device | peak on the host | beyond the "
              "state's peak | beyond, B per bucket element |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f, s, i = formula(row_of(r), r["W"], r["L"]), r["step"], in_step(r)
        lines.append(f"| {r['config']} | {r['topology']} | {_label(r)} | {s['zero3_start']:.3f} | "
                     f"{s['zero3_peak']:.3f} | {r['peak']:.3f} [{f['peak']:.3f}] | {s['dgc_peak']:.3f} "
                     f"[{f['peak_device']:.3f}] | {s['dgc_host_peak']:.3f} [{f['peak_host']:.3f}] | {i['extra']:.3f} | "
                     f"{i['extra_per_bucket_element']:.2f} |")
    if refused:
        lines += ["", "Refused by the installed extension (not measured):", ""]
        by_reason: Dict[str, List[str]] = {}
        for r in refused:
            by_reason.setdefault(r["refusal"], []).append(f"{r['config']} {r['storage']} {r['placement']} on "
                                                         f"{r['topology']}")
        lines += [f"- {', '.join(names)}: {reason}" for reason, names in by_reason.items()]
    lines += ["", projection_markdown(), reading(rows, refused)]
    return "\n".join(lines) + "\n"


def projection_markdown() -> str:
    """ZeRO-3's own and the extension's state at 7B and 70B parameters, W = 8, 64, 512, flat and hierarchical with
    L = 8, from :func:`formula` (GB = 1e9 bytes per rank)."""
    P, Ws, L = PROJECTION["params"], PROJECTION["W"], PROJECTION["L"]
    size = lambda n: f"{n / 1e9:.0f}B"  # noqa: E731
    lines = [f"### Projected from the same formulas: {', '.join(size(n) for n in P)} parameters, W = "
             f"{', '.join(map(str, Ws))}, L = {L}", "",
             "ZeRO-3's own state per rank (GB): stock and `ef` hold 16/W bytes per parameter; `adam`'s sign step keeps "
             "no Adam moments, 8/W.", "", "| parameters | " + " | ".join(f"16/W, W = {W} | 8/W, W = {W}" for W in Ws)
             + " |", "|---|" + "---:|" * (2 * len(Ws))]
    for n in P:
        lines.append(f"| {size(n)} | " + " | ".join(f"{16 / W * n / 1e9:.2f} | {8 / W * n / 1e9:.2f}" for W in Ws)
                     + " |")
    Wl = ", ".join(map(str, Ws))
    lines += ["", "The extension's state per rank, which does not depend on W (a full-size residual or momentum per "
              "rank, flat; of the node-level sums, 1/L, hierarchical): bytes per parameter and GB on the device "
              "between steps, on the host (with the state on the host: two buffers per bucket's block, the committed "
              "one and the next window's), and the device's peak inside a step (the committed and the staged state; "
              "with the state on the host none of it, but a bucket or two at a time, which follows "
              "`reduce_bucket_size`). Then "
              "the device's share at W = " + Wl + ": between steps and at the peak against stock ZeRO-3's own 16/W, "
              "and between steps against the same job's ZeRO-3 state (16/W; 8/W for `adam`). The bucket path's own "
              "buffers (the measured tables' last columns) come on top of the device's peak.", "",
              "| config | topology | storage | placement | B/param: device, host, device peak | "
              + " | ".join(f"GB {size(n)}: device, host, device peak" for n in P)
              + f" | device / (16/W), W = {Wl} | device peak / (16/W) | device / ZeRO-3's own |",
              "|---|---|---|---|---|" + "---|" * len(P) + "---|---|---|"]
    for config in ("ef", "adam"):
        for topo, level in (("flat", None), (f"L = {L}", L)):
            for storage in STORAGES[config]:
                for placement in PLACEMENTS:
                    f = formula(Row(config, storage, placement), 64, level)
                    gb = " | ".join(f"{f['device'] * n / 1e9:.2f}, {f['host'] * n / 1e9:.2f}, "
                                    f"{f['peak_device'] * n / 1e9:.2f}" for n in P)
                    own = [formula(Row(config, storage, placement), W, level)["zero3"] for W in Ws]
                    ratios = (", ".join(f"{f['device'] / (16 / W):.2f}x" for W in Ws) + " | "
                              + ", ".join(f"{f['peak_device'] / (16 / W):.2f}x" for W in Ws) + " | "
                              + ", ".join(f"{f['device'] / z:.2f}x" for z in own))
                    lines.append(f"| {config} | {topo} | {storage} | {placement} | {f['device']:.3f}, "
                                 f"{f['host']:.3f}, {f['peak_device']:.3f} | {gb} | {ratios} |")
    lines += ["", floor_markdown()]
    return "\n".join(lines) + "\n"


def floor_markdown() -> str:
    """Issue 53's floor, from :func:`formula`: the recommended Adam method (``adam``) at W = 64, L = 8 on the device
    against stock ZeRO-3's own 16/W, and the flat job with its state on the host (bytes per parameter per rank)."""
    W, L = FLOOR["W"], FLOOR["L"]
    lines = [f"Issue 53's floor: `adam` at W = {W}, L = {L} holds at most stock ZeRO-3's own 16/W = {16 / W:.3f} B per "
             "parameter on the device; a flat job keeps its state on the host (bytes per parameter per rank):", "",
             f"| storage | L = {L}, device, between steps | / (16/W) | L = {L}, device, peak | / (16/W) | "
             "flat + host: device between steps | device peak | host |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for storage in STORAGES["adam"]:
        f = formula(Row("adam", storage, "device"), W, L)
        h = formula(Row("adam", storage, "host"), W, None)
        lines.append(f"| {storage} | {f['device']:.3f} | {f['device'] / f['stock']:.2f}x | {f['peak_device']:.3f} | "
                     f"{f['peak_device'] / f['stock']:.2f}x | {h['device']:.3f} | {h['peak_device']:.3f} | "
                     f"{h['host']:.3f} |")
    return "\n".join(lines) + "\n"


def floor_met() -> List[str]:
    """The ``adam`` storages that hold at most 16/W on the device between steps at the floor's W and L."""
    return [s for s in STORAGES["adam"] if formula(Row("adam", s, "device"), FLOOR["W"], FLOOR["L"])["device"]
            <= 16 / FLOOR["W"] + 1e-12]


def _span(values, fmt: str = ".2f") -> str:
    lo, hi = min(values), max(values)
    return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}} to {hi:{fmt}}"


def reading(rows: List[dict], refused: List[dict]) -> str:
    """What the measurement says, computed from the rows: the largest gap between the accounting and its formula,
    what the tensors hold beyond it, and where the peaks inside a step lie."""
    gaps = []
    for r in rows:
        f = formula(row_of(r), r["W"], r["L"])
        for key, measured in (("zero3", r["zero3"]), ("steady", r["steady"]), ("host", r["host"]),
                              ("peak", r["peak"]), ("host", r["step"]["dgc_host_start"])):
            gaps.append((abs(measured - f[key]) / f[key] if f[key] else abs(measured), key, r["name"], r["topology"]))
    worst = max(gaps)
    ext = [r for r in rows if r["config"] != "stock" and not r.get("bucket")]
    dev, host = ([r for r in ext if r["placement"] == p] for p in PLACEMENTS)
    over = lambda rs: [r["step"]["dgc_start"] - formula(row_of(r), r["W"], r["L"])["device"] for r in rs]  # noqa
    lines = ["### Reading", "",
             f"- The extension's accounting and the host tensors equal their formulas: the largest gap is "
             f"{100 * worst[0]:.2f}% ({worst[1]} of {worst[2]} on {worst[3]}; the formulas leave out the padding of "
             "the owner matrices and chunks). The state's peak is twice the committed state in every storage (the "
             "committed state and the staged copy of the window's last micro-step, in the storage form)."]
    if dev:
        lines.append(f"- On the device at a step's start the extension's tensors are the committed state plus "
                     f"{_span(over(dev), '.3f')} B per parameter (plans, the DCT basis, workspaces)"
                     + (f"; with the state on the host, none of the state but {_span(over(host), '.3f')} B per "
                        "parameter: the first bucket's block, fetched ahead of the step, and the same workspaces"
                        if host else "") + ".")
    if host and dev:
        peak = lambda rs: _span([r["step"]["dgc_peak"] for r in rs])  # noqa: E731
        lines.append(f"- Inside the step the device's peak of the extension's tensors is {peak(dev)} B per parameter"
                     f" with the state on the device and {peak(host)} "
                     "with it on the host, whose own peak stays at its two buffers: the blocks go to the device a "
                     "bucket at a time. On the CPU that device peak depends on timing (the write-backs and fetches run "
                     "on a thread, and a staged block stays until its copy is done), so it can differ between runs.")
    if ext:
        per_elem = [in_step(r)["extra_per_bucket_element"] for r in ext]
        extra = _span([in_step(r)["extra"] for r in ext])
        lines.append(f"- Beyond its state's peak the extension's tensors hold {extra} B per parameter here, "
                     f"{_span(per_elem, '.1f')} B per element of `reduce_bucket_size`: the bucket "
                     "path (owner matrices, payloads, decoded residuals or momenta, the storage's encoding) and small "
                     "workspaces. This model is under two buckets, so per parameter they look large; they follow the "
                     "bucket, not the model")
        halved = []
        for r in [r for r in rows if r.get("bucket")]:
            base = [b for b in ext if (b["config"], b["storage"], b["placement"], b["topology"]) ==
                    (r["config"], r["storage"], r["placement"], r["topology"])]
            if base:
                halved.append(f"{r['config']} ({r['storage']}) from {in_step(base[0])['extra']:.2f} to "
                              f"{in_step(r)['extra']:.2f}")
        if halved:
            lines[-1] += f": halving `reduce_bucket_size` takes {' and '.join(halved)} B per parameter"
        lines[-1] += (f". At DeepSpeed's default `reduce_bucket_size` of 5e8 elements they would be up to "
                      f"{max(per_elem) * 5e8 / 1e9:.1f} GB per rank on top of the projection's device peak, at this "
                      f"job's {bucket_elements({}):,} up to {max(per_elem) * bucket_elements({}) / 1e6:.1f} MB.")
    z_start = [r["step"]["zero3_start"] - r["zero3"] for r in rows]
    z_step = [r["step"]["zero3_peak"] - r["step"]["zero3_start"] for r in rows]
    lines += [f"- ZeRO-3's own tensors, counted the same way, are {_span(z_start)} B per parameter above its state's "
              "formula at the step's start (buffers DeepSpeed keeps between steps: its gradient bucket, and the "
              "gathered parameters, which a model this small keeps whole) and peak "
              f"{_span(z_step)} B per parameter above that inside the step (where looked into: Adam's step on the fp32 "
              "partitions, flat; stock's own reduce-scatter buffers in the backward, 2x2); DeepSpeed's bucket, "
              "prefetch and live-parameter settings bound those, or W shards them.",
              f"- Issue 53's floor (the table above): at W = {FLOOR['W']}, L = {FLOOR['L']} the storages "
              f"{', '.join(floor_met()) or 'none'} hold at most 16/W on the device between steps, and with the state "
              "on the host a flat job holds none of it on the device (the host then holds two buffers of it)."]
    if refused:
        lines.append(f"- {len(refused)} row{'s were' if len(refused) > 1 else ' was'} refused by the installed "
                     "extension and not measured (listed above); their projection is the formula's alone.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topologies", nargs="+", default=list(DEFAULT_TOPOLOGIES), choices=list(TOPOLOGIES))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--storages", nargs="+", choices=list(STORAGE_BYTES), help="only these storages (default: all)")
    ap.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    ap.add_argument("--no-bucket-check", action="store_true",
                    help="leave out the flat rows with half the reduce_bucket_size")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out-dir", type=Path, default=Path("runs/bench_memory"), help="logs and results.md")
    ap.add_argument("--json", type=Path, help="write the rows (bytes per parameter, every rank's records) here")
    ap.add_argument("--results", type=Path, help="write DIR/bench_memory.md")
    ap.add_argument("--master-port", type=int, default=29810, help="the first topology's; the next ones count up")
    ap.add_argument("--launch-timeout-s", type=float, default=900.0)
    ap.add_argument("--worker-config", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher passes it
    args = ap.parse_args(argv)
    if args.worker_config:
        worker(args)
        from deepspeed_dgc.comm.communicators import exit_without_finalization
        exit_without_finalization()  # gloo's teardown at exit can abort a rank whose record is written
    if args.steps < 3:
        ap.error("--steps must be >= 3 (the last step is measured from the state the earlier ones left; a block kept "
                 "on the host has its second host buffer from the second commit on)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows, refused = measured_rows(args)
    text = markdown(rows, refused, args)
    print(text)
    (args.out_dir / "results.md").write_text(text)
    command = ("OMP_NUM_THREADS=1 python -m benchmarks.bench_memory "
               + " ".join(argv if argv is not None else sys.argv[1:]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": command, "steps": args.steps, "rows": rows, "refused": refused},
                                        indent=1))
    if args.results:
        (args.results / "bench_memory.md").write_text(
            f"# Per-rank memory: the extension's state and ZeRO-3's own\n\n`{command}` (`make bench-memory`), "
            f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, {time.time() - t0:.0f} s.\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
