"""Train a small GPT-2 (random init, no download) on the shipped Shakespeare text with Hugging Face's
Trainer, DeepSpeed ZeRO-3 and deepspeed_dgc's compressed gradient reduce-scatter.

``import deepspeed_dgc`` before the Trainer builds its DeepSpeed engine is all it takes: the
``"dgc"`` section of the DeepSpeed config passed as ``TrainingArguments(deepspeed=...)`` turns
compression on. Run with 2 ranks (CPU ranks without a GPU)::

    deepspeed --num_gpus 2 examples/hf_trainer_gpt2.py --deepspeed configs/hf_zero3_dgc.json --max-steps 50

At the end rank 0 prints one telemetry line, ``DGC_TELEMETRY {...}`` (bytes this rank sent, what stock
fp32 ZeRO-3 would have sent, the compression ratio, which compression path ran).
"""

import argparse
import json
import os
from pathlib import Path

import torch

import deepspeed_dgc  # noqa: F401 -- installs the hook before the Trainer creates the engine

DATA_PATH = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deepspeed", default="configs/hf_zero3_dgc.json", help="DeepSpeed config (JSON)")
    ap.add_argument("--max-steps", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--output-dir", default="runs/hf_trainer_gpt2")
    ap.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = ap.parse_args(argv)

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

    set_seed(args.seed)
    text = DATA_PATH.read_text(encoding="utf-8")
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text[:200_000]], dtype=torch.long)
    train = CharBlocks(ids, args.block_size, args.max_steps * args.batch_size * 8, args.seed)

    config = GPT2Config(vocab_size=len(chars), n_positions=args.block_size, n_embd=args.n_embd, n_layer=args.n_layer,
                        n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)  # tied weights once, as ZeRO-3 reduces
    targs = TrainingArguments(output_dir=args.output_dir,
                              deepspeed=args.deepspeed,
                              per_device_train_batch_size=args.batch_size,
                              max_steps=args.max_steps,
                              learning_rate=args.lr,
                              warmup_steps=min(10, args.max_steps // 5),
                              logging_steps=10,
                              save_strategy="no",
                              report_to=[],
                              seed=args.seed,
                              use_cpu=not torch.cuda.is_available(),
                              dataloader_num_workers=0)
    trainer = Trainer(model=model, args=targs, train_dataset=train)
    result = trainer.train()
    stats = deepspeed_dgc.get_stats(trainer.model_wrapped)
    if int(os.environ.get("RANK", "0")) == 0:
        line = {"train_loss": result.training_loss, "steps": result.global_step, "n_params": n_params,
                "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
        if stats is None:
            line["dgc"] = None
        else:
            line.update(kernels=stats.kernels, wire_bytes_total=stats.wire_bytes_total,
                        dense_fp32_bytes_total=round(stats.dense_fp32_bytes_total),
                        compression_ratio=round(stats.compression_ratio, 2), dgc_steps=stats.steps)
        print("DGC_TELEMETRY " + json.dumps(line), flush=True)
    if torch.distributed.is_initialized():  # else gloo's threads can abort the exit ("terminate called without an
        torch.distributed.destroy_process_group()  # active exception", pytorch/pytorch#190489)


if __name__ == "__main__":
    main()
