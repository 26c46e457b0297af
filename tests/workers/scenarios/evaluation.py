"""Evaluation scenarios: forward passes only (no backward, no step)."""

from dataclasses import dataclass, field
from typing import List, Optional

import torch

import deepspeed_dgc

from . import scenario
from .model import BASE, batches, check_model, dtype_of, make_engine, merge


@dataclass
class Evaluate:
    """Forward passes of ``steps * gas`` batches under ``config`` (merged into :data:`~.model.BASE`); with
    ``"optimizer": None`` an engine without an optimizer."""
    config: dict = field(default_factory=dict)
    model: str = "net"
    steps: int = 4
    gas: int = 1

    def __post_init__(self):
        check_model(self.model)


@dataclass
class EvalRecord:
    """The loss of every forward pass, the telemetry's dictionary (or None), and the engine's optimizer class name
    (``DeepSpeedZeRoOffload`` for an engine without optimizer)."""
    losses: List[float]
    stats: Optional[dict]
    optimizer_type: str


@scenario(Evaluate)
def evaluate(job: Evaluate, rank: int) -> EvalRecord:
    """Run the forward passes under ``torch.no_grad`` and record them."""
    cfg = merge(BASE, job.config)
    cfg["gradient_accumulation_steps"] = job.gas
    engine = make_engine(cfg, job.model)
    with torch.no_grad():
        losses = [float(engine(x, y)) for micro in batches(rank, job.steps, job.gas, dtype_of(cfg), job.model)
                  for x, y in micro]
    stats = deepspeed_dgc.get_stats(engine)
    return EvalRecord(losses, None if stats is None else stats.to_dict(), type(engine.optimizer).__name__)
