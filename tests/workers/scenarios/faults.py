"""Fault scenarios: a peer that dies, hangs or stops in the middle of training."""

import os
import signal
import time
from dataclasses import dataclass

import torch

from . import scenario
from .training import Train, TrainRecord, build, new_record, run_steps

KINDS = ("die", "hang", "stop")
# where in optimizer step ``at_step`` rank 1 fails: in its forward (at the second module's forward: rank 0 runs on to
# the first collective that needs rank 1), in the extension's gradient exchange (in backward), or right after its
# optimizer step (rank 0 goes on to the next step's forward and waits in ZeRO-3's parameter all-gather there, on the
# data-parallel group)
PHASES = ("forward", "exchange", "after_step")


@dataclass
class PeerFault(Train):
    """:class:`~.training.Train` in which rank 1 is killed (``"die"``, SIGKILL), hangs (``"hang"``), or stops
    (``"stop"``, SIGSTOP: frozen with its sockets open) in ``phase`` (:data:`PHASES`) of optimizer step ``at_step``;
    with ``ckpt``, every rank saves a checkpoint there after ``save_at`` steps (before the fault).

    Files in ``out``: ``failed_at`` (``time.time()`` of the fault), ``stopped_pid`` (the stopped rank), and
    ``rank0_error.pt``, the :class:`PeerError` rank 0 met (it then re-raises: its exit status is an error).
    """
    kind: str = "die"
    at_step: int = 3
    out: str = ""
    phase: str = "exchange"
    ckpt: str = ""
    save_at: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.kind not in KINDS or self.phase not in PHASES or not self.out:
            raise ValueError(f"PeerFault: kind {self.kind!r} must be one of {KINDS}, phase {self.phase!r} one of "
                             f"{PHASES} and out a directory")
        if self.ckpt and not 0 < self.save_at <= self.at_step:
            raise ValueError(f"PeerFault: save_at {self.save_at} must be in 1 .. at_step ({self.at_step}) with ckpt")


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

    def save(engine, step):
        if job.ckpt and step + 1 == job.save_at:
            engine.save_checkpoint(job.ckpt)

    try:
        return run_steps(job, rank, built, new_record(engine), after_step=save)
    except Exception as err:
        torch.save(PeerError(f"{type(err).__name__}: {err}", time.time()), f"{job.out}/rank{rank}_error.pt")
        if os.path.exists(f"{job.out}/stopped_pid"):  # the stopped peer never ends by itself
            os.kill(int(open(f"{job.out}/stopped_pid").read()), signal.SIGKILL)
        raise


def inject_fault(engine, job: PeerFault, timeout_s: float) -> None:
    """This rank dies, hangs or stops in ``job.phase`` of optimizer step ``job.at_step``."""

    def fail():
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

    def failing(method, after=False):
        def call(*args, **kwargs):
            if engine.global_steps == job.at_step and not after:
                fail()
            out = method(*args, **kwargs)
            if engine.global_steps == job.at_step and after:
                fail()
            return out
        return call

    if job.phase == "exchange":
        reducer = engine._dgc_state.reducer
        reducer.reduce_scatter = failing(reducer.reduce_scatter)
    elif job.phase == "after_step":
        engine.optimizer.step = failing(engine.optimizer.step, after=True)
    else:  # the second of the model's children: its parameters are gathered when its forward starts
        second = list(engine.module.children())[1]
        second.register_forward_pre_hook(failing(lambda module, args: None))
