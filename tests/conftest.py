"""Session set-up of the tests. Their import roots (tests/workers, tests, the repository root) are pytest.ini's
``pythonpath``."""

import glob
import os
import subprocess
import sys

import pytest
from dist_launch import stop_process_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# DeepSpeed JIT-builds its CPU shared-memory comm op on the first init_distributed (make install builds it here
# first: the Makefile's EXTENSIONS names this directory). Keep that build in this checkout: another venv sharing
# ~/.cache/torch_extensions rebuilds it with its own include paths, and a build killed half-way leaves a lock that
# makes every later launch wait forever. No build runs before the session starts, so a lock here is stale.
EXT_DIR = os.path.join(ROOT, "build", "torch_extensions")


def pytest_configure(config):
    """Before any test module is collected (so before anything imports DeepSpeed or starts a rank): the environment
    every test process and its ranks inherit, and no stale build lock."""
    # One ninja for every process: the multi-process tests put this environment's bin/ first on PATH
    # (for mpirun), and a build cache written by another ninja version counts as "command line
    # changed", so DeepSpeed's CPU comm op was rebuilt (about 35 s) each time the two alternated.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    os.environ["TORCH_EXTENSIONS_DIR"] = EXT_DIR
    _remove_build_locks()


def _remove_build_locks(names=None):
    """Delete the build locks under EXT_DIR (of the builds ``names`` only, where given): a build killed half-way leaves
    its lock, and every later load of that op would wait on it forever."""
    for dirpath, _, files in os.walk(EXT_DIR):
        if "lock" in files and (names is None or os.path.basename(dirpath) in names):
            os.unlink(os.path.join(dirpath, "lock"))


# JIT builds that tests need, started when the session's tests are collected, one after the other in the order of
# their first consumers, at the lowest CPU priority (_lowest_priority): they run in the cores' idle time (about a fifth
# of the suite's: rank start-up, waits on peers and timeouts) instead of inside the first test that needs them, which
# finds the build done or waits on its lock as it would on any build. Each: (name, the tests that need it, the
# build). A build still running when the session ends is stopped and its lock removed.
BACKGROUND_BUILDS = [
    # DeepSpeed's FusedAdam (its CPU accelerator's op: about 50 s, 90 s of CPU), which the README's quick start
    # config (an "Adam" section without torch_adam) builds in its first launch
    ("fused_adam", ("tests/distributed/test_readme.py",),
     "from deepspeed.accelerator import get_accelerator; "
     "get_accelerator().create_op_builder('FusedAdamBuilder').load(verbose=False)"),
    # the fused op's JIT path, whose build test_jit_path_loads then loads and checks against the reference
    ("dgc_cpu_op", ("tests/unit/codec/test_build.py::test_jit_path_loads",),
     "__import__('op_builder').DGCCPUBuilder().jit_load(verbose=False)"),
]
_background = {}


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    first = {}
    for i, item in enumerate(session.items):
        for name, consumers, code in BACKGROUND_BUILDS:
            if name not in first and item.nodeid.startswith(consumers):
                first[name] = (i, code)
    if first:
        codes = [code for _, code in sorted(first.values())]
        _background["names"] = list(first)
        _background["proc"] = subprocess.Popen(
            [sys.executable, "-c", "\n".join(codes)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env=dict(os.environ, PYTHONPATH=ROOT), preexec_fn=_lowest_priority)


def _lowest_priority():
    """Nice 19 for the process and, where the kernel groups processes by session (autogroup, Linux's default on
    desktops and on this machine), for its session's group: a process's nice weighs only within its group, and the
    groups (this session's, each launch's ranks') share the cores equally. With the process's nice alone, the builds
    slowed the memory benchmark's launches by half (105 s -> 159 s); with the group's, by a tenth (116 s)."""
    os.nice(19)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except OSError:  # no autogroup in this kernel: the process's nice is the one that counts
        pass


def pytest_unconfigure(config):
    proc = _background.get("proc")
    if proc is not None and proc.poll() is None:  # stopped half-way: the next build of it starts over
        stop_process_group(proc)
        _remove_build_locks(_background["names"])


SHM_LEFTOVERS = ("/dev/shm/sm_segment.*", "/dev/shm/deepspeed_allreduce_buffer_*")


@pytest.fixture(scope="session", autouse=True)
def remove_shared_memory_leftovers():
    """Delete the shared-memory files this session's processes leave behind: Open MPI's
    ``sm_segment.*`` of singleton or aborted MPI jobs, DeepSpeed's all-reduce buffers (16-69 MB each).
    Files that existed before the session are left alone."""
    before = {p for pattern in SHM_LEFTOVERS for p in glob.glob(pattern)}
    yield
    for pattern in SHM_LEFTOVERS:
        for path in set(glob.glob(pattern)) - before:
            try:
                os.unlink(path)
            except OSError:
                pass
