"""Helpers shared by the worker processes of the multi-process tests."""

import datetime
import os
import sys

import deepspeed

TIMEOUT_S = 60


def init(backend: str = "gloo") -> int:
    """Join the process group started by tests/dist_launch.py with a collective timeout; return the rank."""
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return int(os.environ["RANK"])


def finish() -> None:
    """Exit at once after the results are saved: gloo/DeepSpeed teardown at interpreter exit
    sometimes aborts ("terminate called without an active exception") after all work is done,
    which is not what these tests examine."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
