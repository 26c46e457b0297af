"""DeepSpeed's gradient and optimizer-state APIs (``deepspeed.utils.safe_*``) after training with a method: what each
answers, or the error it raises (:mod:`deepspeed_dgc.zero3.ds_api`)."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from deepspeed.utils import (safe_get_full_grad, safe_get_full_optimizer_state, safe_get_local_grad,
                             safe_get_local_optimizer_state, safe_set_full_grad, safe_set_full_optimizer_state,
                             safe_set_local_optimizer_state)

from . import scenario
from .model import batches, dtype_of
from .training import Train, TrainRecord, build, new_record, run_steps


@dataclass
class QueryAPIs(Train):
    """:class:`~.training.Train`, then every API asked for every parameter, then this rank's ``"dgc_momentum"`` (or
    ``"dgc_residual"``) of the first parameter set through the API (full), and of the second (local) to known values.

    Attributes:
        keys: the optimizer-state keys asked for (the optimizer's own and the extension's).
        ckpt: where to save a checkpoint after training, before the APIs are asked (None: none).
        mid_window: after training, the first micro-step of a new accumulation window (forward and backward, ``gas``
            at least 2) before the APIs are asked.
    """
    keys: List[str] = field(default_factory=lambda: ["exp_avg", "exp_avg_sq", "dgc_momentum", "dgc_residual", "step"])
    ckpt: Optional[str] = None
    mid_window: bool = False


@dataclass
class APIRecord:
    """What the APIs answered on one rank: ``answers[api][param index]`` a tensor or ``"ErrorType: message"``;
    ``steps``: the optimizer's ``"step"`` of every sub-group (None where absent) and ``global_steps``;
    ``grad_norm``: ``engine.get_global_grad_norm()``; ``stored``: the extension's own committed state of every
    parameter (``"momentum"``/``"residual"`` -> list of fp32 flat tensors or None), read from its stores;
    ``partitions``: ``(start, partition_numel)`` of every parameter on this rank; ``after_set``: the state read back
    after the sets (``"full"``, ``"local"``) and the values set (``"set_full"``, ``"set_local"``)."""
    train: TrainRecord
    answers: Dict[str, list]
    steps: List[Optional[float]]
    global_steps: int
    grad_norm: Optional[float]
    stored: Dict[str, list]
    partitions: List[tuple]
    after_set: Dict[str, object]


def _ask(fn, *args):
    try:
        out = fn(*args)
        return out.detach().float().cpu().clone() if torch.is_tensor(out) else out
    except Exception as e:  # recorded: the test checks type and message
        return f"{type(e).__name__}: {e}"


@scenario(QueryAPIs)
def query_apis(job: QueryAPIs, rank: int) -> APIRecord:
    built = build(job, rank)
    engine = built.engine
    train = run_steps(job, rank, built, new_record(engine))
    opt, state = engine.optimizer, engine._dgc_state
    if job.ckpt is not None:
        engine.save_checkpoint(job.ckpt, tag="trained")
    if job.mid_window:
        x, y = batches(rank, 1, 1, dtype_of(built.cfg), job.model)[0][0]
        engine.backward(engine(x, y))
    params = list(engine.module.parameters())
    answers = {"full_grad": [_ask(safe_get_full_grad, p) for p in params],
               "local_grad": [_ask(safe_get_local_grad, p) for p in params],
               "set_full_grad": [_ask(safe_set_full_grad, p, torch.zeros(p.ds_shape)) for p in params[:1]],
               "grad_partitions": [_ask(lambda: opt.get_fp32_grad_partitions()[0][0])],
               "averaged_gradients": [_ask(lambda: sorted(opt.averaged_gradients))],
               "has_averaged_gradients": [hasattr(opt, "averaged_gradients")]}
    for key in job.keys:
        answers[f"full:{key}"] = [_ask(safe_get_full_optimizer_state, p, key) for p in params]
        answers[f"local:{key}"] = [_ask(safe_get_local_optimizer_state, p, key) for p in params]
    steps = [opt.optimizer.state.get(flat, {}).get("step") for flat in opt.fp32_partitioned_groups_flat]
    steps = [None if s is None else float(s) for s in steps]  # torch's Adam counts in place
    global_steps, grad_norm = engine.global_steps, engine.get_global_grad_norm()
    stored = {}
    for name, store in (("momentum", getattr(state.momentum, "store", None)), ("residual", state.memory)):
        stored[name] = [None if store is None else store.committed_value(state.key_of(p)) for p in params]
    partitions = [(opt._get_param_partition_rank(p) * p.partition_numel(), p.partition_numel()) for p in params]
    own = "dgc_momentum" if state.momentum is not None else "dgc_residual"
    g = torch.Generator().manual_seed(100 + rank)
    set_full = torch.randn(params[0].ds_shape, generator=g)
    set_local = torch.randn(params[1].partition_numel(), generator=g)
    after_set = {"key": own, "set_full": set_full, "set_local": set_local,
                 "set_full_result": _ask(safe_set_full_optimizer_state, params[0], set_full, own),
                 "set_local_result": _ask(safe_set_local_optimizer_state, params[1], set_local, own),
                 "full": _ask(safe_get_full_optimizer_state, params[0], own),
                 "whole_second": _ask(safe_get_full_optimizer_state, params[1], own),
                 "local": _ask(safe_get_local_optimizer_state, params[1], own)}
    x, y = batches(rank, 1, 1, dtype_of(built.cfg), job.model)[0][0]
    loss = engine(x, y)  # training goes on from the state set
    engine.backward(loss)
    engine.step()
    after_set["loss_after"] = float(loss)
    after_set["momentum_after"] = None if state.momentum is None else state.momentum.store.committed_value(
        state.key_of(params[0]))
    import deepspeed_dgc
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    deepspeed_dgc.uninstall(engine)  # stock again: the class, and averaged_gradients read without a guard
    after_set["uninstalled"] = (type(opt) is DeepSpeedZeroOptimizer_Stage3, _ask(lambda: sorted(opt.averaged_gradients)),
                                _ask(safe_get_full_grad, params[0]) is None or torch.is_tensor(_ask(safe_get_full_grad,
                                                                                                   params[0])))
    return APIRecord(train, answers, steps, global_steps, grad_norm,
                     stored, partitions, after_set)

