"""Helpers shared by the worker processes of the multi-process tests."""

import datetime
import os

import deepspeed

# the world group's collective timeout (ZeRO-3's gradient norm is an all-reduce over the world); the fault tests
# shorten it with DGC_TEST_WORLD_TIMEOUT_S
TIMEOUT_S = float(os.environ.get("DGC_TEST_WORLD_TIMEOUT_S", 60))


def init(backend: str = "gloo") -> int:
    """Join the process group started by tests/dist_launch.py (or by mpirun, whose ``OMPI_COMM_WORLD_*``
    variables then give the ranks, with MASTER_ADDR/PORT passed by the test) with a collective
    timeout; return the rank."""
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ.update(RANK=os.environ["OMPI_COMM_WORLD_RANK"],
                          WORLD_SIZE=os.environ["OMPI_COMM_WORLD_SIZE"],
                          LOCAL_RANK=os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return int(os.environ["RANK"])


def finish() -> None:
    """Exit at once after the results are saved: gloo/DeepSpeed teardown at interpreter exit
    sometimes aborts ("terminate called without an active exception") after all work is done,
    which is not what these tests examine."""
    from deepspeed_dgc.comm.communicators import exit_without_finalization

    exit_without_finalization()
