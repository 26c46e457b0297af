"""deepspeed_dgc: dynamic gradient compression for DeepSpeed ZeRO-3.

``DS_BUILD_DGC=1 pip install .`` (or ``-e .``) also prebuilds the fused ops with portable flags:
the CPU op always, the CUDA op when torch has CUDA and the CUDA toolkit is found
(``TORCH_CUDA_ARCH_LIST``, default ``8.0;9.0``). Without it the ops are JIT-built on first use.

Every install (wheel or editable) also puts ``deepspeed_dgc-autoload.pth`` into site-packages: it runs
``import deepspeed_dgc_autoload`` at interpreter start, so a ``"dgc"`` section takes effect even in a script that
never imports deepspeed_dgc (``DEEPSPEED_DGC_AUTOLOAD=0`` turns it off; see deepspeed_dgc_autoload.py).
"""

import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

AUTOLOAD_PTH = "deepspeed_dgc-autoload.pth"
AUTOLOAD_LINE = "import deepspeed_dgc_autoload\n"


class build_py_with_autoload(build_py):
    """A wheel's purelib root is site-packages: put the start-up hook's .pth there."""

    def run(self):
        super().run()
        if not self.editable_mode:
            with open(os.path.join(self.build_lib, AUTOLOAD_PTH), "w") as f:
                f.write(AUTOLOAD_LINE)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else outputs + [os.path.join(self.build_lib, AUTOLOAD_PTH)]


class editable_wheel_with_autoload(editable_wheel):
    """An editable wheel installs what lies at the root of its unpacked directory: add the .pth there too."""

    def _configure_build(self, name, unpacked_wheel, build_lib, tmp_dir):
        super()._configure_build(name, unpacked_wheel, build_lib, tmp_dir)
        with open(os.path.join(str(unpacked_wheel), AUTOLOAD_PTH), "w") as f:
            f.write(AUTOLOAD_LINE)


ext_modules, cmdclass = [], {"build_py": build_py_with_autoload, "editable_wheel": editable_wheel_with_autoload}
if os.environ.get("DS_BUILD_DGC", "0") == "1":
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from op_builder.dgc import PORTABLE_ENV, DGCCPUBuilder, DGCCUDABuilder

    os.environ[PORTABLE_ENV] = "1"  # no -march=native in a module that may run on another machine
    ext_modules.append(DGCCPUBuilder().builder())
    if torch.version.cuda and CUDA_HOME:
        ext_modules.append(DGCCUDABuilder().builder())
    else:
        print(f"DS_BUILD_DGC: skipping the CUDA op (torch CUDA {torch.version.cuda}, CUDA_HOME {CUDA_HOME})")
    cmdclass["build_ext"] = BuildExtension

setup(
    name="deepspeed_dgc",
    version="0.1.0",
    description="Top-k sparsified, INT4-quantized gradient reduce-scatter with error feedback for DeepSpeed ZeRO-3",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["deepspeed_dgc", "deepspeed_dgc.*", "op_builder", "op_builder.*"]),
    py_modules=["deepspeed_dgc_autoload"],
    python_requires=">=3.10",
    install_requires=[
        # The seam (a private ZeRO-3 method) was verified on 0.19.8 only; import fails loudly elsewhere.
        "deepspeed>=0.19.8,<0.20",
        "torch>=2.1",
        "numpy",
        "pydantic>=2",
    ],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
