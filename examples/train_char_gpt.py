"""Character-level GPT on tiny Shakespeare, trained with DeepSpeed ZeRO-3 (+ optional DGC).

Launch from the repository root, e.g.::

    deepspeed --num_gpus 2 examples/train_char_gpt.py --deepspeed_config configs/zero3_dgc_int4.json

The ``"dgc"`` section of the DeepSpeed config (if any) is read by the ``deepspeed_dgc``
extension, which is activated by importing it. Rank 0 prints a final ``SUMMARY {json}`` line
and optionally writes the same JSON to ``--summary-json``.
"""

import argparse
import cProfile
import datetime
import io
import json
import math
import os
import pstats
import subprocess
import sys
import time
import traceback
from collections import Counter, deque
from pathlib import Path
from typing import NoReturn

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

try:
    import deepspeed_dgc  # importing activates the DGC extension for deepspeed.initialize
    from deepspeed_dgc.comm.communicators import exit_without_finalization
    from deepspeed_dgc.syncs import HostSyncCounter
except ImportError as exc:
    sys.exit(f"train_char_gpt.py: cannot import deepspeed_dgc ({exc}). "
             "Install it from the repository root with `pip install -e .`.")

DATA_PATH = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"
TRAIN_LOSS_WINDOW = 10  # final_train_loss = mean of the last this-many logged train losses


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) float -> (B, T, C) float."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, C // n_head)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) float -> (B, T, C) float."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """Small decoder-only transformer over a character vocabulary."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_embd: int, n_head: int):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-character cross-entropy (nats).

        idx, targets: (B, T) int64 token ids with T <= block_size; targets[b, t] is the token
        following idx[b, t]. Returns a scalar float loss.
        """
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.blocks(self.tok_emb(idx) + self.pos_emb(pos))
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab_size)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def load_data() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Encode the corpus with a sorted-character vocabulary.

    Returns (train, val, vocab_size): 1-D int64 token tensors holding the first 90% and the
    last 10% of the text.
    """
    text = DATA_PATH.read_text(encoding="utf-8")
    stoi = {ch: i for i, ch in enumerate(sorted(set(text)))}
    data = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)
    n_train = int(0.9 * len(data))
    return data[:n_train], data[n_train:], len(stoi)


def get_batch(data: torch.Tensor, batch_size: int, block_size: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``data``: returns (x, y), each (batch_size, block_size) int64, y = x shifted by one."""
    starts = torch.randint(len(data) - block_size, (batch_size, ), generator=generator)
    x = torch.stack([data[s:s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts.tolist()])
    return x, y


def all_reduce_mean(value: float, world_size: int, device=None) -> float:
    """Mean of a Python float over all ranks (collective), reduced on ``device`` (the engine's: NCCL reduces only
    device tensors)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / world_size


def holdout_batches(data: torch.Tensor, batch_size: int,
                    block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole of ``data`` as consecutive, non-overlapping windows, in full batches.

    Returns a list of (x, y), each (batch_size, block_size) int64 with y = x shifted by one: window i starts at
    token i * block_size; the windows that do not fill a last batch are left out (fewer than batch_size windows).
    Raises ValueError when ``data`` holds less than one full batch.
    """
    windows = (len(data) - 1) // block_size
    n_batches = windows // batch_size
    if n_batches < 1:
        raise ValueError(f"holdout_batches: {len(data)} tokens hold {windows} windows of {block_size}, "
                         f"fewer than one batch of {batch_size}")
    used = n_batches * batch_size * block_size
    x = data[:used].view(n_batches, batch_size, block_size)
    y = data[1:used + 1].view(n_batches, batch_size, block_size)
    return list(zip(x.unbind(0), y.unbind(0)))


@torch.no_grad()
def evaluate(engine, val_batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """Mean loss over the fixed validation batches, sharded round-robin over the ranks (collective).

    Every rank runs the same number of forward passes, as ZeRO-3 forward gathers parameters
    collectively; a rank short of batches repeats batch 0 and discards the result.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = val_batches[rank::world]
    loss_sum = 0.0
    engine.eval()
    for i in range(math.ceil(len(val_batches) / world)):
        x, y = shard[i] if i < len(shard) else val_batches[0]
        loss = engine(x.to(device), y.to(device)).item()
        if i < len(shard):
            loss_sum += loss
    engine.train()
    totals = torch.tensor([loss_sum, float(len(shard))], dtype=torch.float64, device=device)  # NCCL: device tensors
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def write_profile(profiler: "cProfile.Profile", prefix: Path, rank: int) -> None:
    """Write ``prefix.rankR.prof`` (pstats, for snakeviz or ``python -m pstats``) and ``prefix.rankR.txt`` (the 40
    functions with the most own time, then the 40 with the most cumulative time)."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    base = f"{prefix}.rank{rank}"
    profiler.dump_stats(base + ".prof")
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    Path(base + ".txt").write_text(text.getvalue())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--max-steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--eval-interval", type=int, default=50, help="evaluate every this many steps")
    parser.add_argument("--eval-batches", type=int, default=8, help="validation batches per evaluation, each of one "
                        "optimizer step's sequences per rank (micro-batch x gradient accumulation)")
    parser.add_argument("--summary-json", type=Path, help="rank 0 writes the run summary here")
    parser.add_argument("--holdout-eval", action="store_true",
                        help="after the last step, also evaluate on the whole validation split (consecutive "
                        "windows, holdout_batches) and put it in the summary as holdout_val_loss")
    parser.add_argument("--lr", type=float, help="override the ds_config optimizer (and scheduler) learning rate")
    parser.add_argument("--save-dir", type=Path, help="save a DeepSpeed checkpoint here (with the DGC side-car)")
    parser.add_argument("--save-interval", type=int, default=0,
                        help="steps between checkpoints in --save-dir (0: only after the last step)")
    parser.add_argument("--resume-from", type=Path, help="checkpoint directory to resume from (its 'latest' tag)")
    parser.add_argument("--dgc-set", action="append", default=[], metavar="KEY=JSON",
                        help="override one key of the config's \"dgc\" section, e.g. --dgc-set comm_backend='\"mpi\"' "
                        "or --dgc-set ranks_per_node=2, or one key of a section: --dgc-set "
                        "decoupled_momentum.storage='\"int8\"' (repeatable; the value is JSON)")
    parser.add_argument("--count-host-syncs", action="store_true",
                        help="count deepspeed_dgc's host-synchronising tensor calls per step (deepspeed_dgc.syncs) and "
                        "put them in the summary (the Python path a GPU runs: use with --dgc-set kernels='\"reference\"')")
    parser.add_argument("--profile-step", type=int, metavar="N",
                        help="run step N under cProfile on every rank (every rank, so that none waits on a slowed one) "
                        "and write rank R's profile to --profile-out.rankR.prof and its top functions to "
                        "--profile-out.rankR.txt")
    parser.add_argument("--profile-out", type=Path, default=Path("runs/profile/step"),
                        help="path prefix of the --profile-step files")
    parser.add_argument("--step-log", type=Path, metavar="PREFIX",
                        help="every rank R appends one JSON line per step to PREFIX.rankR.jsonl (after the step's "
                        "checkpoint, if any): the step, the mean train loss, this rank's resident memory (VmRSS) and "
                        "the extension's state bytes (benchmarks/soak.py)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64, help="context length in characters")
    parser.add_argument("--net-iface", metavar="IFACE",
                        help="record the bytes sent on this network interface during each step (rank 0 reads "
                        "/sys/class/net/IFACE/statistics/tx_bytes; all ranks' traffic where they share the interface)")
    parser.add_argument("--net-tc-classes", metavar="CLASSES",
                        help="record instead the bytes these comma-separated tc classes of lo sent during each step "
                        "(rank 0 runs tc -s class show; e.g. the shaped path between two nodes, "
                        "benchmarks/two_nodes.py)")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if not args.deepspeed_config:
        parser.error("--deepspeed_config is required")
    if args.max_steps < 1 or args.eval_interval < 1 or args.eval_batches < 1 or args.save_interval < 0:
        parser.error("--max-steps, --eval-interval and --eval-batches must be >= 1, --save-interval >= 0")
    if args.profile_step is not None and not 1 <= args.profile_step <= args.max_steps:
        parser.error(f"--profile-step {args.profile_step}: not a step of this run (1..{args.max_steps})")
    if args.net_iface and not net_tx_path(args.net_iface).is_file():
        parser.error(f"--net-iface {args.net_iface}: no {net_tx_path(args.net_iface)}")
    if args.resume_from and not (args.resume_from / "latest").is_file():
        parser.error(f"--resume-from {args.resume_from}: no DeepSpeed checkpoint there (no 'latest' file)")
    return args


def tc_class_bytes(classes: list[str], dev: str = "lo", netns: str | None = None) -> dict[str, int]:
    """Bytes each of these tc classes (``"1:20"``) of ``dev`` has sent so far (``tc -s class show``, in network
    namespace ``netns`` when given); 0 for a class that is not there."""
    cmd = ["tc"] + (["-n", netns] if netns else []) + ["-s", "class", "show", "dev", dev]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    out, current = {c: 0 for c in classes}, None
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["class"] and len(words) > 2:
            current = words[2] if words[2] in out else None
        elif words[:1] == ["Sent"] and current is not None:
            out[current], current = int(words[1]), None
    return out


def resident_bytes() -> int:
    """This process's resident memory (VmRSS of /proc/self/status), bytes; 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def net_tx_path(iface: str) -> Path:
    """The kernel's counter of bytes sent on ``iface`` (Linux sysfs)."""
    return Path("/sys/class/net") / iface / "statistics" / "tx_bytes"


def load_ds_config(path: str, lr: float | None, dgc_overrides=()) -> dict:
    """Read the DeepSpeed JSON config; ``lr`` (if given) replaces the optimizer lr and the
    scheduler's peak lr (``warmup_max_lr``); each ``KEY=JSON`` of ``dgc_overrides`` sets
    ``config["dgc"][KEY]`` (validated by deepspeed_dgc at initialize like any other key); a dotted KEY sets a key of a
    section and keeps its other keys (``decoupled_momentum.storage='"int8"'``), where a section given whole
    (``decoupled_momentum='{...}'``) replaces it."""
    overrides = {}
    for item in dgc_overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--dgc-set expects KEY=JSON, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            hint = (f"strings need quotes: {key}='\"{value}\"'" if not value.lstrip().startswith(("{", "["))
                    else "an object's strings need quotes, as JSON's do")
            raise SystemExit(f"--dgc-set {key}: {value!r} is not JSON ({hint})") from None
    try:  # JSON, a key given twice refused as DeepSpeed refuses it; hjson (comments, ...) where the file is not JSON
        config = deepspeed_dgc.read_ds_config(path)
    except (OSError, ValueError) as err:
        raise SystemExit(f"--deepspeed_config {path}: {err}") from None
    if lr is not None:
        config["optimizer"]["params"]["lr"] = lr
        scheduler_params = config.get("scheduler", {}).get("params", {})
        if "warmup_max_lr" in scheduler_params:
            scheduler_params["warmup_max_lr"] = lr
    for key, value in overrides.items():
        *sections, leaf = key.split(".")
        node = config.setdefault("dgc", {})
        for name in sections:
            child = node.get(name)
            if child is None:
                child = node[name] = {}
            if not isinstance(child, dict):
                raise SystemExit(f"--dgc-set {key}: 'dgc.{name}' is {child!r}, not a section")
            node = child
        node[leaf] = value
    return config


def under_mpirun() -> bool:
    """Whether mpirun (Open MPI's, or a PMI launcher's) started this process."""
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


def abort_mpi_job() -> NoReturn:
    """End every rank of the MPI job at once (no rank left waiting in ``MPI_Finalize`` or a collective)."""
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(1)


def refuse(err: Exception) -> NoReturn:
    """End this rank on a config the extension refuses (every rank refuses it: the ranks agree on the section
    first): ``DGCConfigError: <what is wrong, naming the key>`` on one line instead of a traceback, exit status 1;
    under mpirun the job is aborted, as for an uncaught exception."""
    print(f"{type(err).__name__}: {err}", file=sys.__stderr__, flush=True)
    if under_mpirun():
        abort_mpi_job()
    raise SystemExit(1)


def abort_mpi_job_on_uncaught_exception() -> None:
    """Under mpirun, make an uncaught exception on one rank end the whole job.

    Otherwise the failing rank waits in ``MPI_Finalize`` at exit while the others wait for it in
    a collective: a hang instead of an error. The traceback goes straight to ``sys.__stderr__``:
    torch's ``init_process_group`` wraps ``sys.excepthook`` and buffers what the wrapped hook
    prints until it returns, which ``Abort`` never does (so ``python -m mpi4py`` loses the message).
    """
    if not under_mpirun():
        return

    def hook(exc_type, exc, tb):
        traceback.print_exception(exc_type, exc, tb, file=sys.__stderr__)
        sys.__stderr__.flush()
        abort_mpi_job()

    sys.excepthook = hook


def main() -> None:
    abort_mpi_job_on_uncaught_exception()
    args = parse_args()
    ds_config = load_ds_config(args.deepspeed_config, args.lr, args.dgc_set)
    if args.summary_json:  # fail now, not after training, if the summary cannot be written there
        args.summary_json.parent.mkdir(parents=True, exist_ok=True)

    # a dgc.timeout_s that is set bounds DeepSpeed's own collectives too, so that a hung peer ends the job after it
    # wherever the others wait; unset, the extension takes the process groups' own timeouts
    try:
        dgc = deepspeed_dgc.parse_dgc_config(ds_config)
    except deepspeed_dgc.DGCConfigError as err:
        refuse(err)
    if dgc is not None and dgc.enabled and dgc.timeout_s is not None:
        deepspeed.init_distributed(timeout=datetime.timedelta(seconds=dgc.timeout_s))
    else:
        deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    print(f"rank {rank} of {world} (local rank {os.environ.get('LOCAL_RANK', '?')}, "
          f"master {os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')})", flush=True)

    train_data, val_data, vocab_size = load_data()
    torch.manual_seed(args.seed)  # identical initialisation on every rank
    model = CharGPT(vocab_size, args.block_size, args.n_layer, args.n_embd, args.n_head)
    param_numels = [p.numel() for p in model.parameters()]  # counted before ZeRO-3 partitions them
    n_params = sum(param_numels)
    if is_main:
        print(f"model: {n_params:,} parameters, vocab {vocab_size}, world size {world}", flush=True)

    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    except deepspeed_dgc.DGCConfigError as err:
        refuse(err)
    device = engine.device
    batch_size = engine.train_micro_batch_size_per_gpu()
    grad_accum = engine.gradient_accumulation_steps()
    if is_main:  # whether compression is on, and how, in the log of every run (DeepSpeed's logger is at WARNING)
        active = deepspeed_dgc.get_stats(engine)
        print("deepspeed_dgc: " + ("off: stock ZeRO-3 reduce-scatter" if active is None else
                                   f"on ({active.kernels} kernels), 'dgc' = {json.dumps(ds_config['dgc'])}"), flush=True)

    val_gen = torch.Generator().manual_seed(args.seed)  # same validation set on every rank
    # batches of one optimizer step's sequences per rank (micro-batch x accumulation): runs that split the same
    # batch into other micro-batches score the same validation set
    eval_batch = batch_size * grad_accum
    val_batches = [get_batch(val_data, eval_batch, args.block_size, val_gen) for _ in range(args.eval_batches)]
    train_gen = torch.Generator().manual_seed(args.seed + rank)  # different training batches per rank

    recent_train = deque(maxlen=TRAIN_LOSS_WINDOW)
    val_losses = []
    first_step = 1
    if args.resume_from:
        load_path, client_state = engine.load_checkpoint(str(args.resume_from))
        if load_path is None:
            raise RuntimeError(f"could not load a checkpoint from {args.resume_from}")
        train_gen.set_state(client_state["train_gen_state"])  # this rank's data order continues
        recent_train.extend(client_state["recent_train"])
        val_losses = client_state["val_losses"]
        first_step = client_state["step"] + 1
        if args.profile_step is not None and args.profile_step < first_step:
            raise SystemExit(f"--profile-step {args.profile_step}: the run resumes at step {first_step}, so that step "
                             "never runs")
    train_loss = val_loss = float("nan")
    progress = tqdm(total=args.max_steps, initial=first_step - 1, disable=not is_main, dynamic_ncols=True)
    step_times_s, step_net_tx_bytes = [], []  # per step: training only (no evaluation, no checkpoint)
    if not is_main:
        read_tx = None
    elif args.net_tc_classes:
        classes = args.net_tc_classes.split(",")

        def read_tx() -> int:
            return sum(tc_class_bytes(classes).values())
    elif args.net_iface:
        def read_tx() -> int:
            return int(net_tx_path(args.net_iface).read_text())
    else:
        read_tx = None
    step_log = None
    if args.step_log:  # appended to: a resumed run goes on in the same file
        args.step_log.parent.mkdir(parents=True, exist_ok=True)
        step_log = open(f"{args.step_log}.rank{rank}.jsonl", "a")
    syncs = HostSyncCounter().__enter__() if args.count_host_syncs else None
    host_syncs, host_sync_sites = [], Counter()
    start = time.perf_counter()
    for step in range(first_step, args.max_steps + 1):
        tx_start = read_tx() if read_tx else 0  # before the clock starts (tc takes milliseconds)
        profiler = cProfile.Profile() if step == args.profile_step else None
        if profiler:
            profiler.enable()
        step_start = time.perf_counter()
        micro_losses = []
        for _ in range(grad_accum):
            x, y = get_batch(train_data, batch_size, args.block_size, train_gen)
            loss = engine(x.to(device), y.to(device))
            engine.backward(loss)
            engine.step()
            micro_losses.append(loss.item())
        if syncs is not None:  # this step's (the loss read-back below is the script's, not the extension's)
            sites = syncs.take_sites()
            host_syncs.append(sum(sites.values()))
            if step > 2:
                host_sync_sites.update(sites)
        # also a barrier: the step ended everywhere
        train_loss = all_reduce_mean(sum(micro_losses) / grad_accum, world, device)
        step_times_s.append(time.perf_counter() - step_start)
        if profiler:
            profiler.disable()
            write_profile(profiler, args.profile_out, dist.get_rank())
        if read_tx:
            step_net_tx_bytes.append(read_tx() - tx_start)
        recent_train.append(train_loss)
        if step % args.eval_interval == 0 or step == args.max_steps:
            val_loss = evaluate(engine, val_batches, device)
            val_losses.append([step, val_loss])
            if is_main:  # tqdm.write prints even when the bar is disabled
                progress.write(f"step {step} | train {train_loss:.4f} | val {val_loss:.4f}")
        progress.set_postfix(train=f"{train_loss:.4f}", val="-" if math.isnan(val_loss) else f"{val_loss:.4f}")
        progress.update()
        if args.save_dir and (step == args.max_steps or (args.save_interval and step % args.save_interval == 0)):
            engine.save_checkpoint(str(args.save_dir),
                                   client_state={
                                       "step": step,
                                       "train_gen_state": train_gen.get_state(),
                                       "recent_train": list(recent_train),
                                       "val_losses": val_losses,
                                   })
        if step_log is not None:  # one write of one line, after the checkpoint: a kill leaves whole lines
            dgc_stats = deepspeed_dgc.get_stats(engine)
            step_log.write(json.dumps({"step": step, "rank": rank, "pid": os.getpid(), "time": time.time(),
                                       "loss": train_loss, "rss_bytes": resident_bytes(),
                                       "state_bytes": None if dgc_stats is None else dgc_stats.state_bytes}) + "\n")
            step_log.flush()
    wall_s = time.perf_counter() - start  # training loop incl. evaluations (and checkpoints, if any)
    if syncs is not None:
        syncs.__exit__(None, None, None)
    if step_log is not None:
        step_log.close()
    progress.close()
    final_val_loss = val_losses[-1][1]  # evaluated after the last step
    holdout = holdout_batches(val_data, eval_batch, args.block_size) if args.holdout_eval else []
    holdout_val_loss = evaluate(engine, holdout, device) if holdout else None

    stats = deepspeed_dgc.get_stats(engine)
    if stats is None:
        # Stock ZeRO-3: every micro-step reduce-scatters all fp32 gradients; this rank sends
        # (world - 1) / world of them.
        dense = round(args.max_steps * grad_accum * (world - 1) / world * n_params * 4)
        wire, dense_fp32, ratio = dense, dense, 1.0
    else:
        wire, dense_fp32, ratio = stats.wire_bytes_total, stats.dense_fp32_bytes_total, stats.compression_ratio

    if is_main:
        summary = {
            "config": args.deepspeed_config,
            "dgc": ds_config.get("dgc"),
            "seed": args.seed,
            "world_size": world,
            "n_params": n_params,
            "param_numels": param_numels,
            "steps": args.max_steps,
            "final_val_loss": final_val_loss,
            # the whole validation split after the last step (--holdout-eval), and the tokens it scored
            "holdout_val_loss": holdout_val_loss,
            "holdout_tokens": sum(y.numel() for _, y in holdout),
            "final_train_loss": sum(recent_train) / len(recent_train),
            "val_losses": val_losses,
            "wall_s": wall_s,
            "step_times_s": step_times_s,
            "net_iface": args.net_iface,
            "net_tc_classes": args.net_tc_classes,
            "step_net_tx_bytes": step_net_tx_bytes if read_tx else None,
            "wire_bytes_total": wire,
            "dense_fp32_bytes_total": dense_fp32,
            "compression_ratio": ratio,
            "skipped_steps": engine.skipped_steps,
            "dgc_stats": None if stats is None else stats.to_dict(),
            "dgc_kernels": None if stats is None else stats.kernels,
            "state_bytes_per_param": None if stats is None else stats.state_bytes_per_param,
            "bits_per_kept_element": None if stats is None else stats.bits_per_kept_element,
            # gradient and parameter traffic apart (None where stock DeepSpeed ran without the seam)
            "grad_wire_bytes_total": wire,
            "grad_dense_fp32_bytes_total": dense_fp32,
            "param_wire_bytes_total": None if stats is None else stats.param_wire_bytes_total,
            "param_dense_fp32_bytes_total": None if stats is None else round(stats.param_dense_fp32_bytes_total),
            "param_uncovered_bytes_total": None if stats is None else stats.param_uncovered_bytes_total,
        }
        if syncs is not None:  # per step; and by call site over the steps after step 2
            summary["host_syncs_per_step"] = host_syncs
            summary["host_sync_sites_after_step_2"] = {f"{site} {name}": n for (site, name), n in
                                                       host_sync_sites.most_common()}
        if args.summary_json:
            args.summary_json.write_text(json.dumps(summary, indent=2) + "\n")
        print("SUMMARY " + json.dumps(summary), flush=True)
    # every rank is done before any tears its process groups down (exiting with gloo's threads still up can abort
    # a process: "terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalization()
