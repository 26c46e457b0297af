"""Checkpoint scenarios: a run that saves midway and goes on, and a run that resumes from that checkpoint."""

from dataclasses import dataclass

from . import scenario
from .training import Train, TrainRecord, build, new_record, run_steps


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
def save_midway(job: SaveMidway, rank: int) -> TrainRecord:
    """Train every step, saving a checkpoint after step ``save_at``."""
    built = build(job, rank)

    def save(engine, step):
        if step + 1 == job.save_at:
            engine.save_checkpoint(job.ckpt)

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
