"""All-gather scenarios: ZeRO-3 with the quantized parameter all-gather; the weights forward actually saw."""

import copy
from dataclasses import dataclass
from typing import Dict, List

import torch
import deepspeed
from deepspeed.utils import safe_get_full_fp32_param, safe_get_local_fp32_param

import deepspeed_dgc

from . import scenario
from .model import BASE, Net, batches

STEPS = 3
FORMATS = ("none", "int8", "fp8_e4m3", "int4")  # dgc.weights.quantization


@dataclass
class QuantizedGather:
    """Train :class:`~.model.Net` :data:`STEPS` steps with ``dgc.weights.quantization`` ``format`` (gradients: dense
    INT4). Parameters are not persistent and neither prefetched nor reused, so every step gathers each weight in
    forward and again in backward.

    Attributes:
        hpz: ``zero_hpz_partition_size``.
        sequential: one gather per parameter (``stage3_allgather_sequential``) instead of one per module.
        node_size: > 0: the hierarchical gradient topology with that many ranks per node (which also labels the
            parameter bytes as intra- or inter-node).
        scale_l1_weight: ``l1.weight`` that many times larger at init (``l1.bias`` as is; they are gathered together).
    """
    format: str = "int8"
    hpz: int = 1
    sequential: bool = False
    node_size: int = 0
    scale_l1_weight: float = 1.0

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"QuantizedGather: format {self.format!r} must be one of {FORMATS}")
        if self.hpz < 1 or self.node_size < 0:
            raise ValueError(f"QuantizedGather: hpz {self.hpz} must be at least 1 and node_size {self.node_size} "
                             "at least 0")


@dataclass
class GatherStep:
    """One step of one rank.

    Attributes:
        exact: the exact full fp32 parameters before the step (flat, ``engine.module.parameters()`` order).
        seen: module name -> the gathered weights it saw in forward (flat, its own parameters in order).
        shards_unchanged: the stored shards were bit for bit the same after forward and backward.
        master_equal: after the step, the stored shards equal the fp32 master partition (real elements).
        param_wire, param_dense, param_inter_wire, param_inter_dense: the step's parameter all-gather bytes (on the
            wire, as fp32; and those crossing nodes); grad_inter_wire: the gradients' bytes crossing nodes.
        loss: the step's loss.
    """
    exact: List[torch.Tensor]
    seen: Dict[str, List[torch.Tensor]]
    shards_unchanged: bool
    master_equal: bool
    param_wire: int
    param_dense: int
    param_inter_wire: int
    param_inter_dense: int
    grad_inter_wire: int
    loss: float


@dataclass
class GatherRecord:
    """Every step of one rank, and whether ``GatheredParameters`` (an exact path) gave the exact fp32 weights after
    the last step."""
    steps: List[GatherStep]
    gathered_exact: bool


def real_numel(p, rank):
    """Elements of this rank's shard that are real (the rest is padding)."""
    size = p.ds_tensor.numel()
    return max(0, min(p.ds_numel - rank * size, size))


def gather_config(job: QuantizedGather) -> dict:
    """:data:`~.model.BASE` with every gather repeated (no persistence, prefetch or reuse) and ``job``'s settings."""
    cfg = copy.deepcopy(BASE)
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0,
                                    stage3_max_reuse_distance=0, zero_hpz_partition_size=job.hpz,
                                    stage3_allgather_sequential=bool(job.sequential))
    cfg["dgc"] = {"enabled": True, "density": 1.0, "quantization": "int4", "weights": {"quantization": job.format}}
    if job.node_size:
        cfg["dgc"].update(topology="hierarchical", ranks_per_node=job.node_size)
    return cfg


@scenario(QuantizedGather)
def quantized_gather(job: QuantizedGather, rank: int) -> GatherRecord:
    """Train with a forward pre-hook on every module that copies the weights it was given."""
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.l1.weight.mul_(job.scale_l1_weight)
    seen = {}

    def capture(module, _inputs):
        seen[module._name] = [p.data.detach().clone().reshape(-1) for p in module.parameters(recurse=False)]

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=gather_config(job))
    for name, module in engine.module.named_children():  # after DeepSpeed's own gather hooks
        module._name = name
        module.register_forward_pre_hook(capture)
    params = list(engine.module.parameters())
    steps = []
    for (x, y), in batches(rank, STEPS, 1, torch.float32):
        exact = [safe_get_full_fp32_param(p).reshape(-1).clone() for p in params]
        shards_before = [p.ds_tensor.clone() for p in params]
        seen.clear()
        loss = engine(x, y)
        engine.backward(loss)
        # bit for bit, padding included: the padding is uninitialized memory, which may hold NaN (never torch.equal)
        shards_unchanged = all(torch.equal(a.view(torch.uint8), p.ds_tensor.view(torch.uint8))
                               for a, p in zip(shards_before, params))
        engine.step()
        master_equal = all(torch.equal(p.ds_tensor[:real_numel(p, rank)],
                                       safe_get_local_fp32_param(p).reshape(-1)[:real_numel(p, rank)]) for p in params)
        stats = deepspeed_dgc.get_stats(engine).last
        steps.append(GatherStep(exact=exact, seen=dict(seen), shards_unchanged=shards_unchanged,
                                master_equal=master_equal,
                                param_wire=stats.param_wire_bytes, param_dense=stats.param_dense_fp32_bytes,
                                param_inter_wire=stats.param_inter_node_wire_bytes,
                                param_inter_dense=stats.param_inter_node_dense_fp32_bytes,
                                grad_inter_wire=stats.inter_node_wire_bytes,
                                loss=float(loss)))
    # an exact path must stay exact (checked after the last step: with hpZ, leaving GatheredParameters
    # makes secondary shards that the next forward would use, changing the traffic measured above)
    final = [safe_get_full_fp32_param(p).reshape(-1).clone() for p in params]
    with deepspeed.zero.GatheredParameters(params):
        gathered_exact = all(torch.equal(p.data.reshape(-1), e) for p, e in zip(params, final))
    return GatherRecord(steps, gathered_exact)
