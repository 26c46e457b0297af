"""Train the small GPT-2 of ``hf_trainer_gpt2.py`` (random init, no download) on the shipped Shakespeare text with
Hugging Face Accelerate, DeepSpeed ZeRO-3 and deepspeed_dgc: a plain training loop (``accelerator.accumulate``,
``accelerator.backward``, a ``transformers`` learning-rate schedule) with the recommended method, decoupled momentum.

``import deepspeed_dgc`` before ``accelerator.prepare`` builds the DeepSpeed engine is all it takes: the ``"dgc"``
section of the ds_config given to ``DeepSpeedPlugin(hf_ds_config=...)`` turns compression on. The optimizer is the
loop's own ``torch.optim.AdamW`` (the config has no ``"optimizer"`` section); gradient clipping is DeepSpeed's
(``DeepSpeedPlugin(gradient_clipping=...)`` fills the config's ``"auto"``), and ``accelerator.clip_grad_norm_``
returns the norm DeepSpeed measured. On 2 ranks (CPU ranks without a GPU), from the repository root::

    accelerate launch --num_processes 2 --use_deepspeed -m examples.accelerate_gpt2 \\
        --max-steps 50 --grad-accum 2 --max-grad-norm 1.0 --bf16

(``deepspeed --num_gpus 2 examples/accelerate_gpt2.py ...`` starts it too.) ``--stock`` runs the same config
without its ``"dgc"`` section. The loop's AdamW takes betas (0, 0.99) where the config hands the method's update
to it (``hf_common.adam_betas``), else (0.9, 0.999). At the end rank 0 prints
``DGC_TELEMETRY {...}`` as ``hf_trainer_gpt2.py`` does: every optimizer step's loss (the mean over ranks and
micro-steps), ``final_loss`` (the mean of the last 10) and the compression telemetry.
"""

import argparse
import math

import torch

import deepspeed_dgc  # noqa: F401 -- installs the hook before accelerator.prepare creates the engine

try:
    from examples import hf_common  # from the repository root (python -m, or PYTHONPATH as the deepspeed launcher's)
except ModuleNotFoundError:
    import hf_common  # run as a script by another launcher: its own folder comes first on sys.path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    hf_common.add_common_args(ap, "configs/accelerate_zero3_dgc_adam.json", "runs/accelerate_gpt2")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    args = ap.parse_args(argv)

    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs, set_seed
    from deepspeed.accelerator import get_accelerator
    from transformers import get_scheduler

    ds_config = hf_common.load_ds_config(args.deepspeed, args.stock)
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config,
                             gradient_accumulation_steps=args.grad_accum, gradient_clipping=args.max_grad_norm)
    # the process group's backend named: without a GPU, Accelerate 1.15 names none, and a state without a backend
    # counts one process (each rank then loads every batch and reduce() sums instead of averaging)
    backend = InitProcessGroupKwargs(backend=get_accelerator().communication_backend_name())
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=args.grad_accum,
                              mixed_precision="bf16" if args.bf16 else "no", kwargs_handlers=[backend])
    set_seed(args.seed)
    train, vocab = hf_common.char_data(args, accelerator.num_processes)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True,
                                         generator=torch.Generator().manual_seed(args.seed))
    model = hf_common.gpt2(args, vocab)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=hf_common.adam_betas(args, ds_config),
                                  weight_decay=args.weight_decay)
    # Accelerate steps a prepared schedule once per process at every optimizer step (its schedules count the
    # samples of one process's view of the data), so the schedule's steps are optimizer steps times processes
    scheduler = get_scheduler(args.lr_scheduler, optimizer,
                              num_warmup_steps=hf_common.warmup_steps(args) * accelerator.num_processes,
                              num_training_steps=args.max_steps * accelerator.num_processes)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    losses, lrs, norms, window = [], [], [], []
    model.train()
    batches = iter(loader)
    for _ in range(args.max_steps * args.grad_accum):
        batch = next(batches)
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        window.append(accelerator.reduce(loss.detach().float(), "mean").item())
        if accelerator.sync_gradients:
            losses.append(sum(window) / len(window))
            lrs.append(optimizer.param_groups[0]["lr"])
            norms.append(float("nan") if norm is None else float(norm))
            window = []
    engine = model
    assert all(math.isfinite(x) for x in losses), losses
    hf_common.report(engine, losses, n_params, steps=len(losses), lrs=lrs, grad_norms=norms,
                     bf16=engine.bfloat16_enabled(), grad_accum=engine.gradient_accumulation_steps(),
                     gradient_clipping=engine.gradient_clipping(), global_steps=engine.global_steps,
                     num_processes=accelerator.num_processes)
    hf_common.finish()


if __name__ == "__main__":
    main()
