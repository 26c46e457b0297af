"""The backend a process group runs for a device, and a group's own timeout (what ``dgc.timeout_s: null`` takes)."""

import os
import subprocess
import sys

import pytest
import torch

from deepspeed_dgc.comm import communicators
from deepspeed_dgc.comm.communicators import backend_of, parse_backend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize("name, device, expected", [
    ("nccl", "cuda", "nccl"), ("gloo", "cpu", "gloo"), ("NCCL", "cuda", "nccl"),
    ("cpu:gloo,cuda:nccl", "cuda", "nccl"), ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
    ("cuda:nccl, cpu:gloo", "cuda", "nccl"), ("cpu:gloo", "cuda", ""), ("mpi", "cuda", "mpi"),
])
def test_backend_for_a_device(name, device, expected):
    """A group built with ``backend=None`` on a GPU machine reports ``"cpu:gloo,cuda:nccl"``: its CUDA tensors still
    go through NCCL (the stream waits), its host tensors through gloo (the host waits)."""
    assert parse_backend(name, device) == expected


def test_backend_of_a_mixed_group(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert backend_of(None, "cuda") == "nccl" and backend_of(None, "cpu") == "gloo"
    assert communicators.parse_backend(str(torch.distributed.get_backend(None)), "cuda") == "nccl"


def test_a_groups_own_timeout():
    """Read from the group itself: the world's as ``init_process_group`` got it, a ``new_group`` without one torch's
    default for gloo (30 min), one with a timeout that timeout."""
    code = """
import datetime, os, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=1234))
from deepspeed_dgc.comm.communicators import group_timeout_s
print(group_timeout_s(None, "cpu"), group_timeout_s(dist.new_group([0]), "cpu"),
      group_timeout_s(dist.new_group([0], timeout=datetime.timedelta(seconds=77)), "cpu"))
"""
    from dist_launch import free_port
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT, PORT=str(free_port())))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].split() == ["1234.0", "1800.0", "77.0"]
