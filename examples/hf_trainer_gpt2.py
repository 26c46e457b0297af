"""Train a small GPT-2 (random init, no download) on the shipped Shakespeare text with Hugging Face's
Trainer, DeepSpeed ZeRO-3 and deepspeed_dgc's compressed gradient reduce-scatter.

``import deepspeed_dgc`` before the Trainer builds its DeepSpeed engine is all it takes: the
``"dgc"`` section of the DeepSpeed config passed as ``TrainingArguments(deepspeed=...)`` turns
compression on. The recommended method (decoupled momentum, ``configs/hf_zero3_dgc_adam.json``) with the
Trainer's own learning-rate schedule, gradient accumulation, clipping and bf16, on 2 ranks (CPU ranks without a
GPU), from the repository root::

    deepspeed --num_gpus 2 examples/hf_trainer_gpt2.py --deepspeed configs/hf_zero3_dgc_adam.json \\
        --max-steps 50 --grad-accum 2 --max-grad-norm 1.0 --lr-scheduler cosine --bf16

Where a config hands the method's update to the Trainer's AdamW (``"update": "optimizer"``), the example sets
AdamW's betas to (0, 0.99): the ranks' decoupled momentum is then Adam's first moment (``--adam-beta1`` /
``--adam-beta2`` to change them; docs/huggingface.md). ``--stock`` runs the same config without its ``"dgc"``
section, with the Trainer's AdamW defaults (0.9, 0.999), to compare with. At the end rank 0 prints one
line, ``DGC_TELEMETRY {...}``: every optimizer step's training loss (the Trainer's logged loss, averaged over ranks),
``final_loss`` (the mean of the last 10), and the compression telemetry (bytes this rank sent, what stock fp32
ZeRO-3 would have sent, the compression ratio, which compression path ran; ``"dgc": null`` on a stock run).
"""

import argparse

import torch

import deepspeed_dgc  # noqa: F401 -- installs the hook before the Trainer creates the engine

try:
    from examples import hf_common  # from the repository root (the deepspeed launcher puts it on PYTHONPATH)
except ModuleNotFoundError:
    import hf_common  # run as a script by another launcher: its own folder comes first on sys.path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    hf_common.add_common_args(ap, "configs/hf_zero3_dgc_adam.json", "runs/hf_trainer_gpt2")
    args = ap.parse_args(argv)

    from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

    set_seed(args.seed)
    ds_config = hf_common.load_ds_config(args.deepspeed, args.stock)
    beta1, beta2 = hf_common.adam_betas(args, ds_config)
    targs = TrainingArguments(output_dir=args.output_dir,
                              deepspeed=ds_config,
                              per_device_train_batch_size=args.batch_size,
                              gradient_accumulation_steps=args.grad_accum,
                              max_grad_norm=args.max_grad_norm,
                              max_steps=args.max_steps,
                              learning_rate=args.lr,
                              adam_beta1=beta1,
                              adam_beta2=beta2,
                              lr_scheduler_type=args.lr_scheduler,
                              warmup_steps=hf_common.warmup_steps(args),
                              bf16=args.bf16,
                              logging_steps=1,
                              save_strategy="no",
                              report_to=[],
                              seed=args.seed,
                              use_cpu=not torch.cuda.is_available(),
                              dataloader_num_workers=0)
    train, vocab = hf_common.char_data(args, targs.world_size)
    model = hf_common.gpt2(args, vocab)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)  # tied weights once, as ZeRO-3 reduces

    class Losses(TrainerCallback):
        """The Trainer's logged training loss of every optimizer step (``logging_steps=1``; gathered over ranks)."""

        def __init__(self):
            self.losses, self.lrs = [], []

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
                self.lrs.append(float(logs.get("learning_rate", float("nan"))))

    log = Losses()
    trainer = Trainer(model=model, args=targs, train_dataset=train, callbacks=[log])
    result = trainer.train()
    engine = trainer.model_wrapped
    hf_common.report(engine, log.losses, n_params, train_loss=result.training_loss, steps=result.global_step,
                     lrs=log.lrs, bf16=engine.bfloat16_enabled(), grad_accum=engine.gradient_accumulation_steps(),
                     gradient_clipping=engine.gradient_clipping())
    hf_common.finish()


if __name__ == "__main__":
    main()
