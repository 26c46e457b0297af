"""Worker: train a small odd-sized model with ZeRO-3 through deepspeed.initialize and save what happened.

Usage: engine_worker.py --out DIR [options]. The ds_config is BASE with ``--config JSON`` merged in (nested
objects key by key, ``"optimizer"`` replaced whole; a ``null`` removes the key); the inputs are in the engine's dtype (fp16 or bf16 when enabled).
Writes DIR/rank<r>.pt: losses, DeepSpeed's full gradients after the last micro-step and the fp32 parameters of
every step, skipped steps, loss scales, the extension's committed residuals and momenta, its telemetry, the
optimizer's settings, and with ``--local-grads`` each rank's own full local gradients (of the last micro-step, and of
every micro-step in ``local_grads_micro``).

Options:
  --model net|embed          Net (default) or EmbedNet (an embedding of which the inputs use a quarter of the rows)
  --steps N --gas G          optimizer steps and micro-steps per step (default 4 and 1)
  --inf-at STEP              rank 1's input holds Inf at that step (0-based), in every micro-step or in
  --inf-micro M              micro-step M only
  --allow-fp16               let DeepSpeed's CPU accelerator run fp16 (torch computes fp16 on any CPU)
  --lr-scheduler             wrap the owners' optimizer in a torch LambdaLR after initialize and at the end
  --ckpt DIR --save-at S     save a checkpoint after S steps (the run goes on)
  --ckpt DIR --resume-at S   load the latest checkpoint of DIR first, then run steps S..N-1
  --eval-only                forward passes only (no backward, no step): with ``"optimizer": null`` an engine
                             without an optimizer
  --freeze-at S              after S steps, l1.weight stops training (requires_grad False)
  --poison-padding           fill the padding of the fp32 master partitions with 1e30 after initialize: DeepSpeed
                             copies it into the parameter shards at every step and checkpoint load, and saves it
  --models-before K          build K other ZeRO-3 engines (stock) first, in this process: ZeRO-3 numbers the
                             parameters of every model a process builds (``ds_id``)
  --count-syncs              count deepspeed_dgc's host-synchronising tensor calls per step (deepspeed_dgc.syncs)
  --policy-script S          policy "auto": the k-th round of measurements agrees on S[k] ("s" stock, "c" compressed,
                             cycled) for every bucket, the ranks' own times disagreeing (the real exchanges still run)
  --fault die|hang|stop      rank 1 is killed, hangs, or stops (SIGSTOP) inside its reduce-scatter of step --fault-step (3);
                             rank 0 saves the error it got and when to DIR/rank0_error.pt and re-raises it
  --jobs JSON                a list of argument lists (the options above, without --out): each runs in turn in
                             this process, its records to DIR/rank<r>_<i>.pt (one launch for several cases)
"""

import argparse
import copy
import json
import os
import signal
import sys
import time

import torch
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

import deepspeed_dgc
from common import finish, init
from deepspeed_dgc.syncs import HostSyncCounter

BASE = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 1000000,
}


class Net(torch.nn.Module):
    """Odd sizes so partitions are padded: 24 -> 101 -> 37; weights above and below the bucket size."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(24, 101)
        self.ln = torch.nn.LayerNorm(101)
        self.l2 = torch.nn.Linear(101, 37)

    def forward(self, x, y):
        h = self.l2(self.ln(torch.nn.functional.gelu(self.l1(x))))
        return torch.nn.functional.mse_loss(h.float(), y.float())


class EmbedNet(torch.nn.Module):
    """An embedding of 64 rows of 12 (scale groups span rows) of which the inputs use only the first 16, then 12 -> 37."""

    USED_ROWS = 16

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 12)
        self.l2 = torch.nn.Linear(12, 37)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.l2(self.emb(x).mean(dim=1)).float(), y.float())


MODELS = {"net": Net, "embed": EmbedNet}


def merge(base, extra):
    """``extra`` merged into a copy of ``base``: nested dicts key by key (an ``"optimizer"`` is replaced whole),
    ``None`` removes a key."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict) and key != "optimizer":
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def make_engine(config, model="net"):
    torch.manual_seed(0)
    model = MODELS[model]()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def full_params(engine):
    """Every parameter's full fp32 master copy (None for a frozen one: DeepSpeed keeps no fp32 copy reachable)."""
    if not hasattr(engine.optimizer, "optimizer"):  # an engine without optimizer keeps no fp32 master copy
        return []
    values = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
    return [None if v is None else v.clone() for v in values]


def batches(rank, steps, micro, dtype, model="net"):
    gen = torch.Generator().manual_seed(100 + rank)

    def x():
        if model == "embed":  # token ids of the used rows only
            return torch.randint(0, EmbedNet.USED_ROWS, (4, 3), generator=gen)
        return torch.randn(4, 24, generator=gen).to(dtype)

    return [[(x(), torch.randn(4, 37, generator=gen).to(dtype)) for _ in range(micro)] for _ in range(steps)]


