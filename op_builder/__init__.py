"""Out-of-tree DeepSpeed op builders for deepspeed_dgc's fused kernels.

``DGCCPUBuilder`` (OpenMP C++) and ``DGCCUDABuilder`` (CUDA) subclass DeepSpeed's own
builders; see :mod:`op_builder.dgc`.
"""

from .dgc import ALL_DGC_BUILDERS, DGCCPUBuilder, DGCCUDABuilder, builder_for_device  # noqa: F401
