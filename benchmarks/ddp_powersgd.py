"""The main job's model trained with PyTorch DDP and the PowerSGD communication hook.

What a user would pick instead of ZeRO-3 for data parallelism on a slow link: every rank holds
the whole model and optimizer, and the gradient all-reduce is replaced by PowerSGD's low-rank
approximation with error feedback (Vogels et al., NeurIPS 2019). Same model, data, seed,
optimizer (Adam), learning-rate warm-up and gradient clipping as ``examples/train_char_gpt.py``
with ``configs/zero3_p0_baseline.json``; it writes the same summary fields that
``benchmarks/bench_network.py`` reads. Launch with 2 ranks (gloo), e.g.::

    deepspeed --num_gpus 2 --module benchmarks.ddp_powersgd --max-steps 20

DDP runs with one large bucket: with the default buckets the hook crashed on gloo (a collective
size mismatch between ranks).
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from deepspeed_dgc.comm.communicators import exit_without_finalization
from examples import train_char_gpt as job  # the model, data and evaluation of the main job


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--summary-json", type=Path)
    parser.add_argument("--holdout-eval", action="store_true", help="as in train_char_gpt.py")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--warmup-steps", type=int, default=30, help="linear learning-rate warm-up from 0")
    parser.add_argument("--rank-approx", type=int, default=4, help="PowerSGD matrix_approximation_rank")
    parser.add_argument("--start-iter", type=int, default=2,
                        help="PowerSGD start_powerSGD_iter: plain all-reduce before this step (>= 2 with error feedback)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--net-iface", metavar="IFACE", help="as in train_char_gpt.py")
    args = parser.parse_args()
    if min(args.max_steps, args.eval_interval, args.eval_batches, args.micro_batch, args.rank_approx) < 1:
        parser.error("--max-steps, --eval-interval, --eval-batches, --micro-batch and --rank-approx must be >= 1")
    if args.start_iter < 2:
        parser.error("--start-iter must be >= 2 (PowerSGD's error feedback and warm start need it)")
    return args


class _Evaluated:
    """Adapter so that train_char_gpt.evaluate (written for a DeepSpeed engine) runs the DDP model."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, x, y):
        return self.model(x, y)

    def eval(self):
        self.model.eval()

    def train(self):
        self.model.train()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    train_data, val_data, vocab_size = job.load_data()
    torch.manual_seed(args.seed)
    model = job.CharGPT(vocab_size, args.block_size, args.n_layer, args.n_embd, args.n_head)
    n_params = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(model, bucket_cap_mb=4096)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank_approx,
                                        start_powerSGD_iter=args.start_iter, min_compression_rate=2,
                                        use_error_feedback=True, warm_start=True, random_seed=args.seed)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr, betas=(0.9, 0.99), eps=1e-8)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: min(1.0, it / args.warmup_steps))

    val_gen = torch.Generator().manual_seed(args.seed)
    val_batches = [job.get_batch(val_data, args.micro_batch, args.block_size, val_gen) for _ in range(args.eval_batches)]
    train_gen = torch.Generator().manual_seed(args.seed + rank)
    tx_counter = job.net_tx_path(args.net_iface) if args.net_iface and is_main else None
    val_losses, step_times_s, step_net_tx_bytes, train_losses = [], [], [], []
    start = time.perf_counter()
    for step in range(1, args.max_steps + 1):
        step_start = time.perf_counter()
        tx_start = int(tx_counter.read_text()) if tx_counter else 0
        x, y = job.get_batch(train_data, args.micro_batch, args.block_size, train_gen)
        loss = ddp(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        train_losses.append(job.all_reduce_mean(loss.item(), world))
        step_times_s.append(time.perf_counter() - step_start)
        if tx_counter:
            step_net_tx_bytes.append(int(tx_counter.read_text()) - tx_start)
        if step % args.eval_interval == 0 or step == args.max_steps:
            val_losses.append([step, job.evaluate(_Evaluated(ddp.module), val_batches, torch.device("cpu"))])
            if is_main:
                print(f"step {step} | train {train_losses[-1]:.4f} | val {val_losses[-1][1]:.4f}", flush=True)
    wall_s = time.perf_counter() - start  # training and evaluations, not the holdout evaluation
    holdout = job.holdout_batches(val_data, args.micro_batch, args.block_size) if args.holdout_eval else []
    holdout_val_loss = job.evaluate(_Evaluated(ddp.module), holdout, torch.device("cpu")) if holdout else None
    if is_main:
        summary = {
            "config": "ddp_powersgd",
            "dgc": None,
            "seed": args.seed,
            "world_size": world,
            "n_params": n_params,
            "steps": args.max_steps,
            "final_val_loss": val_losses[-1][1],
            "holdout_val_loss": holdout_val_loss,
            "holdout_tokens": sum(y.numel() for _, y in holdout),
            "final_train_loss": sum(train_losses[-job.TRAIN_LOSS_WINDOW:]) / len(train_losses[-job.TRAIN_LOSS_WINDOW:]),
            "val_losses": val_losses,
            "wall_s": wall_s,
            "step_times_s": step_times_s,
            "net_iface": args.net_iface,
            "step_net_tx_bytes": step_net_tx_bytes if args.net_iface else None,
            "grad_wire_bytes_total": None,
            "param_wire_bytes_total": None,
            "powersgd": {"matrix_approximation_rank": args.rank_approx, "start_powerSGD_iter": args.start_iter},
        }
        if args.summary_json:
            args.summary_json.parent.mkdir(parents=True, exist_ok=True)
            args.summary_json.write_text(json.dumps(summary, indent=2) + "\n")
        print("SUMMARY " + json.dumps(summary), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalization()  # gloo's teardown at exit can abort a finished rank
