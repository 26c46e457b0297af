"""Odd-model scenarios: models that break naive reducers, through ZeRO-3 with DGC (dense INT4, error feedback).

Every rank builds the same model (seed 0), keeps a float64 copy, and runs :data:`STEPS` steps on its own batch. For
each step it records the gradient DeepSpeed hands the optimizer (``safe_get_full_grad``, the mean over ranks after our
reduce-scatter) and this rank's float64 local gradient from the copy (same weights: the copy is refreshed from the
engine's gathered weights before each step). The test checks the mean of the local float64 gradients against the DGC
gradient within the INT4 bound, plus the case's own invariants. The cases of one launch run one after another in the
same processes, each with its own engine.

Cases (:data:`CASES`): no_grad_some_steps, frozen, used_twice, moe, one_element, smaller_than_world, bf16_beyond_fp16,
bucket_padding.
"""

import copy
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import deepspeed
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

import deepspeed_dgc

from . import scenario
from .model import BASE, merge

STEPS = 3
DGC = {"enabled": True, "density": 1.0, "quantization": "int4", "group_size": 16, "min_numel": 0, "timeout_s": 60.0}


class Base(torch.nn.Module):
    """Two linear layers (12 -> 33 -> 5); the cases below add what breaks naive reducers."""

    def __init__(self, d_in=12, d_hidden=33, d_out=5):
        super().__init__()
        self.inp = torch.nn.Linear(d_in, d_hidden)
        self.out = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x, step):
        return self.out(torch.tanh(self.inp(x)))


class NoGradSomeSteps(Base):
    """``extra`` is used on odd steps only (the same on every rank)."""

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Linear(33, 33)

    def forward(self, x, step):
        h = torch.tanh(self.inp(x))
        if step % 2 == 1:
            h = h + torch.tanh(self.extra(h))
        return self.out(h)


class Frozen(Base):
    """``inp`` is frozen (requires_grad False)."""

    def __init__(self):
        super().__init__()
        self.inp.requires_grad_(False)


class UsedTwice(Base):
    """``mid`` is applied twice per forward (its gradient sums two uses)."""

    def __init__(self):
        super().__init__()
        self.mid = torch.nn.Linear(33, 33)

    def forward(self, x, step):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        return self.out(torch.tanh(self.mid(h)))


class MoE(Base):
    """Top-1 routing to 4 experts by the input: ranks route their tokens to different experts.

    Every expert is called once per forward on every rank, in the same order (a zero-weighted token for
    experts with no tokens), as mixture-of-experts layers under ZeRO-3 must: ZeRO-3 gathers parameters
    per module call, and ranks calling different modules would mismatch collectives (stock DeepSpeed
    aborts then)."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(33, 33) for _ in range(4))
        self.gate = torch.nn.Linear(33, 4)

    def forward(self, x, step):
        h = torch.tanh(self.inp(x))
        choice = self.gate(h).argmax(dim=-1)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            sel = choice == e
            # one call per expert, in the same order on every rank (ZeRO-3 gathers parameters per call):
            # its routed tokens plus one token weighted 0, so an expert with no tokens gets a zero gradient
            out = expert(torch.cat([h[sel], h[:1]]))
            y = y.index_put((sel.nonzero().squeeze(1), ), out[:-1]) + 0.0 * out[-1].sum()
        return self.out(h + y)


class OneElement(Base):
    """A scalar gain and a 1-element bias next to ordinary layers."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.tensor([1.5]))

    def forward(self, x, step):
        return self.out(torch.tanh(self.inp(x)) * self.gain)


class SmallerThanWorld(Base):
    """A 2-element parameter on 3 ranks: one rank's partition of it is empty."""

    def __init__(self):
        super().__init__()
        self.pair = torch.nn.Parameter(torch.tensor([0.5, -0.25]))

    def forward(self, x, step):
        h = torch.tanh(self.inp(x))
        return self.out(h) * self.pair[0] + self.pair[1]


