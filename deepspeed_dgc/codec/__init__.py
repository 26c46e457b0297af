"""What goes on the wire and how: functions and ops on tensors, no processes, no ZeRO (the fused ops are built by
DeepSpeed's op builders, in :mod:`.kernels`).

- :mod:`.selection`: which elements are sent (DGC's sampled top-k threshold, Ok-Topk's reuse);
- :mod:`.formats`: value formats (INT4/INT2/INT1/FP8 gradients, INT8/FP8/INT4 weights) with group-wise scales;
- :mod:`.indices`: positions of the kept values (varint gaps, bitmaps);
- :mod:`.entropy`: DEFLATE of whole payloads;
- :mod:`.wire`: the payload format, both writing one and reading and summing many (:class:`DGCProtocolError`);
- :mod:`.job`: one bucket as an owner matrix (:class:`CompressJob`) and what compressing it gives back;
- :mod:`.reference`: the PyTorch implementation, the oracle; :mod:`.kernels`: the fused ops and the choice.
"""
