"""Config scenarios: initialize (and take one step) with each config of a list; the error each raised, or None."""

import os
import sys
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from deepspeed.accelerator import get_accelerator

import deepspeed_dgc._version

from . import scenario
from .model import BASE, batches, make_engine, merge


@dataclass
class ConfigCase:
    """One config to initialize with.

    Attributes:
        config: merged into :data:`~.model.BASE` (a ``None`` removes a key).
        rank1_config: merged on top on rank 1 only (ranks that disagree).
        rank1_version: the deepspeed_dgc version rank 1 reports (restored after the case).
        hide_mpi4py: ``import mpi4py`` fails, as if not installed.
        hide_fused_op_on_rank: on that rank no loaded or prebuilt op, no compiler (for good: put such a case last).
        allow_fp16: DeepSpeed's CPU accelerator accepts fp16 (so our check is what refuses).
        step: run one optimizer step after initialize (errors of the first exchange).
        param_groups_after_init: set in every param group of the basic optimizer after initialize, before the step
            (a schedule changing, say, SGD's momentum).
    """
    config: dict = field(default_factory=dict)
    rank1_config: dict = field(default_factory=dict)
    rank1_version: Optional[str] = None
    hide_mpi4py: bool = False
    hide_fused_op_on_rank: Optional[int] = None
    allow_fp16: bool = False
    step: bool = False
    param_groups_after_init: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.config, dict) or not isinstance(self.rank1_config, dict):
            raise ValueError(f"ConfigCase: config and rank1_config must be dicts (got {type(self.config).__name__}, "
                             f"{type(self.rank1_config).__name__})")
        if self.hide_fused_op_on_rank is not None and self.hide_fused_op_on_rank < 0:
            raise ValueError(f"ConfigCase: hide_fused_op_on_rank {self.hide_fused_op_on_rank} must be a rank")


@dataclass
class InitConfigs:
    """Each case in turn, in the same processes: name -> :class:`ConfigCase`."""
    cases: Dict[str, ConfigCase]

    def __post_init__(self):
        if not self.cases or not all(isinstance(c, ConfigCase) for c in self.cases.values()):
            raise ValueError("InitConfigs: cases must map names to ConfigCase (at least one)")


@dataclass
class ConfigErrors:
    """Case name -> the error it raised on this rank (``"ErrorType: message"``), or None where it was accepted."""
    errors: Dict[str, Optional[str]]


def hide_fused_op():
    """On this rank only: no loaded op, no prebuilt op, no compiler (the fused op cannot load)."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    from op_builder.dgc import DGCCPUBuilder
    import deepspeed_dgc.codec.kernels as kernels
    OpBuilder._loaded_ops.pop(DGCCPUBuilder.NAME, None)
    DGCCPUBuilder.prebuilt_module = lambda self: None
    os.environ["CXX"] = "/nonexistent/c++"
    kernels._warned.clear()
    kernels._LOAD_FAILURES.clear()


def run_case(case: ConfigCase, rank: int) -> Optional[str]:
    """The error ``case`` raised on this rank, or None."""
    cfg = merge(BASE, case.config)
    if rank == 1:
        cfg = merge(cfg, case.rank1_config)
        if case.rank1_version is not None:
            deepspeed_dgc._version.__version__ = case.rank1_version
    hidden = {m: sys.modules.pop(m, None) for m in ("mpi4py", "mpi4py.MPI")} if case.hide_mpi4py else {}
    if hidden:
        sys.modules["mpi4py"] = None  # import mpi4py now raises ImportError, as if not installed
    if case.hide_fused_op_on_rank == rank:
        hide_fused_op()
    if case.allow_fp16:
        get_accelerator().is_fp16_supported = lambda: True
    try:
        engine = make_engine(cfg)
        for group in engine.optimizer.optimizer.param_groups if case.param_groups_after_init else ():
            group.update(case.param_groups_after_init)
        if case.step:
            (x, y), = batches(rank, 1, 1, torch.float32)[0]
            engine.backward(engine(x, y))
            engine.step()
        return None
    except Exception as err:  # record whatever was raised; the test checks the type and the text
        return f"{type(err).__name__}: {err}"
    finally:
        for m, module in hidden.items():
            sys.modules.pop(m, None)
            if module is not None:
                sys.modules[m] = module


@scenario(InitConfigs)
def init_configs(job: InitConfigs, rank: int) -> ConfigErrors:
    """Every case in turn, the package version restored after each."""
    version = deepspeed_dgc._version.__version__
    errors = {}
    for name, case in job.cases.items():
        errors[name] = run_case(case, rank)
        deepspeed_dgc._version.__version__ = version
    return ConfigErrors(errors)