class BucketPadding(torch.nn.Module):
    """One 1001-element parameter (reduce_bucket_size 64 elements in the config)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(1001) * 0.1)

    def forward(self, x, step):
        return (x[:, :1] * self.w[None, :]).tanh()


CASES = {
    "no_grad_some_steps": NoGradSomeSteps,
    "frozen": Frozen,
    "used_twice": UsedTwice,
    "moe": MoE,
    "one_element": OneElement,
    "smaller_than_world": SmallerThanWorld,
    "bf16_beyond_fp16": Base,
    "bucket_padding": BucketPadding,
}


def config(case, stock=False):
    """The ds_config of ``case``: :data:`~.model.BASE` with batches of 6, lr 1e-3, buckets of 4000 and :data:`DGC`."""
    cfg = merge(BASE, {"train_micro_batch_size_per_gpu": 6,
                       "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                       "zero_optimization": {"reduce_bucket_size": 4000},
                       "dgc": dict(DGC)})
    if stock:  # the same case through stock ZeRO-3, for comparison
        del cfg["dgc"]
    if case == "bucket_padding":
        cfg["zero_optimization"]["reduce_bucket_size"] = 64
        cfg["dgc"].update(density=0.1, group_size=8)  # sparse, so indices are on the wire
    if case == "bf16_beyond_fp16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def batch(case, rank, step, dtype):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(6, 12, generator=g)
    if case == "moe":
        x = x + 3.0 * rank  # each rank's tokens prefer other experts
    if case == "bf16_beyond_fp16":
        x = x * 3000.0  # activations and gradients beyond fp16's 65504
    y = torch.randn(6, 1001 if case == "bucket_padding" else 5, generator=g)
    if case == "bf16_beyond_fp16":
        y = y * 70000.0
    return x.to(dtype), y.to(dtype)


@dataclass
class OddModel:
    """Train the model of ``CASES[case]`` :data:`STEPS` steps, through DGC or (``stock``) stock ZeRO-3 for
    comparison."""
    case: str = "frozen"
    stock: bool = False

    def __post_init__(self):
        if self.case not in CASES:
            raise ValueError(f"OddModel: case {self.case!r} must be one of {sorted(CASES)}")


@dataclass
class OddStep:
    """One step of one rank: this rank's float64 local gradients and the gradients DeepSpeed handed the optimizer
    (parameter name -> tensor, None where there is none: unused here, or frozen), the loss and the global gradient
    norm (None where DeepSpeed reports none)."""
    local: Dict[str, Optional[torch.Tensor]]
    grads: Dict[str, Optional[torch.Tensor]]
    loss: float
    grad_norm: Optional[float]


@dataclass
class OddModelRecord:
    """One case on one rank.

    Attributes:
        names: the parameters' names, in order; world: the data-parallel world size.
        steps: every step.
        stats: the telemetry's dictionary at the end (None through stock ZeRO-3).
        params_final: the trained parameters' full fp32 copies at the end, name -> tensor.
        dtypes: name -> the module parameter's dtype (``"torch.bfloat16"``).
    """
    names: List[str]
    world: int
    steps: List[OddStep] = field(default_factory=list)
    stats: Optional[dict] = None
    params_final: Dict[str, torch.Tensor] = field(default_factory=dict)
    dtypes: Dict[str, str] = field(default_factory=dict)


@scenario(OddModel)
def odd_model(job: OddModel, rank: int) -> OddModelRecord:
    """Train the case's model beside its float64 copy, recording both gradients every step."""
    case = job.case
    torch.manual_seed(0)
    model = CASES[case]()
    ref = copy.deepcopy(model).double()
    dtype = torch.bfloat16 if case == "bf16_beyond_fp16" else torch.float32
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                           config=config(case, job.stock))
    record = OddModelRecord(names=[n for n, _ in engine.module.named_parameters()], world=engine.dp_world_size)
    for step in range(STEPS):
        x, y = batch(case, rank, step, dtype)
        # the float64 copy takes the engine's current fp32 weights, then computes this rank's gradient
        with torch.no_grad(), deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            for (n, p), (_, q) in zip(engine.module.named_parameters(), ref.named_parameters()):
                q.copy_(p.data.double().view_as(q))  # the weights the engine's forward uses
        ref.zero_grad()
        loss_ref = torch.nn.functional.mse_loss(ref(x.double(), step), y.double())
        loss_ref.backward()
        local = {n: (q.grad.clone() if q.grad is not None else None) for n, q in ref.named_parameters()}
        loss = torch.nn.functional.mse_loss(engine(x, step).float(), y.float())
        engine.backward(loss)
        grads = {}
        for n, p in engine.module.named_parameters():
            g = safe_get_full_grad(p) if p.requires_grad else None
            grads[n] = None if g is None else g.clone()
        engine.step()
        norm = engine.get_global_grad_norm()
        record.steps.append(OddStep(local=local, grads=grads, loss=float(loss),
                                    grad_norm=None if norm is None else float(norm)))
    stats = deepspeed_dgc.get_stats(engine)
    record.stats = None if stats is None else stats.to_dict()
    record.params_final = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()
                           if p.requires_grad}
    record.dtypes = {n: str(p.dtype) for n, p in engine.module.named_parameters()}
    engine.destroy()
    return record
