"""Checkpoint scenarios: a run that saves midway and goes on, a run that resumes from that checkpoint, and a run killed
while it saves."""

import glob
import os
import signal
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch

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
    """:class:`~.training.Train` that first loads checkpoint ``tag`` of ``ckpt`` (None: the one ``latest`` names),
    then runs steps ``resume_at .. steps - 1`` (its inputs are those of the same steps of an unbroken run)."""
    ckpt: str = ""
    resume_at: int = 1
    tag: Optional[str] = None

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
    """Load the checkpoint, record the residuals and momenta it restored, and train the remaining steps."""
    built = build(job, rank)
    engine = built.engine
    engine.load_checkpoint(job.ckpt, tag=job.tag)
    record = new_record(engine)
    state = getattr(engine, "_dgc_state", None)
    record.loaded_residuals = None if state is None else state.memory.residuals()
    momentum = None if state is None else state.momentum
    record.loaded_momenta = None if momentum is None else {k: v.clone() for k, v in momentum.momenta().items()}
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


FULL_POINTS = ("sidecar", "deepspeed", "scripts")


@dataclass
class FullDisk(SaveMidway):
    """:class:`SaveMidway` into ``ckpt`` on a small file system, then after ``full_at`` steps rank 0 fills it up
    (a filler file) and every rank saves again, which fails: at ``"sidecar"`` nothing is left (the side-cars fail),
    at ``"deepspeed"`` room for the side-cars only (DeepSpeed's own files fail), at ``"scripts"`` rank 0 first
    deletes the recovery scripts DeepSpeed copied into ``ckpt`` at the first save and leaves room for every file of
    the checkpoint but them (rank 0's copy of ``zero_to_fp32.py``, DeepSpeed's last write, fails). Every rank records
    the error it raised; rank 0 deletes the filler, and the run goes on training to ``steps`` and saves once more at
    the end (the record's ``errors``, ``final_save``: the error texts of the failed save, and whether the last save
    worked)."""
    full_at: int = 2
    point: str = "sidecar"

    def __post_init__(self):
        super().__post_init__()
        if self.point not in FULL_POINTS or not self.save_at < self.full_at < self.steps:
            raise ValueError(f"FullDisk: point {self.point!r} must be one of {FULL_POINTS} and save_at < full_at < steps "
                             f"(got {self.save_at}, {self.full_at}, {self.steps})")


@dataclass
class FullDiskRecord:
    """What :class:`FullDisk` saw: the run's :class:`~.training.TrainRecord`, this rank's error of the failed save
    (``"Type: message"``), and whether the last save worked."""
    train: TrainRecord
    errors: List[str] = field(default_factory=list)
    final_save: bool = False


def _fill(directory: str, leave: int) -> str:
    """Fill the file system of ``directory`` up to ``leave`` bytes free with a filler file; returns its path."""
    path = os.path.join(directory, "filler")
    st = os.statvfs(directory)
    size = max(0, st.f_bavail * st.f_frsize - leave)
    with open(path, "wb") as f:
        try:
            f.write(b"\0" * size)
            f.flush()
        except OSError:  # full a little sooner than statvfs said: as full as it gets
            pass
    return path


def _copy_scripts_last(engine, before: str, now: str, timeout_s: float = 60.0) -> None:
    """Rank 0's next copy of DeepSpeed's recovery scripts waits (at most ``timeout_s``) until every file the other
    ranks wrote into ``before`` (a tag saved earlier) is in ``now`` at its size there."""
    real = engine._copy_recovery_script
    theirs = [os.path.basename(p) for p in glob.glob(f"{before}/zero_pp_rank_*") if "zero_pp_rank_0_" not in p]
    waited = []

    def copy(save_path):
        end = time.time() + timeout_s
        while not waited and time.time() < end and not all(
                os.path.exists(f"{now}/{n}") and os.path.getsize(f"{now}/{n}") >= os.path.getsize(f"{before}/{n}")
                for n in theirs):
            time.sleep(0.05)
        waited.append(True)  # the later saves copy at once
        return real(save_path)

    engine._copy_recovery_script = copy


@scenario(FullDisk)
def full_disk(job: FullDisk, rank: int) -> FullDiskRecord:
    """Train, save after ``save_at``, fail to save after ``full_at`` on a full disk, go on, save at the end."""
    built = build(job, rank)
    out = FullDiskRecord(train=new_record(built.engine))

    def save(engine, step):
        if step + 1 == job.save_at:
            engine.save_checkpoint(job.ckpt)
        if step + 1 == job.full_at:
            filler = None
            if rank == 0:  # room for side-cars as large as the first save's (in whole pages, one more page each for
                # a few bytes more) and the in-progress mark; not for DeepSpeed's files (tens of kB); at "scripts" for
                # all of the first save's files (not the 38 kB zero_to_fp32.py)
                page = os.statvfs(job.ckpt).f_frsize
                kept = "*" if job.point == "scripts" else "dgc_state_*"
                if job.point == "scripts":
                    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
                        os.unlink(os.path.join(job.ckpt, script))
                room = sum((-(-os.path.getsize(p) // page) + 1) * page
                           for p in glob.glob(f"{job.ckpt}/global_step{job.save_at}/{kept}"))
                filler = _fill(job.ckpt, 0 if job.point == "sidecar" else room + page)
                if job.point == "scripts":  # copy them once the other ranks' files are written (else the copy may
                    # take their room first, and one of their writes fails instead)
                    _copy_scripts_last(built.engine, f"{job.ckpt}/global_step{job.save_at}",
                                       f"{job.ckpt}/global_step{job.full_at}")
            torch.distributed.barrier()
            try:
                engine.save_checkpoint(job.ckpt)
            except Exception as err:  # noqa: BLE001 -- the test reads what each rank raised
                out.errors.append(f"{type(err).__name__}: {err}")
            if filler is not None:
                os.unlink(filler)
            torch.distributed.barrier()
        if step + 1 == job.steps:
            engine.save_checkpoint(job.ckpt)
            out.final_save = True

    run_steps(job, rank, built, out.train, after_step=save)
    return out
