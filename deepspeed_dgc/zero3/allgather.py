"""Quantized ZeRO-3 parameter all-gather (INT8 / FP8 e4m3 / INT4 weights), like ZeRO++ qwZ.

ZeRO-3 gathers every non-persistent parameter in forward and again in backward, so weights
cross the network about twice as often as gradients. This replaces the module global
``deepspeed.runtime.zero.partition_parameters._dist_allgather_fn`` through which every
coordinator-driven gather goes (forward, backward, prefetch, coalesced and single-parameter
fetches, hpZ secondary groups): each rank
quantizes its shard with group-wise absmax scales, one uint8 payload per rank is all-gathered,
and every shard is dequantized on arrival into DeepSpeed's buffer. Stored shards, master weights
and optimizer state are never touched; only the gathered copy used for forward and backward is
approximate, and it is identical on every rank (each rank decodes the same bytes, its own too).

Not covered (exact by design or out of reach): ``GatheredParameters``, checkpoint gathers and the
once-per-step gather of persistent parameters after ``optimizer.step`` (they call
``all_gather_into_tensor`` directly); the latter's bytes are reported as
``param_uncovered_bytes_total``.

Payload of one rank's shard of n elements (size fixed by n, so all ranks agree)::

    fp32[ceil(n/group_size)]  scales
    uint8[...]                codes (n bytes; INT4: ceil(n/2)), zero padding to 4 bytes
"""

from typing import Callable, Iterable

import torch
from deepspeed import comm as dist

from ..codec.formats import dequantize_weights, quantize_weights, weight_code_bytes, weight_num_groups
from ..comm.communicators import group_global_ranks, wait_torch_work
from ..comm.topology import node_of

FP32_BYTES = 4


def payload_bytes(numel: int, fmt: str, group_size: int) -> int:
    """Bytes of one rank's payload for a shard of ``numel`` elements (scales, codes, 4-byte padding)."""
    raw = FP32_BYTES * weight_num_groups(numel, group_size) + weight_code_bytes(numel, fmt)
    return raw + (-raw % 4)


class _DequantizeOnWait:
    """Handle returned to DeepSpeed: ``wait()`` finishes the gather and decodes every shard into ``output``."""

    def __init__(self, work, recv: torch.Tensor, output: torch.Tensor, numel: int, fmt: str, group_size: int,
                 timeout_s: float):
        self.work, self.recv, self.output = work, recv, output
        self.numel, self.fmt, self.group_size, self.timeout_s = numel, fmt, group_size, timeout_s

    def wait(self) -> None:
        if self.work is None:
            return
        wait_torch_work(self.work, "the quantized parameter all-gather", dist.get_rank(), self.timeout_s)
        n, p = self.numel, payload_bytes(self.numel, self.fmt, self.group_size)
        n_scale = FP32_BYTES * weight_num_groups(n, self.group_size)
        code_len = weight_code_bytes(n, self.fmt)
        world = self.recv.numel() // p
        for r in range(world):
            piece = self.recv[r * p:(r + 1) * p]
            scales = piece[:n_scale].view(torch.float32)
            values = dequantize_weights(piece[n_scale:n_scale + code_len], scales, n, self.fmt, self.group_size)
            self.output[r * n:(r + 1) * n].copy_(values)
        self.work = self.recv = None


class QuantizedAllGather:
    """Drop-in for ``partition_parameters._dist_allgather_fn(input_shard, output_flat, group)``.

    Args:
        fmt: ``"none"`` (stock gather, bytes only counted), ``"int8"``, ``"fp8_e4m3"`` or ``"int4"``.
        group_size: weights per fp32 scale.
        record: called as ``record(wire_bytes, dense_fp32_bytes, off_node_fraction)`` per gather, with
            the bytes this rank sends to the others, ``(W-1) * payload``, what an fp32 gather would
            send, ``(W-1) * n * 4``, and the fraction of the W-1 receivers on another node.
        stock: the function replaced (used for ``"none"`` and non-float tensors).
        timeout_s: bound on each quantized gather, seconds (:func:`~deepspeed_dgc.comm.communicators.wait_torch_work`).
        ranks_per_node: node size used to count ``off_node_peers`` (:func:`~deepspeed_dgc.comm.topology.node_of`).
    """

    def __init__(self, fmt: str, group_size: int, record: Callable[[int, float, float], None], stock: Callable,
                 timeout_s: float = 600.0, ranks_per_node: int = 1 << 30):
        self.fmt, self.group_size, self.record, self.stock = fmt, group_size, record, stock
        self.timeout_s, self.ranks_per_node = timeout_s, ranks_per_node
        self._off_node = {}

    def off_node_peers(self, group) -> int:
        """Ranks of ``group`` on another node than this rank (cached per group)."""
        if group not in self._off_node:
            me = node_of(dist.get_rank(), self.ranks_per_node)
            self._off_node[group] = sum(1 for g in group_global_ranks(group) if node_of(g, self.ranks_per_node) != me)
        return self._off_node[group]

    def __call__(self, input_tensor: torch.Tensor, output_tensor: torch.Tensor, group=None):
        """Gather every rank's shard ``input_tensor`` (1-D, n elements) into ``output_tensor`` (W*n).

        Returns:
            A handle whose ``wait()`` leaves the concatenated, dequantized shards in ``output_tensor``.
        """
        world = dist.get_world_size(group=group)
        n = input_tensor.numel()
        off_node = self.off_node_peers(group) / (world - 1) if world > 1 else 0.0
        if self.fmt == "none" or not output_tensor.is_floating_point():
            self.record((world - 1) * n * input_tensor.element_size(), (world - 1) * n * FP32_BYTES, off_node)
            return self.stock(input_tensor, output_tensor, group)
        if output_tensor.numel() != world * n:
            raise ValueError(f"quantized all-gather: output of {output_tensor.numel()} elements for {world} shards of {n}")
        codes, scales = quantize_weights(input_tensor.reshape(-1), self.fmt, self.group_size)
        p = payload_bytes(n, self.fmt, self.group_size)
        payload = torch.zeros(p, dtype=torch.uint8, device=input_tensor.device)
        payload[:scales.numel() * FP32_BYTES] = scales.view(torch.uint8)
        payload[scales.numel() * FP32_BYTES:scales.numel() * FP32_BYTES + codes.numel()] = codes
        recv = torch.empty(world * p, dtype=torch.uint8, device=input_tensor.device)
        work = dist.all_gather_into_tensor(recv, payload, group=group, async_op=True)
        self.record((world - 1) * p, (world - 1) * n * FP32_BYTES, off_node)
        return _DequantizeOnWait(work, recv, output_tensor, n, self.fmt, self.group_size, self.timeout_s)


def zero_shard_padding(params: Iterable[torch.nn.Parameter], rank: int) -> None:
    """Set the padding tail of each stored ZeRO-3 shard (``param.ds_tensor``) to 0.

    DeepSpeed allocates shards with ``torch.empty`` and copies the fp32 partition, padding included,
    back after every step, so the tail past the real elements holds stale memory. A quantizer that
    sees it may take a huge garbage value as a group's absmax and wipe out the real weights in that
    group. Real elements are not touched. (hpZ secondary shards are zero-padded by DeepSpeed.)

    Args:
        params: ZeRO-3 parameters (with ``ds_tensor`` and ``ds_numel``).
        rank: this rank in the parameters' data-parallel group.
    """
    with torch.no_grad():
        for p in params:
            shard = p.ds_tensor
            size = shard.numel()
            real = max(0, min(p.ds_numel - rank * size, size))
            if real < size:
                shard.narrow(0, real, size - real).zero_()
