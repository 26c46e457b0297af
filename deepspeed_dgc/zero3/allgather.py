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

Payload of one rank's shard of n elements (its size fixed by the shard's parameters' sizes, so all ranks agree)::

    fp32[G]      scales, G = sum over the shard's parameters of ceil(shard_i / group_size)
    uint8[...]   codes (n bytes; INT4: ceil(n/2)), zero padding to 4 bytes
"""

import sys
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
from deepspeed import comm as dist
from deepspeed.utils import logger

from ..codec.formats import weight_code_bytes, weight_num_groups
from ..codec.reference import REFERENCE
from ..comm.communicators import backend_of, group_global_ranks, wait_torch_work
from ..comm.topology import node_of

FP32_BYTES = 4


def payload_bytes(numel: int, fmt: str, group_size: int, segments: Optional[Sequence[int]] = None) -> int:
    """Bytes of one rank's payload for a shard of ``numel`` elements (scales, codes, 4-byte padding)."""
    raw = FP32_BYTES * weight_num_groups(numel, group_size, segments) + weight_code_bytes(numel, fmt)
    return raw + (-raw % 4)


@dataclass
class ShardLayout:
    """What one gather's shard holds: one segment per parameter (scale groups restart at each, so parameters of
    different magnitudes never share a scale), and per segment how many elements are real on this rank (the rest
    is ZeRO-3's padding, whose memory DeepSpeed never clears: a checkpoint load or an optimizer step copies whatever
    the fp32 partition's padding holds into it). Segment lengths are the same on every rank; real counts are not."""
    segments: List[int]
    real: List[int]


# The DeepSpeed 0.19.8 functions that call ``_dist_allgather_fn`` and the names of their locals read here
# (closures of ``partition_parameters.Init._convert_to_deepspeed_param``; checked at import by ``check_layout_seam``).
CALLERS = {"_all_gather_dtype": ("params", "use_secondary_tensor", "rank_in_group"),
           "_all_gather_sequential": ("param", "use_secondary_tensor")}


def check_layout_seam(convert) -> Optional[str]:
    """None when ``convert`` (``Init._convert_to_deepspeed_param``) defines the callers of :data:`CALLERS` with the
    locals :func:`shard_layout` reads, else what is missing."""
    nested = {c.co_name: c for c in convert.__code__.co_consts if hasattr(c, "co_name")}
    for name, needed in CALLERS.items():
        code = nested.get(name)
        if code is None:
            return f"{name} (a closure of Init._convert_to_deepspeed_param)"
        missing = [v for v in needed if v not in code.co_varnames + code.co_freevars + code.co_cellvars]
        if missing:
            return f"the locals {missing} of {name}"
    return None


def _real(numel: int, shard: int, rank: int) -> int:
    return max(0, min(numel - rank * shard, shard))


def shard_layout(caller_locals: dict, shard_numel: int, rank: int) -> Optional[ShardLayout]:
    """The layout of the shard DeepSpeed is gathering, read from the calling function's locals (its parameters and
    whether it gathers hpZ's secondary shards); None when the caller is not one of :data:`CALLERS` or the sizes do not
    add up (then the shard is quantized as one segment)."""
    if "param" in caller_locals:  # _all_gather_sequential: one parameter at a time (its "params" are all of them)
        params = [caller_locals["param"]]
    elif "params" in caller_locals:  # _all_gather_dtype: the coalesced bucket
        params = caller_locals["params"]
        rank = caller_locals.get("rank_in_group", rank)
    else:
        return None
    secondary = caller_locals.get("use_secondary_tensor", False)
    try:
        if secondary:  # hpZ's secondary shards: DeepSpeed zero-pads them itself
            shards = [p.ds_secondary_tensor.numel() for p in params]
            real = list(shards)
        else:
            shards = [p.ds_tensor.ds_numel for p in params]
            real = [_real(p.ds_numel, s, rank) for p, s in zip(params, shards)]
    except AttributeError:
        return None
    if sum(shards) != shard_numel:
        return None
    return ShardLayout(shards, real)


class _DequantizeOnWait:
    """Handle returned to DeepSpeed: ``wait()`` finishes the gather and decodes every shard into ``output``."""

    def __init__(self, work, recv: torch.Tensor, output: torch.Tensor, numel: int, fmt: str, group_size: int,
                 timeout_s: float, segments: Optional[List[int]], ops=REFERENCE, nccl: bool = False):
        self.work, self.recv, self.output, self.ops, self.nccl = work, recv, output, ops, nccl
        self.numel, self.fmt, self.group_size, self.timeout_s, self.segments = numel, fmt, group_size, timeout_s, segments

    def wait(self) -> None:
        if self.work is None:
            return
        # NCCL: the stream waits (the host goes on launching, ZeRO-3's prefetch keeps overlapping) and NCCL's watchdog
        # bounds the gather by the group's timeout; gloo: the host waits, bounded by timeout_s
        wait_torch_work(self.work, "the quantized parameter all-gather", dist.get_rank(), self.timeout_s,
                        self.recv.is_cuda and self.nccl)
        if self.recv.is_cuda:  # made on DeepSpeed's gather stream, read (and freed) on the stream that waits here
            self.recv.record_stream(torch.cuda.current_stream(self.recv.device))
        n, p = self.numel, payload_bytes(self.numel, self.fmt, self.group_size, self.segments)
        n_scale = FP32_BYTES * weight_num_groups(n, self.group_size, self.segments)
        code_len = weight_code_bytes(n, self.fmt)
        world = self.recv.numel() // p
        pieces = self.recv.view(world, p)
        if self.fmt != "int4" or n % 2 == 0:  # every shard's codes end on a byte: all shards decode as one
            scales = pieces[:, :n_scale].contiguous().view(torch.float32).view(-1)
            codes = pieces[:, n_scale:n_scale + code_len].contiguous().view(-1)
            self.ops.dequantize_weights_into(self.output[:world * n], codes, scales, self.fmt, self.group_size,
                                             list(self.segments or [n]) * world)
        else:
            for r in range(world):
                scales = pieces[r, :n_scale].view(torch.float32)
                self.ops.dequantize_weights_into(self.output[r * n:(r + 1) * n], pieces[r, n_scale:n_scale + code_len],
                                                 scales, self.fmt, self.group_size, self.segments)
        self.work = self.recv = None


