"""The builds of the fused ops: the CUDA sources compile with the op builder's own flags (IEEE math in the PTX), the
JIT path and the prebuilt path (setup.py with
DS_BUILD_DGC=1) load and compute what the reference computes, and ``python -m deepspeed_dgc report`` lists each op."""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch
from dist_launch import stop_process_group

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _torch_includes():
    from torch.utils.cpp_extension import include_paths
    return [f"-I{p}" for p in include_paths()]


def _cuda_home():
    """The CUDA toolkit of the nvcc on PATH (``nvcc --dryrun`` prints its bin directory as ``_HERE_``), or skip."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    dry = subprocess.run([nvcc, "--dryrun", "x.cu"], capture_output=True, text=True, timeout=60)
    here = [line.split("=", 1)[1].strip() for line in (dry.stdout + dry.stderr).splitlines() if "_HERE_=" in line]
    return os.path.dirname(here[0]) if here else os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


@pytest.fixture
def cuda_builder(monkeypatch):
    """The op builder of the CUDA op, with torch's CUDA_HOME pointing at the installed toolkit (a CPU-only torch
    reports none), as a build on a GPU machine would see it."""
    import torch.utils.cpp_extension as cpp_extension
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", _cuda_home())
    from op_builder import DGCCUDABuilder
    return DGCCUDABuilder()


def _nvcc_flags(builder):
    """The builder's real nvcc flags, split into the -gencode targets and the rest."""
    args = builder.strip_empty_entries(builder.nvcc_args())
    return [a for a in args if a.startswith("-gencode")], [a for a in args if not a.startswith("-gencode")]


def _cu_sources(builder):
    return [s for s in builder.sources() if s.endswith(".cu")]


def test_nvcc_flags_give_ieee_math_and_leave_the_arch_list_alone(cuda_builder, monkeypatch, tmp_path):
    """The op builder's own nvcc_args(): DeepSpeed's --use_fast_math is gone, and the PTX of every .cu source built with
    them, for every target architecture, holds no approximate instruction (div/rcp/sqrt .approx) and no flush-to-zero
    (.ftz); the newest architecture also ships as PTX (a later GPU compiles it at load). TORCH_CUDA_ARCH_LIST is as it
    was before the flags were computed (unset, then set)."""
    for before in (None, "9.0"):
        if before is None:
            monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
        else:
            monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", before)
        gencode, flags = _nvcc_flags(cuda_builder)
        assert os.environ.get("TORCH_CUDA_ARCH_LIST") == before
    assert "--use_fast_math" not in flags and gencode
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    default, _ = _nvcc_flags(cuda_builder)
    assert any("code=compute_90" in g for g in default), default  # the default list ends in 9.0+PTX
    for cu in _cu_sources(cuda_builder):
        for arch in sorted({g.split("arch=")[1].split(",")[0] for g in gencode}):
            ptx = tmp_path / f"{arch}.ptx"
            cmd = ["nvcc", "-ptx", cu, "-o", str(ptx), f"-arch={arch}", f"-I{os.path.dirname(cu)}", *_torch_includes(),
                   *[f for f in flags if not f.startswith("--threads")]]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-4000:]
            bad = sorted({line.split()[0] for line in ptx.read_text().splitlines() if ".approx" in line or ".ftz" in line})
            assert not bad, f"{os.path.basename(cu)} {arch}: {bad}"


def test_cuda_sources_compile_with_the_builders_flags(cuda_builder, jit_check, tmp_path):
    """Every .cu source with nvcc and the builder's nvcc_args() (objects for every target architecture), and the binding
    dgc_cuda_binding.cpp through the host compiler's front end (``-fsyntax-only``: every declaration, type and template
    of torch's headers and the CUDA runtime's checked, no code generated; an object took twice as long, about 50 s
    on this 2-core machine) with the builder's cxx_args(). The compilers run at the same time, beside the JIT build of
    ``jit_check``."""
    gencode, flags = _nvcc_flags(cuda_builder)
    csrc = os.path.join(ROOT, "csrc", "dgc")
    nvccs = [["nvcc", "-c", cu, "-o", str(tmp_path / (os.path.basename(cu) + ".o")), f"-I{csrc}", *_torch_includes(),
              "-Xcompiler", "-fPIC", *gencode, *flags] for cu in _cu_sources(cuda_builder)]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cxx = [os.environ.get("CXX", "c++"), "-fsyntax-only", os.path.join(csrc, "dgc_cuda_binding.cpp"), "-fPIC",
           f"-I{csrc}", *_torch_includes(),
           f"-I{sysconfig.get_paths()['include']}", f"-I{os.path.join(_cuda_home(), 'include')}",
           "-DTORCH_EXTENSION_NAME=dgc_cuda_op", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           *cuda_builder.strip_empty_entries(cuda_builder.cxx_args())]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for cmd in nvccs + [cxx]]
    try:
        errors = [p.communicate(timeout=900)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    outs = [os.path.basename(cu) + ".o" for cu in _cu_sources(cuda_builder)]
    for p, err in zip(procs, errors):
        assert p.returncode == 0, err[-4000:]
    for out in outs:
        assert (tmp_path / out).stat().st_size > 0


CHECK_OP = """
import torch
from tests.unit.codec.jobs import make_job, assert_same
from deepspeed_dgc.codec.kernels import FusedCPUOps
from deepspeed_dgc.codec.reference import REFERENCE
op = {load}
job = make_job([5, 3000, 65537], 2, seed=5)
assert_same(REFERENCE.compress(job), FusedCPUOps(op).compress(job))
print("OP_FILE", op.__file__)
"""


def _start_check(load: str, env=None, cwd=ROOT) -> subprocess.Popen:
    """In a session of its own, so that ``stop_process_group`` ends its build with it."""
    return subprocess.Popen([sys.executable, "-c", CHECK_OP.format(load=load)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))


def _check_result(proc: subprocess.Popen, timeout: float = 900) -> str:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        stop_process_group(proc)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return out.split("OP_FILE ")[1].strip()


@pytest.fixture(scope="module")
def jit_check():
    """The JIT build's check, started once in the background: the CUDA compile test runs beside it, so the compilers
    share the cores; :func:`test_jit_path_loads` waits for it. In a session that collects that test, tests/conftest.py
    starts the same build at the session's start (BACKGROUND_BUILDS, in the cores' idle time), and whichever of the two
    takes the build's lock first builds (about 45 s on 2 cores), the other loads what it built."""
    proc = _start_check("__import__('op_builder').DGCCPUBuilder().jit_load(verbose=False)")
    yield proc
    stop_process_group(proc)
    proc.communicate()


def test_jit_path_loads(jit_check):
    """The JIT build (torch cpp_extension through DeepSpeed's builder) loads and equals the reference."""
    path = _check_result(jit_check)
    assert "torch_extensions" in path or os.environ["TORCH_EXTENSIONS_DIR"] in path


def test_prebuilt_path_loads(tmp_path):
    """The op prebuilt by ``DS_BUILD_DGC=1 python setup.py build_ext --inplace`` (``make install``; else built here
    with ``DS_BUILD_DGC=1 python setup.py build_ext``) is what ``load()`` imports, with no compiler and no JIT."""
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
