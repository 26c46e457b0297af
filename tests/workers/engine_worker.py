"""Worker: train a small odd-sized model with ZeRO-3 through deepspeed.initialize and save what happened.

Usage: engine_worker.py MODE OUT_DIR [STEPS]. MODE is one of
  stock, lossless          fp32, gradient accumulation 2: losses, full grads and fp32 params per step
  stock_bf16comm, lossless_bf16comm
                           the same with communication_data_type bf16
  overflow_fp16, overflow_bf16
                           DGC on; rank 1's input holds Inf at step 2: skipped steps, params, residuals
  overflow_fp16_momentum, overflow_bf16_momentum
                           the same with compressed_momentum frozen after step 1 (INT2): also the momenta
  stock_adam, momentum_exact
                           gas 1, 6 steps: stock ZeRO-3, or lossless DGC with compressed_momentum frozen
                           after step 3, sent raw (no quantization, no preconditioning); also each rank's
                           local full gradients and the optimizer's settings
  stock_sgd, mc_dense, mc_sparse
                           gas 1, 6 steps, SGD with momentum 0.9: stock ZeRO-3 (weight decay 0.01), or
                           DGC's momentum_correction lossless (dense, no quantization, the same decay), or
                           at density 0.1 without quantization, masking on, local_clip_norm 0.05, the same decay;
                           also local gradients, velocities and residuals per step
  bad_config               initialize with invalid "dgc" settings; record each error message
  die, hang                rank 1 is killed, or hangs, inside its reduce-scatter of step 3 (timeout_s 8);
                           rank 0 saves the error it got and the time to OUT_DIR/rank0_error.pt
  mismatch, mismatch_version, mismatch_disabled
                           rank 1 uses another density (or reports another deepspeed_dgc version, or
                           has DGC disabled); record the error of initialize or the first step
  resume_full, resume_second
                           DGC on, 10 steps uninterrupted, with a save_checkpoint to OUT_DIR/ckpt after the
                           first 5; or load_checkpoint from there (at any world size) and run 5 more
                           (suffix _momentum: with compressed_momentum frozen after step 3; suffix _mc: SGD
                           with momentum_correction)
"""

import copy
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

BASE = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 1000000,
}
LOSSLESS = {"enabled": True, "density": 1.0, "quantization": "none", "min_numel": 0}
SPARSE = {"enabled": True, "density": 0.1, "quantization": "int4", "min_numel": 256, "stats_interval": 1}


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


def make_engine(config):
    torch.manual_seed(0)
    model = Net()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def full_params(engine):
    return [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]


def batches(rank, steps, micro, dtype):
    gen = torch.Generator().manual_seed(100 + rank)
    return [[(torch.randn(4, 24, generator=gen).to(dtype), torch.randn(4, 37, generator=gen).to(dtype))
             for _ in range(micro)] for _ in range(steps)]