class QuantizedAllGather:
    """Drop-in for ``partition_parameters._dist_allgather_fn(input_shard, output_flat, group)``.

    Each parameter of the shard is quantized on its own (groups restart at each), and the padding of ZeRO-3's
    shards is sent as zeros whatever its memory holds (:class:`ShardLayout`).

    Args:
        fmt: ``"none"`` (stock gather, bytes only counted), ``"int8"``, ``"fp8_e4m3"`` or ``"int4"``.
        group_size: weights per fp32 scale.
        record: called as ``record(wire_bytes, dense_fp32_bytes, off_node_fraction)`` per gather, with
            the bytes this rank sends to the others, ``(W-1) * payload``, what an fp32 gather would
            send, ``(W-1) * n * 4``, and the fraction of the W-1 receivers on another node.
        stock: the function replaced (used for ``"none"`` and non-float tensors).
        timeout_s: bound on each quantized gather, seconds (:func:`~deepspeed_dgc.comm.communicators.wait_torch_work`).
        ranks_per_node: node size used to count ``off_node_peers`` (:func:`~deepspeed_dgc.comm.topology.node_of`).
        kernels: who codes the weights (``dgc.kernels``): the fused op of the shard's device or the reference
            (the same bytes; :func:`~deepspeed_dgc.codec.kernels.get_ops`).
        policy: ``policy: "auto"``'s :class:`~deepspeed_dgc.zero3.policy.LinkPolicy` (per shard size, stock's gather
            or the quantized one, whichever measures faster), or None: always quantized.
        clock: the applied optimizer steps so far (when the policy measures again).
    """

    def __init__(self, fmt: str, group_size: int, record: Callable[[int, float, float], None], stock: Callable,
                 timeout_s: float = 600.0, ranks_per_node: int = 1 << 30, kernels: str = "auto", policy=None,
                 clock: Callable[[], int] = lambda: 0):
        self.fmt, self.group_size, self.record, self.stock = fmt, group_size, record, stock
        self.policy, self.clock = policy, clock
        self.kernels = kernels
        self._ops = {}
        self.timeout_s, self.ranks_per_node = timeout_s, ranks_per_node
        self._off_node = {}
        self._warned = False

    def ops_for(self, device_type: str):
        """The ops that code weights on ``device_type``, chosen once."""
        if device_type not in self._ops:
            from ..codec.kernels import get_ops
            self._ops[device_type] = get_ops(self.kernels, device_type, True)
        return self._ops[device_type]

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
        layout = shard_layout(sys._getframe(1).f_locals, n, dist.get_rank(group=group))
        if layout is None and not self._warned:
            self._warned = True
            logger.warning("deepspeed_dgc: a parameter all-gather came from an unknown caller; its shard is quantized "
                           "as one block, with ZeRO-3's padding as it is")
        if self.policy is not None and self.policy.choose_gather(self, input_tensor, group, self.clock()) == "stock":
            self.record((world - 1) * n * input_tensor.element_size(), (world - 1) * n * FP32_BYTES, off_node)
            return self.stock(input_tensor, output_tensor, group)
        self.record((world - 1) * payload_bytes(n, self.fmt, self.group_size, layout and layout.segments),
                    (world - 1) * n * FP32_BYTES, off_node)
        return self.quantized(input_tensor, output_tensor, group, layout)

    def quantized(self, input_tensor: torch.Tensor, output_tensor: torch.Tensor, group=None,
                  layout: Optional[ShardLayout] = None):
        """The quantized gather of one shard (``layout``: its parameters, else one block), bytes not recorded.

        Returns:
            A handle whose ``wait()`` leaves the concatenated, dequantized shards in ``output_tensor``.
        """
        world = dist.get_world_size(group=group)
        n = input_tensor.numel()
        shard = input_tensor.reshape(-1)
        segments = None
        if layout is not None:
            segments = layout.segments
            if any(r < s for r, s in zip(layout.real, layout.segments)):
                shard = shard.clone()
                col = 0
                for s, r in zip(layout.segments, layout.real):
                    shard[col + r:col + s] = 0  # padding: sent as zeros, whatever the memory holds
                    col += s
        ops = self.ops_for(input_tensor.device.type)
        codes, scales = ops.quantize_weights(shard, self.fmt, self.group_size, segments)
        p = payload_bytes(n, self.fmt, self.group_size, segments)
        payload = torch.zeros(p, dtype=torch.uint8, device=input_tensor.device)
        payload[:scales.numel() * FP32_BYTES] = scales.view(torch.uint8)
        payload[scales.numel() * FP32_BYTES:scales.numel() * FP32_BYTES + codes.numel()] = codes
        recv = torch.empty(world * p, dtype=torch.uint8, device=input_tensor.device)
        work = dist.all_gather_into_tensor(recv, payload, group=group, async_op=True)
        return _DequantizeOnWait(work, recv, output_tensor, n, self.fmt, self.group_size, self.timeout_s, segments, ops,
                                 backend_of(group, "cuda") == "nccl")
