"""Checkpoint scenarios: a run that saves midway and goes on, a run that resumes from that checkpoint, and a run killed
while it saves."""

import os
import signal
from dataclasses import dataclass
from typing import Optional

import deepspeed_dgc.zero3.checkpoint as ckpt

from . import scenario
from .training import AfterStep, Train, TrainRecord, build, new_record, run_steps


@dataclass
class SaveMidway(Train):
    """:class:`~.training.Train`, saving a checkpoint to ``ckpt`` after ``save_at`` steps (the run goes on)."""
    ckpt: str = ""
    save_at: int = 1

    def __post_init__(self):
        super().__post_init__()
        if not self.ckpt or not 0 < self.save_at <= self.steps:
            raise ValueError(f"SaveMidway needs a ckpt directory and 0 < save_at <= steps (got {self.ckpt!r}, "
                             f"{self.save_at}, {self.steps})")


@dataclass
class Resume(Train):
    """:class:`~.training.Train` that first loads the latest checkpoint of ``ckpt``, then runs steps
    ``resume_at .. steps - 1`` (its inputs are those of the same steps of an unbroken run)."""
    ckpt: str = ""
    resume_at: int = 1

    def __post_init__(self):
        super().__post_init__()
        if not self.ckpt or not 0 <= self.resume_at < self.steps:
            raise ValueError(f"Resume needs a ckpt directory and 0 <= resume_at < steps (got {self.ckpt!r}, "
                             f"{self.resume_at}, {self.steps})")


@scenario(SaveMidway)
def save_midway(job: SaveMidway, rank: int, crash: Optional[AfterStep] = None) -> TrainRecord:
    """Train every step, saving a checkpoint after step ``save_at`` (then ``crash(engine, step)`` after each step)."""
    built = build(job, rank)

    def save(engine, step):
        if step + 1 == job.save_at:
            engine.save_checkpoint(job.ckpt)
        if crash is not None:
            crash(engine, step)

    return run_steps(job, rank, built, new_record(built.engine), after_step=save)


@scenario(Resume)
def resume(job: Resume, rank: int) -> TrainRecord:
    """Load the checkpoint, record the residuals it restored, and train the remaining steps."""
    built = build(job, rank)
    engine = built.engine
    engine.load_checkpoint(job.ckpt)
    record = new_record(engine)
    state = getattr(engine, "_dgc_state", None)
    record.loaded_residuals = None if state is None else state.memory.residuals()
    return run_steps(job, rank, built, record, first=job.resume_at)


CRASH_POINTS = ("sidecar", "deepspeed")


@dataclass
class CrashWhileSaving(SaveMidway):
    """:class:`SaveMidway`, then a second save after ``crash_at`` steps during which rank ``victim`` is killed
    (SIGKILL) at ``point``: ``"sidecar"``, inside the extension's side-car write (its bytes written to the temporary
    file, before the rename); ``"deepspeed"``, inside DeepSpeed's own files (its ZeRO optimizer states), after every
    side-car is written. The run ends there (every rank fails)."""
    crash_at: int = 2
    point: str = "sidecar"
    victim: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.point not in CRASH_POINTS:
            raise ValueError(f"CrashWhileSaving: point {self.point!r} must be one of {CRASH_POINTS}")
        if not self.save_at < self.crash_at <= self.steps:
            raise ValueError(f"CrashWhileSaving needs save_at < crash_at <= steps (got {self.save_at}, {self.crash_at}, "
                             f"{self.steps})")


def _kill_at(engine, point: str) -> None:
    """Make this process die (SIGKILL) when the next save reaches ``point``."""
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "sidecar":  # the side-car's rename is the save's first (this process dies at it)
        real_replace = os.replace
        os.replace = lambda src, dst: die() if dst.endswith(ckpt.sidecar_name(0)[-3:]) else real_replace(src, dst)
    else:
        engine._save_zero_checkpoint = die


@scenario(CrashWhileSaving)
def crash_while_saving(job: CrashWhileSaving, rank: int) -> TrainRecord:
    """Train, save after ``save_at`` steps, and be killed (the victim) or fail (the others) saving after ``crash_at``."""

    def crash(engine, step):
        if step + 1 == job.crash_at:
            if rank == job.victim:
                _kill_at(engine, job.point)
            engine.save_checkpoint(job.ckpt)

    return save_midway(job, rank, crash)
