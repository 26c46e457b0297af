"""Start N real worker processes of a test script, as the deepspeed launcher would, with time limits."""

import glob
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remove_shm_buffers(port: int) -> None:
    """Delete DeepSpeed's CPU shared-memory all-reduce buffers of a finished job on ``port``.

    DeepSpeed 0.19.8's shm comm op (``ops/csrc/cpu/comm/shm.cpp``) never unlinks its
    ``/dev/shm/deepspeed_allreduce_buffer_*`` files (about 69 MB per rank), so every launch with
    a new port leaks memory until the machine runs out.
    """
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def launch(world: int, worker: str, args: Sequence[str] = (), timeout_s: float = 180.0,
           extra_env=None) -> List[RankResult]:
    """Run ``tests/workers/<worker>`` as ``world`` processes on 127.0.0.1; kill all after ``timeout_s``.

    Raises:
        TimeoutError: some rank was still running after ``timeout_s`` seconds (a hang).
    """
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ,
                   RANK=str(rank),
                   LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(world),
                   LOCAL_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port),
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1",
                   **(extra_env or {}))
        procs.append(
            subprocess.Popen([sys.executable, os.path.join(WORKERS, worker), *args],
                             env=env,
                             cwd=ROOT,
                             stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE,
                             text=True))
    results = []
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout_s)
            results.append(RankResult(rank, p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise TimeoutError(f"{worker} {' '.join(args)}: ranks still running after {timeout_s} s (hang?)")
    finally:
        for p in procs:
            p.wait()
        remove_shm_buffers(port)
    return results


def check_ok(results: List[RankResult]) -> None:
    """Assert every rank exited 0, showing the failing rank's stderr tail otherwise."""
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited {r.returncode}:\n{r.stderr[-4000:]}"
