"""Mismatch scenarios: ranks whose buckets differ (another model on one rank) meet in the compressed reduce-scatter."""

from dataclasses import dataclass
from typing import Optional

import torch

from deepspeed_dgc.config import DGCConfig
from deepspeed_dgc.memory.error_feedback import ErrorFeedback
from deepspeed_dgc.zero3.reduce_scatter import CompressedReduceScatter

from . import scenario

LAYOUTS = ("fixed", "exact", "auto")


@dataclass
class MismatchedBucket:
    """One compressed reduce-scatter (density 0.1, ``layout``) of a bucket of two tensors whose last one has 5000
    elements on rank 0 and 7000 on the others."""
    layout: str = "fixed"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"MismatchedBucket: layout {self.layout!r} must be one of {LAYOUTS}")


@dataclass
class ErrorRecord:
    """The error this rank's call raised, ``"ErrorType: message"``, or None."""
    error: Optional[str]


@scenario(MismatchedBucket)
def mismatched_bucket(job: MismatchedBucket, rank: int) -> ErrorRecord:
    """Run the reduce-scatter and record what it raised (the test checks which)."""
    cfg = DGCConfig(enabled=True, density=0.1, min_numel=0, layout=job.layout, timeout_s=30.0)
    reducer = CompressedReduceScatter(cfg, ErrorFeedback("fp32"), seed=rank)
    sizes = [300, 5000 if rank == 0 else 7000]
    try:
        reducer.reduce_scatter([torch.randn(n) for n in sizes], [0, 1], None, torch.float32)
    except Exception as err:  # noqa: BLE001 -- the test checks which
        return ErrorRecord(f"{type(err).__name__}: {err}")
    return ErrorRecord(None)