def train(mode, rank, steps, out_dir):
    cfg = copy.deepcopy(BASE)
    dtype = torch.float32
    gas = 1
    if mode in ("stock_sgd", "mc_dense", "mc_sparse"):
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9,
                                                      "weight_decay": 0.01}}
        cfg["zero_allow_untested_optimizer"] = True
        cfg["gradient_clipping"] = 0.0  # stock without clipping: momentum_correction switches it off (mc_dense: 1.0)
        if mode == "mc_dense":
            cfg["dgc"] = dict(LOSSLESS, momentum_correction=True)
            cfg["gradient_clipping"] = 1.0  # must be switched off, else this run would differ from stock
        elif mode == "mc_sparse":
            cfg["dgc"] = dict(SPARSE, quantization="none", momentum_correction=True, local_clip_norm=0.05)
    elif mode in ("stock_adam", "momentum_exact"):
        if mode == "momentum_exact":
            cfg["dgc"] = dict(LOSSLESS, compressed_momentum={"freeze_step": 3, "quantization": "none",
                                                             "precondition": False})
    elif mode.startswith(("stock", "lossless")):
        gas = 2
        cfg["gradient_accumulation_steps"] = gas
        if mode.startswith("lossless"):
            cfg["dgc"] = LOSSLESS
            if mode.endswith("_hier2"):  # 4 ranks as 2 nodes of 2
                cfg["dgc"] = dict(LOSSLESS, topology="hierarchical", ranks_per_node=2)
        if mode.endswith("_bf16comm"):
            cfg["communication_data_type"] = "bf16"
    else:
        cfg["dgc"] = SPARSE
        if mode.endswith("_momentum"):
            cfg["dgc"] = dict(SPARSE, compressed_momentum={"freeze_step": 1, "quantization": "int2"})
        if mode.startswith("overflow_fp16"):
            # DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels for this CPU;
            # torch computes fp16 on any CPU, and the fp16 loss-scaling path is what is under test.
            get_accelerator().is_fp16_supported = lambda: True
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 1000}
            dtype = torch.float16
        else:
            cfg["bf16"] = {"enabled": True}
            cfg["csv_monitor"] = {"enabled": True, "output_path": out_dir, "job_name": "monitor"}
            dtype = torch.bfloat16
            if mode == "overflow_bf16":  # residuals kept in (pinned) host memory: a skipped step must not touch them
                cfg["dgc"] = dict(SPARSE, residual_offload=True)
    engine = make_engine(cfg)
    if mode.startswith("mc_"):  # a torch LR scheduler wraps the owners' optimizer.step (needs a bound method)
        torch.optim.lr_scheduler.LambdaLR(engine.optimizer.optimizer, lambda s: 1.0)
    record = dict(losses=[], grads=[], params=[full_params(engine)], skipped=[], residuals=[], loss_scale=[],
                  stats=None, local_grads=[], momenta=[])
    basic = engine.optimizer.optimizer
    record["optimizer"] = dict(type=type(basic).__name__, gradient_clipping=engine.gradient_clipping(),
                               **{k: basic.param_groups[0].get(k) for k in ("lr", "betas", "eps", "weight_decay",
                                                                            "momentum")})
    record["ds_ids"] = [p.ds_id for p in engine.module.parameters()]
    local_grad_modes = ("stock_adam", "momentum_exact", "stock_sgd", "mc_dense", "mc_sparse")
    if mode in local_grad_modes:  # capture this rank's full local gradient of every param
        names = {p.ds_id: i for i, p in enumerate(engine.module.parameters())}
        local = {}
        for p in engine.module.parameters():
            p.register_hook(lambda g, i=names[p.ds_id]: local.__setitem__(i, g.detach().float().clone()))
    for step, micro_batches in enumerate(batches(rank, steps, gas, dtype)):
        for m, (x, y) in enumerate(micro_batches):
            if mode.startswith("overflow") and step == 2 and rank == 1:
                x = x.clone()
                x[0, 0] = float("inf")
            loss = engine(x, y)
            engine.backward(loss)
            record["losses"].append(float(loss))
            if m == len(micro_batches) - 1:
                record["grads"].append([safe_get_full_grad(p).float().clone() for p in engine.module.parameters()])
                if mode in local_grad_modes:
                    record["local_grads"].append([local[i] for i in range(len(local))])
            engine.step()
        record["params"].append(full_params(engine))
        record["skipped"].append(engine.skipped_steps)
        state = getattr(engine, "_dgc_state", None)
        if state is not None:
            record["residuals"].append({k: v.clone() for k, v in state.memory.residuals().items()})
            if state.momentum is not None:
                record["momenta"].append({k: v.clone() for k, v in state.momentum.store.committed.items()})
        record["loss_scale"].append(float(engine.optimizer.loss_scale))
    if mode == "momentum_exact":  # frozen now: the frozen-variance step is a bound method too
        torch.optim.lr_scheduler.LambdaLR(engine.optimizer.optimizer, lambda s: 1.0)
    stats = deepspeed_dgc.get_stats(engine)
    record["stats"] = None if stats is None else stats.to_dict()
    return record


