"""Scenarios of the multi-process tests: named functions that run inside every rank and return a typed record.

A scenario is a job (a dataclass saying what to run) and a function registered for its type with :func:`scenario`;
the function runs in each rank of a launch and returns a record (a dataclass of what happened). One module per kind:

- :mod:`.model`: the small ZeRO-3 models, the base ds_config and the inputs every scenario shares;
- :mod:`.training`: :class:`~.training.Train` -> :class:`~.training.TrainRecord` (steps, gradient accumulation,
  an Inf in one rank's input, local gradients, a frozen parameter, poisoned padding, host syncs counted);
- :mod:`.checkpoint`: :class:`~.checkpoint.SaveMidway`, :class:`~.checkpoint.Resume`,
  :class:`~.checkpoint.CrashWhileSaving` and :class:`~.checkpoint.FullDisk` (-> :class:`~.checkpoint.FullDiskRecord`);
- :mod:`.faults`: :class:`~.faults.PeerFault` (rank 1 dies, hangs or stops in its forward, its reduce-scatter or
  after its optimizer step);
- :mod:`.policy`: :class:`~.policy.ScriptedPolicy` (``"policy": "auto"`` with scripted measurements);
- :mod:`.evaluation`: :class:`~.evaluation.Evaluate` -> :class:`~.evaluation.EvalRecord` (forward passes only);
- :mod:`.configs`: :class:`~.configs.InitConfigs` -> :class:`~.configs.ConfigErrors` (initialize with each config, the
  error each raised);
- :mod:`.odd_models`: :class:`~.odd_models.OddModel` -> :class:`~.odd_models.OddModelRecord` (models that break naive
  reducers, beside a float64 copy);
- :mod:`.allgather`: :class:`~.allgather.QuantizedGather` -> :class:`~.allgather.GatherRecord` (the quantized
  parameter all-gather: the weights forward saw);
- :mod:`.reduce`: :class:`~.reduce.ReduceCases` -> :class:`~.reduce.ReduceRecord` (the compressed reduce-scatter run
  directly on random gradients, no engine);
- :mod:`.mismatch`: :class:`~.mismatch.MismatchedBucket` -> :class:`~.mismatch.ErrorRecord` (ranks whose buckets
  differ);
- :mod:`.world_size`: :class:`~.world_size.TrainSameData`, :class:`~.world_size.SaveMidwaySameData` and
  :class:`~.world_size.ResumeSameData` (the global batches of a larger world, so that runs at 2 and 4 ranks see the
  same data).

``tests/workers/scenario_worker.py`` runs a list of jobs in turn in one launch; the tests start it with
``dist_launch.run_scenarios`` (or, under ``mpirun``, ``dist_launch.run_scenarios_mpirun``) and read back the records
of every rank. The workers left beside it are scripts on purpose: they model a user's own script.
"""

from typing import Callable, Dict, Type

SCENARIOS: Dict[type, Callable] = {}


def scenario(job_type: Type) -> Callable[[Callable], Callable]:
    """Register the decorated ``fn(job, rank) -> record`` as the scenario that runs jobs of ``job_type``."""

    def register(fn: Callable) -> Callable:
        if job_type in SCENARIOS:
            raise ValueError(f"{job_type.__name__} already runs {SCENARIOS[job_type].__name__}")
        SCENARIOS[job_type] = fn
        return fn

    return register


def run_job(job, rank: int):
    """The record of ``job`` on this rank, from the scenario registered for its type.

    Raises:
        TypeError: no scenario runs jobs of this type.
    """
    fn = SCENARIOS.get(type(job))
    if fn is None:
        raise TypeError(f"no scenario runs a {type(job).__name__}; registered: {sorted(t.__name__ for t in SCENARIOS)}")
    return fn(job, rank)


# the scenario modules register themselves; the jobs are importable from here
from .model import BASE, MODELS  # noqa: E402
from .training import OptimizerSettings, Train, TrainRecord  # noqa: E402
from .checkpoint import CrashWhileSaving, FullDisk, Resume, SaveMidway  # noqa: E402
from .evaluation import EvalRecord, Evaluate  # noqa: E402
from .faults import PeerError, PeerFault  # noqa: E402
from .policy import ScriptedPolicy  # noqa: E402
from .configs import ConfigCase, ConfigErrors, InitConfigs  # noqa: E402
from .odd_models import OddModel, OddModelRecord, OddStep  # noqa: E402
from .allgather import GatherRecord, GatherStep, QuantizedGather  # noqa: E402
from .reduce import ReduceCase, ReduceCases, ReduceRecord, ReduceStep  # noqa: E402
from .mismatch import ErrorRecord, MismatchedBucket  # noqa: E402
from .world_size import ResumeSameData, SaveMidwaySameData, TrainSameData  # noqa: E402

__all__ = ["BASE", "MODELS", "ConfigCase", "ConfigErrors", "CrashWhileSaving", "ErrorRecord", "EvalRecord", "Evaluate",
           "FullDisk", "GatherRecord", "GatherStep", "InitConfigs", "MismatchedBucket", "OddModel", "OddModelRecord", "OddStep",
           "OptimizerSettings", "PeerError", "PeerFault", "QuantizedGather", "ReduceCase", "ReduceCases",
           "ReduceRecord", "ReduceStep", "Resume", "ResumeSameData", "SaveMidway", "SaveMidwaySameData", "ScriptedPolicy",
           "Train", "TrainRecord", "TrainSameData", "run_job", "scenario"]
