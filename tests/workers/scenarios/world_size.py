"""Runs at 2 and 4 ranks that see the same global batches, for resumes at another world size.

Each rank of a ``world``-rank job takes the inputs of ``virtual_world / world`` consecutive ranks of
:func:`~.model.batches` (concatenated: its micro-batch is that many times larger), so every step's global batch, its
mean gradient and the mean loss over the ranks are those of ``virtual_world`` ranks at any world size that divides it.
A job's ``train_micro_batch_size_per_gpu`` must be ``4 * virtual_world / world`` (the test sets it).

Not imported by the package's ``__init__``: a job of this module unpickled by a worker imports it (and so registers
its scenarios).
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import scenario, training
from .checkpoint import Resume, SaveMidway, resume, save_midway
from .model import batches
from .training import Train, train


def same_data_batches(world: int, virtual_world: int):
    """A replacement of :func:`~.model.batches` for rank ``rank`` of ``world``: the inputs of virtual ranks
    ``rank * k .. rank * k + k - 1`` (``k = virtual_world / world``) concatenated along the batch."""
    if virtual_world % world:
        raise ValueError(f"world {world} does not divide the virtual world {virtual_world}")
    k = virtual_world // world

    def fn(rank, steps, micro, dtype, model="net"):
        parts = [batches(rank * k + i, steps, micro, dtype, model) for i in range(k)]
        return [[tuple(torch.cat([p[s][m][j] for p in parts]) for j in (0, 1)) for m in range(micro)]
                for s in range(steps)]

    return fn


@contextlib.contextmanager
def same_data(virtual_world: int):
    """:func:`~.training.run_steps` reads its inputs from :func:`same_data_batches` inside."""
    real = training.batches
    training.batches = same_data_batches(dist.get_world_size(), virtual_world)
    try:
        yield
    finally:
        training.batches = real


def _check_virtual_world(job) -> None:
    if job.virtual_world < 1:
        raise ValueError(f"{type(job).__name__}: virtual_world {job.virtual_world} must be at least 1")


@dataclass
class TrainSameData(Train):
    """:class:`~.training.Train` on the global batches of ``virtual_world`` ranks."""
    virtual_world: int = 4

    def __post_init__(self):
        super().__post_init__()
        _check_virtual_world(self)


@dataclass
class SaveMidwaySameData(SaveMidway):
    """:class:`~.checkpoint.SaveMidway` on the global batches of ``virtual_world`` ranks."""
    virtual_world: int = 4

    def __post_init__(self):
        super().__post_init__()
        _check_virtual_world(self)


@dataclass
class ResumeSameData(Resume):
    """:class:`~.checkpoint.Resume` on the global batches of ``virtual_world`` ranks."""
    virtual_world: int = 4

    def __post_init__(self):
        super().__post_init__()
        _check_virtual_world(self)


@scenario(TrainSameData)
def train_same_data(job: TrainSameData, rank: int):
    with same_data(job.virtual_world):
        return train(job, rank)


@scenario(SaveMidwaySameData)
def save_midway_same_data(job: SaveMidwaySameData, rank: int):
    with same_data(job.virtual_world):
        return save_midway(job, rank)


@scenario(ResumeSameData)
def resume_same_data(job: ResumeSameData, rank: int):
    """:func:`~.checkpoint.resume` on the global batches of ``virtual_world`` ranks."""
    with same_data(job.virtual_world):
        return resume(job, rank)
