"""What a ds_config really switches on in the main job: one launch of ``examples/train_char_gpt.py``'s model and data
under ``deepspeed.initialize`` with the config, two optimizer steps, then rank 0 prints the engine's facts as one
line of JSON after ``FACTS `` (benchmarks/study_jobs.py checks them before it trains a job for 300 steps). Launched as
a module::

    python -m deepspeed.launcher.runner --num_gpus 2 --master_port P --module benchmarks.study_jobs_probe \\
        --deepspeed_config runs/study_jobs/configs/fp16_stock_probe.json

Facts: the ZeRO optimizer and the optimizer it steps (class names, the first param group's lr, weight decay and
momentum or betas), whether ZeRO-3 offloads the optimizer and the parameters, the fp16/bf16/autocast switches, the loss
scaler (class, dynamic, scale), the dtype of the partitions ZeRO-3 keeps and of ``lm_head``'s output in the forward
(what the matmuls ran in), the micro-batch and accumulation steps, and whether deepspeed_dgc is on and with which
``"dgc"`` section.
"""

import argparse
import json

import deepspeed
import torch
import torch.distributed as dist

import deepspeed_dgc
from deepspeed_dgc.comm.communicators import exit_without_finalization
from benchmarks.study_jobs import FACTS_PREFIX
from examples import train_char_gpt as job  # the main job's model and data


def engine_facts(engine, out_dtypes: list) -> dict:
    """The facts of the module docstring, from an initialized engine that has stepped (``out_dtypes``: the dtypes
    ``lm_head`` returned in the forwards)."""
    zero = engine.optimizer
    inner = getattr(zero, "optimizer", zero)
    group = inner.param_groups[0]
    scaler = getattr(zero, "loss_scaler", None)
    partition = next(p.ds_tensor for p in engine.module.parameters())
    dgc = deepspeed_dgc.get_stats(engine)
    return {"zero_optimizer": type(zero).__name__, "optimizer": type(inner).__name__,
            "lr": group.get("lr"), "weight_decay": group.get("weight_decay"), "momentum": group.get("momentum"),
            "betas": list(group["betas"]) if "betas" in group else None,
            "offload_optimizer": bool(getattr(zero, "offload_optimizer", False)),
            "offload_param": bool(getattr(zero, "offload_param", False)),
            "fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(),
            "torch_autocast": engine.torch_autocast_enabled(),
            "loss_scaler": None if scaler is None else type(scaler).__name__,
            "dynamic_loss_scale": None if scaler is None else bool(getattr(scaler, "dynamic", False)),
            "loss_scale": None if scaler is None else float(scaler.cur_scale),
            "partition_dtype": str(partition.dtype).replace("torch.", ""),
            "forward_dtype": sorted({str(d).replace("torch.", "") for d in out_dtypes}),
            "micro_batch": engine.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "dgc_on": dgc is not None}


def main() -> dict:
    """Initialize, step, and return the facts (every rank)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=2)
    args = deepspeed.add_config_arguments(parser).parse_args()
    ds_config = job.load_ds_config(args.deepspeed_config, None)
    deepspeed.init_distributed()
    train, _, vocab = job.load_data()
    torch.manual_seed(1234)
    model = job.CharGPT(vocab, 64, 4, 128, 4)
    out_dtypes = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: out_dtypes.append(output.dtype))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        x, y = job.get_batch(train, engine.train_micro_batch_size_per_gpu(), 64, gen)
        engine.backward(engine(x.to(engine.device), y.to(engine.device)))
        engine.step()
    facts = engine_facts(engine, out_dtypes)
    return dict(facts, dgc=ds_config.get("dgc") if facts["dgc_on"] else None, skipped_steps=engine.skipped_steps)


if __name__ == "__main__":
    facts = main()
    print(f"{FACTS_PREFIX}{json.dumps(facts)}" if dist.get_rank() == 0 else "", flush=True)
    dist.barrier()  # every rank done before any tears the groups down (gloo)
    dist.destroy_process_group()
    exit_without_finalization()
