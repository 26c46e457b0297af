"""DeepSpeed op builders for the fused DGC kernels in ``csrc/dgc``.

DeepSpeed 0.19.8 (``ops/op_builder/builder.py``) resolves relative source paths against its own
install and only imports a prebuilt op that its own ``setup.py`` recorded
(``git_version_info.installed_ops``). These builders therefore

- resolve sources and include paths against this repository's ``csrc/dgc``,
- make them absolute in ``builder()`` too, so ``setup.py`` can prebuild from any directory,
- override ``load()``: the op already loaded in this process, else the prebuilt module
  ``deepspeed_dgc._prebuilt.<name>`` (``DS_BUILD_DGC=1 pip install .``), else a JIT build with
  torch's ``cpp_extension.load`` (cached in ``$TORCH_EXTENSIONS_DIR/<name>``), announced by one
  log line.

Flags: the JIT build may use ``-march=native`` (it runs where it was built); a prebuilt module
uses portable flags (x86-64-v2 at most, no ``-march=native``), and its passes over every element are also
built for AVX2 and picked at load time where the CPU has it (GCC ``target_clones`` in ``csrc/dgc/cpu_*``; the same
results: no contraction either way). Floating-point contraction is
off everywhere (``-ffp-contract=off``, nvcc ``--fmad=false``), and the CUDA build drops DeepSpeed's
``--use_fast_math`` for IEEE division and square root without flush-to-zero (``EXACT_NVCC_MATH``), so
results equal the PyTorch reference bit for bit. The CPU build adds ``-fno-trapping-math``: it changes no value
(IEEE rounding and signed zeros stay), only lets GCC compute both sides of a select such as the FP8 conversion's
(``dgc_math.h``) so that its loops vectorize. CUDA architectures come from ``TORCH_CUDA_ARCH_LIST``,
default ``8.0;9.0+PTX`` (A100, H100/H200, and PTX that a newer GPU's driver compiles at load); the variable is as it was once the flags are computed (DeepSpeed's
``jit_load`` restores it after a JIT build).
"""

import contextlib
import importlib
import logging
import os
import shutil

import torch
from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder
from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

logger = logging.getLogger("deepspeed_dgc")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(REPO_ROOT, "csrc", "dgc")
PREBUILT_PACKAGE = "deepspeed_dgc._prebuilt"
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"  # PTX of the newest: a later GPU JIT-compiles it
PORTABLE_ENV = "DGC_PORTABLE_BUILD"  # set by setup.py while prebuilding
ARCH_ENV = "TORCH_CUDA_ARCH_LIST"
# after DeepSpeed's flags: IEEE division and square root, subnormals kept, no fused multiply-add
# (DeepSpeed adds --use_fast_math, which means --ftz=true --prec-div=false --prec-sqrt=false --fmad=true)
EXACT_NVCC_MATH = ("--fmad=false", "--prec-div=true", "--prec-sqrt=true", "--ftz=false")


class _DGCBuilderMixin:
    """Out-of-tree paths, prebuilt lookup and a one-line JIT log, shared by both builders."""

    SOURCES = ()
    ABI = 1  # the module's calling convention (its ``ABI`` attribute, 1 where absent)

    def absolute_name(self):
        return f"{PREBUILT_PACKAGE}.{self.NAME}"

    def sources(self):
        return [os.path.join(CSRC, s) for s in self.SOURCES]

    def include_paths(self):
        return [CSRC]

    def deepspeed_src_path(self, code_path):
        return code_path if os.path.isabs(code_path) else os.path.join(REPO_ROOT, code_path)

    def sources_present(self):
        """(True, "") when every source file exists, else (False, the missing path)."""
        for path in self.sources():
            if not os.path.isfile(path):
                return False, f"source {path} is missing (JIT builds need a source checkout or an editable install)"
        return True, ""

    def prebuilt_module(self):
        """The module built at install time, or None."""
        try:
            return importlib.import_module(self.absolute_name())
        except ImportError:
            return None

    def load(self, verbose=False):
        """The op: already loaded, else prebuilt, else JIT-built (minutes on a slow machine, once).

        Raises:
            RuntimeError: the op is not compatible here or the build failed (message says why).
        """
        if self.name in OpBuilder._loaded_ops:
            return OpBuilder._loaded_ops[self.name]
        module = self.prebuilt_module()
        if module is not None and getattr(module, "ABI", 1) == self.ABI:
            OpBuilder._loaded_ops[self.name] = module
            return module
        if module is not None:  # built from older sources (an editable install not reinstalled since)
            logger.warning("deepspeed_dgc: the prebuilt %s has calling convention %s, these sources need %s; "
                           "ignoring it (rerun `make install` or `DS_BUILD_DGC=1 pip install -e .` to rebuild it)",
                           self.name, getattr(module, "ABI", 1), self.ABI)
        ok, why = self.sources_present()
        if not ok:
            raise RuntimeError(f"cannot JIT-build {self.name}: {why}")
        cache = os.environ.get("TORCH_EXTENSIONS_DIR", "the default torch_extensions cache")
        logger.warning("deepspeed_dgc: no prebuilt %s; JIT-building it (or loading the build cached) in %s", self.name,
                       cache)
        return self.jit_load(verbose)


