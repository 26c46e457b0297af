"""What the Hugging Face examples share (``hf_trainer_gpt2.py``, the Trainer; ``accelerate_gpt2.py``, Accelerate): the
data (random character blocks of the shipped Shakespeare text), the model (a small GPT-2 built from its config, random
initialization, nothing downloaded), the DeepSpeed config (the file, or the same without its ``"dgc"`` section for a
stock run) and the one line rank 0 prints at the end, ``DGC_TELEMETRY {json}``.
"""

import argparse
import json
import os
from pathlib import Path

import torch

import deepspeed_dgc

DATA_PATH = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"
FINAL_WINDOW = 10  # final_loss: the mean of the last this-many optimizer steps' losses


class CharBlocks(torch.utils.data.Dataset):
    """Random-offset character blocks of the text: ``{"input_ids", "labels"}``, int64 of shape (block,)."""

    def __init__(self, ids: torch.Tensor, block: int, length: int, seed: int):
        self.ids, self.block = ids, block
        g = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(0, ids.numel() - block, (length, ), generator=g)

    def __len__(self):
        return self.offsets.numel()

    def __getitem__(self, i):
        x = self.ids[self.offsets[i]:self.offsets[i] + self.block]
        return {"input_ids": x, "labels": x}  # GPT2LMHeadModel shifts the labels itself


def add_common_args(ap: argparse.ArgumentParser, default_config: str, output_dir: str) -> None:
    """The options both examples take (model size, data, optimization, the DeepSpeed config)."""
    ap.add_argument("--deepspeed", default=default_config, help="DeepSpeed config (JSON) with a \"dgc\" section")
    ap.add_argument("--stock", action="store_true",
                    help="run the same config without its \"dgc\" section (stock ZeRO-3), to compare with")
    ap.add_argument("--max-steps", type=int, default=50, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=8, help="per rank and micro-step")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (DeepSpeed's, by the norm)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--adam-beta1", type=float, default=None,
                    help="AdamW's beta1 (default: 0 where the config hands the method's update to AdamW, else 0.9)")
    ap.add_argument("--adam-beta2", type=float, default=None,
                    help="AdamW's beta2 (default: 0.99 where the config hands the method's update to AdamW, "
                    "else 0.999)")
    ap.add_argument("--lr-scheduler", default="cosine", help="transformers' schedule name: linear, cosine, ...")
    ap.add_argument("--warmup-steps", type=int, default=None, help="default: a fifth of the run, at most 10")
    ap.add_argument("--bf16", action="store_true", help="bf16 engine (DeepSpeed's bf16 section)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--init-range", type=float, default=0.02, help="GPT-2's initializer_range (its default, 0.02)")
    ap.add_argument("--dropout", type=float, default=0.1, help="GPT-2's dropouts (its default, 0.1)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--output-dir", default=output_dir)
    ap.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")


# AdamW's betas where decoupled momentum hands its update u to it ('update: "optimizer"'): the ranks' decoupled
# momentum is then Adam's first moment (beta1 0; the extension refuses beta1 > 0 there) and Adam keeps the second, at
# 0.99 (docs/huggingface.md); elsewhere the Trainer's and torch's defaults
BETAS_ON_U, BETAS_DEFAULT = (0.0, 0.99), (0.9, 0.999)


def adam_betas(args, ds_config: dict) -> tuple[float, float]:
    """AdamW's ``(beta1, beta2)``: ``--adam-beta1`` / ``--adam-beta2`` where given, else :data:`BETAS_ON_U` where
    ``ds_config``'s ``"dgc"`` section is enabled and hands decoupled momentum's update to the optimizer, else
    :data:`BETAS_DEFAULT` (a stock run's config has no ``"dgc"`` section)."""
    cfg = deepspeed_dgc.config.parse_dgc_config(ds_config)  # read as initialize reads it (names, aliases, defaults)
    dm = cfg.decoupled_momentum if cfg is not None and cfg.enabled else None
    default = BETAS_ON_U if dm is not None and dm.update != "sign" else BETAS_DEFAULT
    return (default[0] if args.adam_beta1 is None else args.adam_beta1,
            default[1] if args.adam_beta2 is None else args.adam_beta2)


def warmup_steps(args) -> int:
    return min(10, args.max_steps // 5) if args.warmup_steps is None else args.warmup_steps


def load_ds_config(path: str, stock: bool) -> dict:
    """The DeepSpeed config at ``path`` (:func:`deepspeed_dgc.read_ds_config`: JSON, a key given twice refused as
    DeepSpeed refuses it; hjson where the file is not JSON); with ``stock``, without its ``"dgc"`` section (everything
    else the same)."""
    try:
        config = deepspeed_dgc.read_ds_config(path)
    except (OSError, ValueError) as err:
        raise SystemExit(f"--deepspeed {path}: {err}") from None
    if stock:
        config.pop("dgc", None)
    return config


def char_data(args, world_size: int) -> tuple[CharBlocks, int]:
    """Enough random blocks of the text's first 200k characters for ``args.max_steps`` optimizer steps of every rank
    (``args.batch_size`` per micro-step, ``args.grad_accum`` micro-steps per step), and the vocabulary's size."""
    text = DATA_PATH.read_text(encoding="utf-8")
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([stoi[c] for c in text[:200_000]], dtype=torch.long)
    length = args.max_steps * args.grad_accum * args.batch_size * world_size
    return CharBlocks(ids, args.block_size, length, args.seed), len(chars)


def gpt2(args, vocab_size: int):
    """A GPT-2 of ``args.n_layer`` layers of width ``args.n_embd``, randomly initialized from its config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=args.block_size, n_embd=args.n_embd, n_layer=args.n_layer,
                        n_head=4, bos_token_id=0, eos_token_id=0, initializer_range=args.init_range,
                        resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout)
    return GPT2LMHeadModel(config)


def report(engine, losses: list[float], n_params: int, **extra) -> dict | None:
    """On rank 0, print ``DGC_TELEMETRY {json}``: the loss of every optimizer step (the mean over ranks and
    micro-steps), ``final_loss`` (the mean of the last :data:`FINAL_WINDOW`), the betas of the optimizer ZeRO-3 steps
    with (its first param group's; None without), the compression telemetry of this rank (``"dgc": null`` on a stock
    run) and ``extra``. Returns the dict printed (None on other ranks)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    tail = losses[-FINAL_WINDOW:]
    betas = getattr(getattr(engine.optimizer, "optimizer", None), "param_groups", [{}])[0].get("betas")
    line = {"losses": [round(x, 6) for x in losses], "final_loss": sum(tail) / max(1, len(tail)),
            "betas": None if betas is None else [float(b) for b in betas],
            "n_params": n_params, "world_size": int(os.environ.get("WORLD_SIZE", "1")), **extra}
    stats = deepspeed_dgc.get_stats(engine)
    if stats is None:
        line["dgc"] = None
    else:
        line.update(kernels=stats.kernels, wire_bytes_total=stats.wire_bytes_total,
                    dense_fp32_bytes_total=round(stats.dense_fp32_bytes_total),
                    compression_ratio=round(stats.compression_ratio, 2), dgc_steps=stats.steps)
    print("DGC_TELEMETRY " + json.dumps(line), flush=True)
    return line


def finish() -> None:
    """End the process group, else gloo's threads can abort the exit ("terminate called without an active
    exception", pytorch/pytorch#190489)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