def dtype_of(cfg):
    if cfg.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.bfloat16 if cfg.get("bf16", {}).get("enabled") else torch.float32


def poison_padding(engine, rank):
    """1e30 in the padding of every parameter's fp32 master partition (which DeepSpeed allocates uninitialised):
    what a quantized all-gather must never take for a weight."""
    opt = engine.optimizer
    with torch.no_grad():
        for flat, params in zip(opt.fp32_partitioned_groups_flat, opt.fp16_groups):
            col = 0
            for p in params:
                shard = p.ds_tensor.ds_numel
                real = max(0, min(p.ds_numel - rank * shard, shard))
                flat[col + real:col + shard] = 1e30
                col += shard


def inject_fault(engine, kind, at_step, timeout_s, out_dir):
    """Rank 1 dies (SIGKILL), hangs, or is stopped (SIGSTOP) inside its reduce-scatter of optimizer step ``at_step``."""
    reducer = engine._dgc_state.reducer
    reduce_scatter = reducer.reduce_scatter

    def failing_reduce_scatter(*args, **kwargs):
        if engine.global_steps == at_step:
            with open(f"{out_dir}/failed_at", "w") as f:
                f.write(repr(time.time()))
            if kind == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "stop":  # frozen with its sockets open (rank 0 kills it once it has its error)
                with open(f"{out_dir}/stopped_pid", "w") as f:
                    f.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
            # hang until rank 0 has recorded the error it found by itself (at most timeout_s + 20 s), then leave
            deadline = time.time() + timeout_s + 20
            while time.time() < deadline and not os.path.exists(f"{out_dir}/rank0_error.pt"):
                time.sleep(0.2)
            time.sleep(2.0)
            os._exit(3)
        return reduce_scatter(*args, **kwargs)

    reducer.reduce_scatter = failing_reduce_scatter


def run(args, rank):
    cfg = merge(BASE, json.loads(args.config))
    cfg["gradient_accumulation_steps"] = args.gas
    if args.allow_fp16:
        get_accelerator().is_fp16_supported = lambda: True
    dtype = dtype_of(cfg)
    for _ in range(args.models_before):  # e.g. a reference or EMA model, an evaluation copy
        make_engine(merge(BASE, {"dgc": None}))
    engine = make_engine(cfg, args.model)
    if args.lr_scheduler:  # a torch LR scheduler wraps the owners' optimizer.step (needs a bound method)
        torch.optim.lr_scheduler.LambdaLR(engine.optimizer.optimizer, lambda s: 1.0)
    if args.poison_padding:
        poison_padding(engine, rank)
    if args.fault and rank == 1:
        inject_fault(engine, args.fault, args.fault_step, cfg["dgc"]["timeout_s"], args.out)
    if args.policy_script:
        script_policy(engine._dgc_state, args.policy_script, rank)
    first = 0
    if args.resume_at is not None:
        engine.load_checkpoint(args.ckpt)
        first = args.resume_at
    basic = getattr(engine.optimizer, "optimizer", None) or torch.optim.SGD([torch.zeros(1)], lr=0.0)
    state = getattr(engine, "_dgc_state", None)
    record = dict(losses=[], grads=[], params=[full_params(engine)], skipped=[], residuals=[], loss_scale=[],
                  local_grads=[], local_grads_micro=[], momenta=[], keys=[], stats=None,
                  loaded_residuals=None if state is None or args.resume_at is None else state.memory.residuals(),
                  optimizer=dict(type=type(basic).__name__, gradient_clipping=engine.gradient_clipping(),
                                 **{k: basic.param_groups[0].get(k) for k in ("lr", "betas", "eps", "weight_decay",
                                                                              "momentum")}))
    if state is not None:
        record["keys"] = [state.key_of(p) for p in engine.module.parameters()]
    local = {}
    if args.local_grads:  # this rank's full local gradient of every parameter
        for i, p in enumerate(engine.module.parameters()):
            p.register_hook(lambda g, i=i: local.__setitem__(i, g.detach().float().clone()))
    all_batches = batches(rank, args.steps, args.gas, dtype, args.model)
    syncs = HostSyncCounter().__enter__() if args.count_syncs else None
    if args.eval_only:
        with torch.no_grad():
            record["losses"] = [float(engine(x, y)) for micro in all_batches for x, y in micro]
        stats = deepspeed_dgc.get_stats(engine)
        record["stats"] = None if stats is None else stats.to_dict()
        record["optimizer_type"] = type(engine.optimizer).__name__
        return record
    try:
        for step in range(first, args.steps):
            for m, (x, y) in enumerate(all_batches[step]):
                if step == args.inf_at and rank == 1 and args.inf_micro in (None, m):
                    x = x.clone()
                    x[0, 0] = float("inf")
                loss = engine(x, y)
                engine.backward(loss)
                record["losses"].append(float(loss))
                if args.local_grads:  # every micro-step's (the hooks fire in each backward)
                    if m == 0:
                        record["local_grads_micro"].append([])
                    record["local_grads_micro"][-1].append([local[i].clone() for i in range(len(local))])
                if m == args.gas - 1:
                    grads = [safe_get_full_grad(p) for p in engine.module.parameters()]
                    record["grads"].append([None if g is None else g.float().clone() for g in grads])
                    if args.local_grads:
                        record["local_grads"].append([local[i] for i in range(len(local))])
                engine.step()
            if syncs is not None:  # before the test's own read-backs below
                record.setdefault("host_syncs", []).append(
                    {f"{site} {name}": n for (site, name), n in syncs.take_sites().items()})
            record["params"].append(full_params(engine))
            record["skipped"].append(engine.skipped_steps)
            record["loss_scale"].append(float(engine.optimizer.loss_scale))
            if state is not None:
                record.setdefault("state_bytes", []).append(state.stats.state_bytes)
                record.setdefault("density", []).append(state.stats.last.density)
                record["residuals"].append(state.memory.residuals())
                if state.momentum is not None:
                    record["momenta"].append({k: v.clone() for k, v in state.momentum.momenta().items()})
            if args.freeze_at is not None and step + 1 == args.freeze_at:
                engine.module.l1.weight.requires_grad_(False)
            if args.save_at is not None and step + 1 == args.save_at:
                engine.save_checkpoint(args.ckpt)
            if syncs is not None:
                syncs.take()  # the read-backs of this worker's records above are not the training step's
    except Exception as err:
        if args.fault:
            torch.save(dict(error=f"{type(err).__name__}: {err}", at=time.time()), f"{args.out}/rank{rank}_error.pt")
            if os.path.exists(f"{args.out}/stopped_pid"):  # the stopped peer never ends by itself
                os.kill(int(open(f"{args.out}/stopped_pid").read()), signal.SIGKILL)
        raise
    if syncs is not None:
        syncs.__exit__(None, None, None)
    if args.lr_scheduler:  # after a freeze of compressed momentum the owners' step is replaced: still bound
        torch.optim.lr_scheduler.LambdaLR(engine.optimizer.optimizer, lambda s: 1.0)
    stats = deepspeed_dgc.get_stats(engine)
    record["stats"] = None if stats is None else stats.to_dict()
    if state is not None and state.momentum is not None:
        record["frozen"] = bool(getattr(state.momentum, "frozen", False))
    record["residual_storage"] = None if state is None else state.memory.storage
    record["timeout_s"] = None if state is None else state.cfg.timeout_s
    return record


