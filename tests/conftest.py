"""Session set-up of the tests. Their import roots (tests/workers, tests, the repository root) are pytest.ini's
``pythonpath``."""

import glob
import os
import sys

import pytest

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
    for dirpath, _, files in os.walk(EXT_DIR):
        if "lock" in files:
            os.unlink(os.path.join(dirpath, "lock"))


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
