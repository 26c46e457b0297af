"""The builds of the fused ops: every .cu compiles with nvcc, the JIT path and the prebuilt path (setup.py with
DS_BUILD_DGC=1) load and compute what the reference computes, and ``python -m deepspeed_dgc report`` lists each op."""

import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _torch_includes():
    from torch.utils.cpp_extension import include_paths
    return [f"-I{p}" for p in include_paths()]


@pytest.mark.parametrize("cu", sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"), recursive=True)))
def test_cu_compiles_with_nvcc(cu, tmp_path):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        pytest.skip("nvcc is not installed")
    cmd = [nvcc, "-c", cu, "-o", str(tmp_path / "out.o"), "-std=c++17", "--fmad=false", "-O3",
           f"-I{os.path.dirname(cu)}", *_torch_includes(),
           "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "out.o").stat().st_size > 0


CHECK_OP = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.unit.codec.jobs import make_job, assert_same
from deepspeed_dgc.codec.kernels import FusedCPUOps
from deepspeed_dgc.codec.reference import REFERENCE
op = {load}
job = make_job([5, 3000, 65537], 2, seed=5)
assert_same(REFERENCE.compress(job), FusedCPUOps(op).compress(job))
print("OP_FILE", op.__file__)
"""


def _run_check(load: str, env=None, cwd=ROOT):
    code = CHECK_OP.format(root=ROOT, load=load)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.split("OP_FILE ")[1].strip()


def test_jit_path_loads():
    """The JIT build (torch cpp_extension through DeepSpeed's builder) loads and equals the reference."""
    path = _run_check("__import__('op_builder').DGCCPUBuilder().jit_load(verbose=False)")
    assert "torch_extensions" in path or os.environ["TORCH_EXTENSIONS_DIR"] in path


def test_prebuilt_path_loads(tmp_path):
    """The op prebuilt by ``DS_BUILD_DGC=1 pip install -e .`` (``make install``; else built here with
    ``DS_BUILD_DGC=1 python setup.py build_ext``) is what ``load()`` imports, with no compiler and no JIT."""
    built = glob.glob(os.path.join(ROOT, "deepspeed_dgc", "_prebuilt", "dgc_cpu_op*.so"))
    if not built:
        proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path),
                               "--build-temp", str(tmp_path / "tmp")], capture_output=True, text=True, timeout=900,
                              cwd=ROOT, env=dict(os.environ, DS_BUILD_DGC="1"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        built = glob.glob(str(tmp_path / "deepspeed_dgc" / "_prebuilt" / "dgc_cpu_op*.so"))
    assert built, "setup.py with DS_BUILD_DGC=1 built no dgc_cpu_op"
    # load it through the builder from a tree whose package holds the built module (no compiler needed)
    shutil.copytree(os.path.join(ROOT, "deepspeed_dgc"), tmp_path / "tree" / "deepspeed_dgc")
    shutil.copytree(os.path.join(ROOT, "op_builder"), tmp_path / "tree" / "op_builder")
    shutil.copy(built[0], tmp_path / "tree" / "deepspeed_dgc" / "_prebuilt")
    shutil.copytree(os.path.join(ROOT, "tests"), tmp_path / "tree" / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    code = CHECK_OP.format(root=str(tmp_path / "tree"), load="__import__('op_builder').DGCCPUBuilder().load()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path / "tree",
                          env=dict(os.environ, PYTHONPATH=str(tmp_path / "tree"), CXX="/nonexistent/c++",
                                   TORCH_EXTENSIONS_DIR=str(tmp_path / "no_jit")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "_prebuilt" in proc.stdout and not (tmp_path / "no_jit").exists()


def test_report_lists_every_op():
    proc = subprocess.run([sys.executable, "-m", "deepspeed_dgc", "report"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for key in ("deepspeed_dgc", "deepspeed", "torch", "accelerator", "nvcc", "mpi4py", "MPI library"):
        assert f"\n{key}" in out, key
    cpu = [line for line in out.splitlines() if line.startswith("dgc_cpu_op")][0]
    cuda = [line for line in out.splitlines() if line.startswith("dgc_cuda_op")][0]
    assert ": prebuilt" in cpu or ": JIT-compatible" in cpu, cpu
    if not torch.cuda.is_available():
        assert ": unavailable" in cuda and ("no CUDA" in cuda or "has no CUDA" in cuda), cuda
