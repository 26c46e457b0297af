"""The seam with DeepSpeed ZeRO-3: every patch in one module (:mod:`.patches`), the compressed reduce-scatter
(:mod:`.reduce_scatter`), the quantized parameter all-gather (:mod:`.allgather`), the owners' optimizer steps
(:mod:`.optimizer`), the checkpoint side-car (:mod:`.checkpoint`) and the per-engine state (:mod:`.state`)."""