class DGCCPUBuilder(_DGCBuilderMixin, CPUOpBuilder):
    """OpenMP C++ build of ``csrc/dgc/cpu_*.cpp`` (``compress_bucket``, ``decode_add``, ``topk_threshold``, the weights'
    codes), one file per stage (``cpu_common.h`` lists them)."""

    BUILD_VAR = "DS_BUILD_DGC"
    NAME = "dgc_cpu_op"
    SOURCES = ("cpu_threshold.cpp", "cpu_dense_pass.cpp", "cpu_compress.cpp", "cpu_decode.cpp", "cpu_residual_cache.cpp",
               "cpu_weights.cpp", "cpu_bindings.cpp")
    ABI = 4  # every value format (compress_bucket and decode_add take it), weight quantize and dequantize

    def __init__(self):
        super().__init__(name=self.NAME)

    def is_compatible(self, verbose=False):
        ok = shutil.which(os.environ.get("CXX", "c++")) is not None
        if not ok:
            self.warning(f"{self.NAME}: no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
        return ok

    def cxx_args(self):
        std = "-std=c++20" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 12) else "-std=c++17"
        # -g0: Python's CFLAGS ask for debug info, which makes this build (torch's headers) 40% slower (87 s against
        # 62 s on 2 cores) and the module 20x larger (13.8 MB against 0.6 MB)
        args = ["-O3", std, "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-Wno-reorder", "-g0"]
        if os.environ.get(PORTABLE_ENV) == "1":
            return args + ["-march=x86-64-v2"] if _is_x86() else args
        return args + [self.cpu_arch()]

    def extra_ldflags(self):
        return ["-fopenmp"]

    def builder(self):
        ext = super().builder()
        ext.sources = [os.path.abspath(s) for s in ext.sources]
        return ext


class DGCCUDABuilder(_DGCBuilderMixin, CUDAOpBuilder):
    """CUDA build of ``csrc/dgc/dgc_cuda.cu`` plus its binding ``dgc_cuda_binding.cpp``."""

    BUILD_VAR = "DS_BUILD_DGC"
    NAME = "dgc_cuda_op"
    ABI = 3  # the fixed layout's bucket stages (owner_gather, fixed_encode, fixed_decode), weights by segment tables
    SOURCES = ("dgc_cuda_binding.cpp", "dgc_cuda.cu", "dgc_cuda_fixed.cu")

    def __init__(self):
        super().__init__(name=self.NAME)

    def is_compatible(self, verbose=False):
        if torch.version.cuda is None:
            self.warning(f"{self.NAME}: this torch build has no CUDA (torch {torch.__version__})")
            return False
        if not torch.cuda.is_available() and os.environ.get(PORTABLE_ENV) != "1":
            self.warning(f"{self.NAME}: no CUDA device visible")
            return False
        return super().is_compatible(verbose)

    def compute_capability_args(self, cross_compile_archs=None):
        if "TORCH_CUDA_ARCH_LIST" not in os.environ and not getattr(self, "_jit_arch_list", None):
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS
        return super().compute_capability_args(cross_compile_archs)

    def cxx_args(self):
        return super().cxx_args() + ["-ffp-contract=off"]

    def nvcc_args(self):
        """DeepSpeed's nvcc flags without ``--use_fast_math``, then :data:`EXACT_NVCC_MATH`. Computing them sets
        ``TORCH_CUDA_ARCH_LIST`` (DeepSpeed's ``compute_capability_args``); outside a JIT build it is put back."""
        with _arch_list_kept(restore=not self.jit_mode):
            args = super().nvcc_args()
        return [a for a in args if a != "--use_fast_math"] + list(EXACT_NVCC_MATH)

    def builder(self):
        ext = super().builder()
        ext.sources = [os.path.abspath(s) for s in ext.sources]
        return ext


ALL_DGC_BUILDERS = (DGCCPUBuilder, DGCCUDABuilder)


def builder_for_device(device_type: str):
    """The builder class for a torch device type: ``"cuda"`` -> CUDA, anything else -> CPU."""
    return DGCCUDABuilder if device_type == "cuda" else DGCCPUBuilder


@contextlib.contextmanager
def _arch_list_kept(restore: bool):
    """Put ``TORCH_CUDA_ARCH_LIST`` back as it was (set, unset) on exit, if ``restore``."""
    before = os.environ.get(ARCH_ENV)
    try:
        yield
    finally:
        if restore and before is None:
            os.environ.pop(ARCH_ENV, None)
        elif restore:
            os.environ[ARCH_ENV] = before


def _is_x86() -> bool:
    import platform
    return platform.machine() in ("x86_64", "AMD64")
