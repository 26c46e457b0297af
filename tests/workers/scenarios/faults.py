"""Fault scenarios: a peer that dies, hangs or stops in the middle of training."""

import os
import signal
import time
from dataclasses import dataclass

import torch

from . import scenario
from .training import Train, TrainRecord, build, new_record, run_steps

KINDS = ("die", "hang", "stop")


@dataclass
class PeerFault(Train):
    """:class:`~.training.Train` in which rank 1 is killed (``"die"``, SIGKILL), hangs (``"hang"``), or stops
    (``"stop"``, SIGSTOP: frozen with its sockets open) inside its reduce-scatter of optimizer step ``at_step``.

    Files in ``out``: ``failed_at`` (``time.time()`` of the fault), ``stopped_pid`` (the stopped rank), and
    ``rank0_error.pt``, the :class:`PeerError` rank 0 met (it then re-raises: its exit status is an error).
    """
    kind: str = "die"
    at_step: int = 3
    out: str = ""

    def __post_init__(self):
        super().__post_init__()
        if self.kind not in KINDS or not self.out:
            raise ValueError(f"PeerFault: kind {self.kind!r} must be one of {KINDS} and out a directory")


@dataclass
class PeerError:
    """The error a rank met: ``"ErrorType: message"`` and when (``time.time()``)."""
    error: str
    at: float


@scenario(PeerFault)
def peer_fault(job: PeerFault, rank: int) -> TrainRecord:
    """Train with the fault injected on rank 1; rank 0 saves the error it meets, then re-raises it."""
    built = build(job, rank)
    engine = built.engine
    if rank == 1:
        inject_fault(engine, job, built.cfg["dgc"]["timeout_s"])
    try:
        return run_steps(job, rank, built, new_record(engine))
    except Exception as err:
        torch.save(PeerError(f"{type(err).__name__}: {err}", time.time()), f"{job.out}/rank{rank}_error.pt")
        if os.path.exists(f"{job.out}/stopped_pid"):  # the stopped peer never ends by itself
            os.kill(int(open(f"{job.out}/stopped_pid").read()), signal.SIGKILL)
        raise


def inject_fault(engine, job: PeerFault, timeout_s: float) -> None:
    """This rank dies, hangs or stops inside its reduce-scatter of optimizer step ``job.at_step``."""
    reducer = engine._dgc_state.reducer
    reduce_scatter = reducer.reduce_scatter

    def failing_reduce_scatter(*args, **kwargs):
        if engine.global_steps == job.at_step:
            with open(f"{job.out}/failed_at", "w") as f:
                f.write(repr(time.time()))
            if job.kind == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            if job.kind == "stop":  # frozen with its sockets open (rank 0 kills it once it has its error)
                with open(f"{job.out}/stopped_pid", "w") as f:
                    f.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
            # hang until rank 0 has recorded the error it found by itself (at most timeout_s + 20 s), then leave
            deadline = time.time() + timeout_s + 20
            while time.time() < deadline and not os.path.exists(f"{job.out}/rank0_error.pt"):
                time.sleep(0.2)
            time.sleep(2.0)
            os._exit(3)
        return reduce_scatter(*args, **kwargs)

    reducer.reduce_scatter = failing_reduce_scatter
