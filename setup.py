"""deepspeed_dgc: dynamic gradient compression for DeepSpeed ZeRO-3."""

from setuptools import find_packages, setup

setup(
    name="deepspeed_dgc",
    version="0.1.0",
    description="Top-k sparsified, INT4-quantized gradient reduce-scatter with error feedback for DeepSpeed ZeRO-3",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["deepspeed_dgc", "deepspeed_dgc.*", "op_builder", "op_builder.*"]),
    python_requires=">=3.10",
    install_requires=[
        # The seam (a private ZeRO-3 method) was verified on 0.19.8 only; import fails loudly elsewhere.
        "deepspeed>=0.19.8,<0.20",
        "torch>=2.1",
        "numpy",
        "pydantic>=2",
    ],
)