def script_policy(state, script: str, rank: int) -> None:
    """The measurements of ``state.policy`` (a LinkPolicy) at applied step t agree on ``script[(t // interval) % len]``
    for every bucket and gather: each timed run still runs, but its time is replaced by a scripted one before the
    ranks agree. Rank 1's times alone would choose the other way; rank 0's make the largest over the ranks choose as
    scripted. "c": compressed (rank 0: stock 3 s, compressed 0.5 s; rank 1: 1 s and 2 s; the maxima: 3 s and 2 s);
    "s": stock (the same, swapped); "C": compressed by far (rank 0: stock 10 s, compressed 0.5 s; rank 1: 1 s and 2 s),
    so that after the first run stock is more than twice as slow by the agreed times but not by rank 1's own."""
    policy = state.policy
    measured = policy._timed
    times = {"c": ([3.0, 0.5], [1.0, 2.0]), "s": ([0.5, 3.0], [2.0, 1.0]), "C": ([10.0, 0.5], [1.0, 2.0])}

    def scripted(option, fn, device):
        measured(option, fn, device)  # the real exchange runs
        want = script[(state.reducer.steps_applied // policy.interval) % len(script)]
        return times[want][rank == 1][option]

    policy._timed = scripted


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="{}", help="JSON merged into BASE")
    ap.add_argument("--model", choices=sorted(MODELS), default="net")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gas", type=int, default=1)
    ap.add_argument("--inf-at", type=int, default=None)
    ap.add_argument("--inf-micro", type=int, default=None)
    ap.add_argument("--allow-fp16", action="store_true")
    ap.add_argument("--local-grads", action="store_true")
    ap.add_argument("--lr-scheduler", action="store_true")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--save-at", type=int, default=None)
    ap.add_argument("--resume-at", type=int, default=None)
    ap.add_argument("--models-before", type=int, default=0)
    ap.add_argument("--freeze-at", type=int, default=None)
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--poison-padding", action="store_true")
    ap.add_argument("--count-syncs", action="store_true")
    ap.add_argument("--policy-script", default=None)
    ap.add_argument("--fault", choices=["die", "hang", "stop"], default=None)
    ap.add_argument("--fault-step", type=int, default=3)
    ap.add_argument("--jobs", default=None)
    args = ap.parse_args(argv)
    rank = init()
    if args.jobs is None:
        torch.save(run(args, rank), f"{args.out}/rank{rank}.pt")
    for i, job in enumerate(json.loads(args.jobs or "[]")):
        torch.save(run(ap.parse_args(["--out", args.out, *job]), rank), f"{args.out}/rank{rank}_{i}.pt")
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
