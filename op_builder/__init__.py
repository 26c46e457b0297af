"""Out-of-tree DeepSpeed op builders for the fused DGC kernels.

No fused op exists yet: every compression step runs the PyTorch reference path in
``deepspeed_dgc.compressor``. The CPU and CUDA builders land with the fused kernels.
"""