BAD = {
    "misspelled": {"dgc": {"enabled": True, "densty": 0.1}},
    "density_range": {"dgc": {"enabled": True, "density": 1.5}},
    "quantization_value": {"dgc": {"enabled": True, "quantization": "int3"}},
    "stage2": {"dgc": {"enabled": True}, "zero_optimization": {"stage": 2}},
    "no_reduce_scatter": {"dgc": {"enabled": True}, "zero_optimization": {"stage": 3, "reduce_scatter": False}},
    "qgz": {"dgc": {"enabled": True}, "zero_optimization": {"stage": 3, "zero_quantized_gradients": True}},
    "stage0": {"dgc": {"enabled": True}, "zero_optimization": {"stage": 0}},
    "qwz": {"dgc": {"enabled": True, "weights": {"quantization": "int8"}},
            "zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
    "nontrainable": {"dgc": {"enabled": True, "weights": {"quantization": "fp8_e4m3"}},
                     "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}},
    "weights_format": {"dgc": {"enabled": True, "weights": {"quantization": "int2"}}},
    "no_optimizer": {"dgc": {"enabled": True}, "optimizer": None},
    "backend_value": {"dgc": {"enabled": True, "comm_backend": "nccl"}},
    "topology_value": {"dgc": {"enabled": True, "topology": "ring"}},
    "timeout_zero": {"dgc": {"enabled": True, "timeout_s": 0}},
    "hpz_node_mismatch": {"dgc": {"enabled": True, "topology": "hierarchical", "ranks_per_node": 1},
                          "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
    "nodes_do_not_divide": {"dgc": {"enabled": True, "topology": "hierarchical", "ranks_per_node": 3}},
    "mpi_without_mpirun": {"dgc": {"enabled": True, "comm_backend": "mpi"}},
    "mpi4py_missing": {"dgc": {"enabled": True, "comm_backend": "mpi"}},
    "kernels_value": {"dgc": {"enabled": True, "kernels": "fast"}},
    "fused_missing_on_rank1": {"dgc": {"enabled": True, "kernels": "fused"}},
    "momentum_sgd": {"dgc": {"enabled": True, "compressed_momentum": {"freeze_step": 2}},
                     "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                     "zero_allow_untested_optimizer": True},
    "momentum_gas": {"dgc": {"enabled": True, "compressed_momentum": {"freeze_step": 2}},
                     "gradient_accumulation_steps": 2},
    "momentum_hierarchical": {"dgc": {"enabled": True, "topology": "hierarchical",
                                      "compressed_momentum": {"freeze_step": 2}}},
    "sr_with_fp8": {"dgc": {"enabled": True, "quantization": "fp8_e4m3", "stochastic_rounding": True}},
    "density_auto_typo": {"dgc": {"enabled": True, "density": "Auto"}},
    "residual_dtype_value": {"dgc": {"enabled": True, "residual_dtype": "fp16"}},
    "momentum_fp16": {"dgc": {"enabled": True, "compressed_momentum": {"freeze_step": 2}},
                      "fp16": {"enabled": True}},
    "mc_with_adam": {"dgc": {"enabled": True, "momentum_correction": True}},
    "mc_sgd_no_momentum": {"dgc": {"enabled": True, "momentum_correction": True},
                           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True},
    "momentum_autocast": {"dgc": {"enabled": True, "compressed_momentum": {"freeze_step": 2}},
                          "torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
    "mc_maximize": {"dgc": {"enabled": True, "momentum_correction": True},
                    "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "maximize": True}},
                    "zero_allow_untested_optimizer": True},
    "mc_nesterov": {"dgc": {"enabled": True, "momentum_correction": True},
                    "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}},
                    "zero_allow_untested_optimizer": True},
    "mc_and_compressed_momentum": {"dgc": {"enabled": True, "momentum_correction": True,
                                           "compressed_momentum": {"freeze_step": 2}}},
    "local_clip_without_mc": {"dgc": {"enabled": True, "local_clip_norm": 1.0}},
}


def hide_fused_op():
    """On this rank only: no loaded op, no prebuilt op, no compiler (the fused op cannot load)."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    from op_builder.dgc import DGCCPUBuilder
    import deepspeed_dgc.kernels as kernels
    OpBuilder._loaded_ops.pop(DGCCPUBuilder.NAME, None)
    DGCCPUBuilder.prebuilt_module = lambda self: None
    os.environ["CXX"] = "/nonexistent/c++"
    kernels._warned.clear()


def bad_configs():
    messages = {}
    for name, override in BAD.items():
        cfg = copy.deepcopy(BASE)
        cfg.update(override)
        cfg = {k: v for k, v in cfg.items() if v is not None}
        hidden = {m: sys.modules.pop(m, None) for m in ("mpi4py", "mpi4py.MPI")} if name == "mpi4py_missing" else {}
        if hidden:
            sys.modules["mpi4py"] = None  # import mpi4py now raises ImportError, as if not installed
        if name == "fused_missing_on_rank1" and int(os.environ["RANK"]) == 1:
            hide_fused_op()
        if name == "momentum_fp16":  # let DeepSpeed's CPU accelerator accept fp16, so our check is what refuses
            get_accelerator().is_fp16_supported = lambda: True
        try:
            make_engine(cfg)
            messages[name] = None
        except Exception as err:  # record whatever was raised; the test checks the text
            messages[name] = f"{type(err).__name__}: {err}"
        finally:
            for m, module in hidden.items():
                sys.modules.pop(m, None)
                if module is not None:
                    sys.modules[m] = module
    return messages


def mismatch(rank, what="density"):
    cfg = copy.deepcopy(BASE)
    cfg["dgc"] = dict(SPARSE, density=0.1 if rank == 0 or what != "density" else 0.2)
    if what == "disabled" and rank == 1:
        cfg["dgc"]["enabled"] = False
    if what == "version" and rank == 1:
        deepspeed_dgc.__version__ = "0.0.0-other"
    (x, y), = batches(rank, 1, 1, torch.float32)[0]
    try:
        engine = make_engine(cfg)
        engine.backward(engine(x, y))
        engine.step()
        return None
    except Exception as err:  # the test checks which error, on which rank
        return f"{type(err).__name__}: {err}"


def resume(mode, rank, out_dir):
    """resume_full: 10 steps, saving a checkpoint after the first 5; resume_second: load it, 5 more;
    resume_second_nodgc: the same with DGC off (a DGC checkpoint loaded into a stock run)."""
    momentum = mode.endswith("_momentum")  # compressed_momentum frozen after step 3: the checkpoint is past the freeze
    mc = mode.endswith("_mc")  # momentum SGD with DGC's momentum correction: the velocities are state
    mode = mode.removesuffix("_momentum").removesuffix("_mc")
    cfg = copy.deepcopy(BASE)
    if mode != "resume_second_nodgc":
        cfg["dgc"] = SPARSE
        if momentum:
            cfg["dgc"] = dict(SPARSE, compressed_momentum={"freeze_step": 3, "quantization": "int2"})
        if mc:
            # thresholds estimated at steps 0, 3, 6, 9: the checkpoint after step 5 holds one mid-reuse
            cfg["dgc"] = dict(SPARSE, momentum_correction=True, local_clip_norm=1.0, threshold_reuse_steps=3)
            cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}}
            cfg["zero_allow_untested_optimizer"] = True
    if mode == "resume_second_universal":  # a universal checkpoint (ds_to_universal), any world size
        cfg["checkpoint"] = {"load_universal": True}
    engine = make_engine(cfg)
    ckpt = f"{out_dir}/ckpt"
    steps = range(10) if mode == "resume_full" else range(5, 10)
    loaded = None
    if mode.startswith("resume_second"):
        engine.load_checkpoint(ckpt)
        if mode == "resume_second_universal":
            loaded = {k: v.clone() for k, v in engine._dgc_state.memory.residuals().items()}
    all_batches = batches(rank, 10, 1, torch.float32)
    record = dict(losses=[], residual_keys=[], loaded_residuals=loaded)
    for step in steps:
        (x, y), = all_batches[step]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        record["losses"].append(float(loss))
        if mode == "resume_full" and step == 4:
            engine.save_checkpoint(ckpt)
    record["params"] = full_params(engine)
    if mode == "resume_second_nodgc":
        assert deepspeed_dgc.get_stats(engine) is None
        return record
    state = engine._dgc_state
    record["residuals"] = {k: v.clone() for k, v in state.memory.residuals().items()}
    record["residual_storage"] = state.memory.storage
    record["stats_steps"] = deepspeed_dgc.get_stats(engine).steps
    if state.momentum is not None:
        record["frozen"] = state.momentum.frozen
        record["momenta"] = {k: v.clone() for k, v in state.momentum.store.committed.items()}
    return record


FAIL_TIMEOUT_S = 8.0


def fail_mid_run(mode, rank, out_dir):
    """Rank 1 dies (SIGKILL) or hangs inside its reduce-scatter of step 3; rank 0 records the error it
    gets and when, then re-raises it (its exit status is what the test checks)."""
    cfg = copy.deepcopy(BASE)
    cfg["dgc"] = dict(SPARSE, timeout_s=FAIL_TIMEOUT_S)
    engine = make_engine(cfg)
    reducer = engine._dgc_state.reducer
    if rank == 1:
        reduce_scatter = reducer.reduce_scatter

        def failing_reduce_scatter(*args, **kwargs):
            if engine.global_steps == 3:
                with open(f"{out_dir}/failed_at", "w") as f:
                    f.write(repr(time.time()))
                if mode == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                # hang until rank 0 has recorded the error it found by itself (at most timeout_s + 20 s), then
                # leave without a word
                deadline = time.time() + FAIL_TIMEOUT_S + 20
                while time.time() < deadline and not os.path.exists(f"{out_dir}/rank0_error.pt"):
                    time.sleep(0.2)
                time.sleep(2.0)
                os._exit(3)
            return reduce_scatter(*args, **kwargs)

        reducer.reduce_scatter = failing_reduce_scatter
    try:
        for (x, y), in batches(rank, 6, 1, torch.float32):
            engine.backward(engine(x, y))
            engine.step()
    except Exception as err:
        torch.save(dict(error=f"{type(err).__name__}: {err}", at=time.time()), f"{out_dir}/rank{rank}_error.pt")
        raise
    return "finished"


def main(mode, out_dir, steps=4):
    rank = init()
    if mode in ("die", "hang"):
        fail_mid_run(mode, rank, out_dir)  # raises on rank 0; rank 1 never returns
    if mode == "bad_config":
        result = bad_configs()
    elif mode.startswith("mismatch"):
        result = mismatch(rank, mode.partition("_")[2] or "density")
    elif mode.startswith("resume"):
        result = resume(mode, rank, out_dir)
    else:
        result = train(mode, rank, steps, out_dir)
    torch.save(result, f"{out_dir}/rank{rank}.pt")
    finish()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *[int(a) for a in sys.argv[3:]])
