"""The scenarios of the multi-process tests (tests/workers/scenarios), without launching any: every job type refuses a
bad value when it is made, naming the field, and the registry runs only the types registered, once each."""

from dataclasses import dataclass

import pytest

from scenarios import (SCENARIOS, ConfigCase, CrashWhileSaving, Evaluate, FullDisk, InitConfigs, ResumeSameData,
                       SaveMidwaySameData, TrainSameData, MismatchedBucket, OddModel,
                       PeerFault, QuantizedGather, ReduceCases, Resume, SaveMidway, ScriptedPolicy, Train, run_job,
                       scenario)
from scenarios.ds_api import QueryAPIs
from scenarios.switching import SwitchResume

# job type, the keyword arguments of a bad job, the field its error must name
BAD_JOBS = [
    (Train, dict(model="mlp"), "model"),
    (Train, dict(steps=0), "steps"),
    (Train, dict(gas=0), "gas"),
    (SaveMidway, dict(ckpt="/tmp/ckpt", steps=4, save_at=5), "save_at"),
    (SaveMidway, dict(save_at=1), "ckpt"),
    (Resume, dict(ckpt="/tmp/ckpt", steps=4, resume_at=4), "resume_at"),
    (CrashWhileSaving, dict(ckpt="/tmp/ckpt", point="anywhere"), "point"),
    (CrashWhileSaving, dict(ckpt="/tmp/ckpt", save_at=2, crash_at=2), "crash_at"),
    (PeerFault, dict(kind="explode", out="/tmp/out"), "kind"),
    (PeerFault, dict(kind="die"), "out"),
    (PeerFault, dict(out="/tmp/out", phase="backward"), "phase"),
    (PeerFault, dict(out="/tmp/out", ckpt="/tmp/ckpt", save_at=4, at_step=3), "save_at"),
    (FullDisk, dict(ckpt="/tmp/ckpt", point="anywhere", steps=4), "point"),
    (FullDisk, dict(ckpt="/tmp/ckpt", save_at=2, full_at=2, steps=4), "full_at"),
    (ScriptedPolicy, dict(script="cx"), "script"),
    (Evaluate, dict(model="mlp"), "model"),
    (ReduceCases, dict(backend="nccl"), "backend"),
    (ReduceCases, dict(kernels="fast"), "kernels"),
    (ReduceCases, dict(topology="ring"), "topology"),
    (ReduceCases, dict(layout="dense"), "layout"),
    (ReduceCases, dict(ranks_per_node=0), "ranks_per_node"),
    (MismatchedBucket, dict(layout="dense"), "layout"),
    (QuantizedGather, dict(format="int3"), "format"),
    (QuantizedGather, dict(hpz=0), "hpz"),
    (QuantizedGather, dict(node_size=-1), "node_size"),
    (OddModel, dict(case="huge"), "case"),
    (ConfigCase, dict(config=[("dgc", {})]), "config"),
    (ConfigCase, dict(hide_fused_op_on_rank=-1), "hide_fused_op_on_rank"),
    (InitConfigs, dict(cases={"misspelled": {"config": {}}}), "cases"),
    (InitConfigs, dict(cases={}), "cases"),
    (TrainSameData, dict(virtual_world=0), "virtual_world"),
    (SaveMidwaySameData, dict(ckpt="/tmp/ckpt", virtual_world=0), "virtual_world"),
    (ResumeSameData, dict(ckpt="/tmp/ckpt", virtual_world=-1), "virtual_world"),
    (QueryAPIs, dict(steps=0), "steps"),
    (SwitchResume, dict(ckpt="/tmp/ckpt", steps=4, resume_at=4), "resume_at"),
]


@pytest.mark.parametrize("job_type, kwargs, name", BAD_JOBS,
                         ids=[f"{t.__name__}-{name}-{i}" for i, (t, _, name) in enumerate(BAD_JOBS)])
def test_a_bad_job_is_refused_when_made_naming_the_field(job_type, kwargs, name):
    with pytest.raises(ValueError, match=name):
        job_type(**kwargs)


def test_every_job_type_is_checked_above_and_its_defaults_are_accepted():
    """Each registered job type has a bad case in BAD_JOBS, and its defaults (with what it requires) make a job."""
    assert set(SCENARIOS) <= {t for t, _, _ in BAD_JOBS}
    required = {SaveMidway: dict(ckpt="/tmp/ckpt"), Resume: dict(ckpt="/tmp/ckpt"), PeerFault: dict(out="/tmp/out"),
                CrashWhileSaving: dict(ckpt="/tmp/ckpt"), FullDisk: dict(ckpt="/tmp/ckpt"),
                SaveMidwaySameData: dict(ckpt="/tmp/ckpt"), ResumeSameData: dict(ckpt="/tmp/ckpt"),
                SwitchResume: dict(ckpt="/tmp/ckpt"),
                InitConfigs: dict(cases={"ok": ConfigCase()})}
    for job_type in SCENARIOS:
        job_type(**required.get(job_type, {}))


def test_a_reduce_run_name_gives_its_backend_and_kernels():
    assert ReduceCases.of_run("torch:reference", topology="hierarchical") == \
        ReduceCases(backend="torch", kernels="reference", topology="hierarchical")
    assert ReduceCases.of_run("mpi").kernels == "auto"
    with pytest.raises(ValueError, match="backend"):
        ReduceCases.of_run("gloo")


def test_a_job_of_an_unregistered_type_is_refused():
    @dataclass
    class Unknown:
        pass

    with pytest.raises(TypeError, match="Unknown"):
        run_job(Unknown(), 0)


def test_a_type_is_registered_once():
    @dataclass
    class Echo:
        value: int = 1

    def echo(job, rank):
        return (job.value, rank)

    try:
        scenario(Echo)(echo)
        assert run_job(Echo(3), 1) == (3, 1)
        with pytest.raises(ValueError, match="Echo already runs echo"):
            scenario(Echo)(lambda job, rank: None)
        assert SCENARIOS[Echo] is echo
    finally:
        SCENARIOS.pop(Echo, None)
    with pytest.raises(ValueError, match="Train already runs"):
        scenario(Train)(echo)
