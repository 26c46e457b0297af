"""Helpers shared by the worker processes of the multi-process tests."""

import datetime
import os

import deepspeed

TIMEOUT_S = 60


def init(backend: str = "gloo") -> int:
    """Join the process group started by tests/dist_launch.py with a collective timeout; return the rank."""
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return int(os.environ["RANK"])
