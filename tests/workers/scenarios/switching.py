"""Switching scenarios: resume a checkpoint saved with one gradient method (or stock ZeRO-3) under another, and
record what the load said and what it left in the optimizer.

Not imported by the package's ``__init__``: a job of this module unpickled by a worker imports it (and so registers
its scenario).
"""

import logging
from dataclasses import dataclass, field
from typing import List, Tuple

from deepspeed_dgc.zero3 import switching

from . import scenario
from .checkpoint import Resume
from .training import TrainRecord, build, new_record, run_steps


@dataclass
class SwitchResume(Resume):
    """:class:`~.checkpoint.Resume` that records the extension's log lines of the load and the optimizer's state."""


@dataclass
class SwitchRecord:
    """What one rank saw.

    Attributes:
        train: the resumed run's record (``loaded_residuals`` and ``loaded_momenta`` as the load left them).
        log: ``(level name, message)`` of every line the ``deepspeed_dgc`` logger wrote during the load.
        after_load, after_step: :func:`~deepspeed_dgc.zero3.switching.states_summary` of the optimizer right after
            the load and after the first resumed step (the keys of each sub-group's state and its step count).
    """
    train: TrainRecord
    log: List[Tuple[str, str]] = field(default_factory=list)
    after_load: dict = field(default_factory=dict)
    after_step: dict = field(default_factory=dict)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


@scenario(SwitchResume)
def switch_resume(job: SwitchResume, rank: int) -> SwitchRecord:
    """Load the checkpoint (its log lines captured), record the state it restored, and train the remaining steps."""
    built = build(job, rank)
    engine = built.engine
    log, handler = logging.getLogger("deepspeed_dgc"), _Lines()
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        engine.load_checkpoint(job.ckpt, tag=job.tag)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    out = SwitchRecord(train=new_record(engine), log=handler.lines,
                       after_load=switching.states_summary(engine.optimizer))
    state = getattr(engine, "_dgc_state", None)
    out.train.loaded_residuals = None if state is None else state.memory.residuals()
    momentum = None if state is None else state.momentum
    out.train.loaded_momenta = None if momentum is None else {k: v.clone() for k, v in momentum.momenta().items()}

    def first_step(engine, step):
        if step == job.resume_at:
            out.after_step = switching.states_summary(engine.optimizer)

    run_steps(job, rank, built, out.train, first=job.resume_at, after_step=first_step)
    return out
