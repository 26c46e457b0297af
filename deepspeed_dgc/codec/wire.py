"""The wire format of a gradient payload (sender -> owner): writing one, and reading and summing many.

This module owns the bytes. One payload per owner row, aligned to 4 bytes::

    int32[5]  header: MAGIC, fingerprint (config and bucket shape), kept count, index bytes, scale words
    fp32[G]   group scales (groups restart at each tensor; absent without quantization); with INT1 and INT2
              a group holding exact zeros among non-zeros has a negative scale, and the bitmap of its
              non-zero values follows the scales as more fp32 words
              (:func:`~deepspeed_dgc.codec.formats.split_scales`), so exact zeros arrive as zeros
    values    kept values in column order: codes of the value format (INT4 two per byte, INT2 four,
              INT1 eight, FP8 one; :func:`~deepspeed_dgc.codec.formats.quantize_values`), or raw values
              in the communication dtype, multiplied by the row's ``raw_scale`` (the fp16 loss scale)
    uint8[]   positions of the kept values of sparsified tensors (the others are implied): varint
              gaps, or with ``index_coding`` "bitmap" one bit per real element of those tensors
              (:mod:`~deepspeed_dgc.codec.indices`); none (index bytes 0) where the payload keeps every
              real element of the row, sparsified tensors' too: every position is implied
    zeros     padding to a multiple of 4 bytes

A row whose sparse payload would not be smaller than the row sent whole goes whole: it keeps every real
element and sends no positions (:meth:`RowLayout.sends_whole`; with ties, an all-equal gradient keeps
everything at any density and then costs what a dense row does).

The fused ops (``csrc/dgc``) write the same bytes; the reference encoder calls :func:`pack`. A receiver
checks every header against what it expects (:class:`RowLayout`) before decoding, so ranks whose config
or bucket differ fail with :class:`DGCProtocolError` instead of summing garbage.
"""

import json
import zlib
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Tuple

import torch

from .formats import packed_bytes

MAGIC = 0x44474331  # "DGC1"
HEADER_INT32 = 5
HEADER_BYTES = 4 * HEADER_INT32


class DGCProtocolError(RuntimeError):
    """A payload from another rank does not match what this rank expects (config or bucket differ)."""


def fingerprint(description) -> int:
    """A 31-bit CRC-32 of a JSON-serialisable description of the config and bucket, written in every header."""
    return zlib.crc32(json.dumps(description).encode()) & 0x7FFFFFFF


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as 1-D uint8 (a view where possible)."""
    return t.contiguous().view(-1).view(torch.uint8)


def pack(fingerprint_: int, kept: int, scales: torch.Tensor, values: torch.Tensor, index_bytes: torch.Tensor) -> torch.Tensor:
    """One payload: header, fp32 scales, value bytes, index bytes, zero padding to 4 bytes.

    Args:
        fingerprint_: the bucket's :func:`fingerprint`.
        kept: number of values (the header's count).
        scales: fp32 ``(G,)``; values: codes (uint8) or raw values of any dtype; index_bytes: uint8.

    Returns:
        uint8 tensor on the values' device.
    """
    device = values.device
    header = torch.tensor([MAGIC, fingerprint_, kept, index_bytes.numel(), scales.numel()], dtype=torch.int32,
                          device=device)
    payload = torch.cat([as_bytes(header), as_bytes(scales), as_bytes(values), index_bytes])
    pad = -payload.numel() % 4
    return torch.cat([payload, payload.new_zeros(pad)]) if pad else payload


def raw_encode(values: torch.Tensor, dtype: torch.dtype, raw_scale: float) -> torch.Tensor:
    """Raw (unquantized) values as they travel: multiplied by ``raw_scale`` (the fp16 loss scale, so that a narrow
    communication dtype keeps the range stock's loss scaling gives it) and cast to the communication dtype."""
    return (values if raw_scale == 1 else values * raw_scale).to(dtype)


def raw_decode(values: torch.Tensor, raw_scale: float) -> torch.Tensor:
    """Inverse of :func:`raw_encode` (exact for a power-of-two scale): fp32, unscaled."""
    values = values.float()
    return values if raw_scale == 1 else values / raw_scale


@dataclass
class RowLayout:
    """What a receiver knows of its own row of a bucket, to check and decode the payloads sent to it.

    Attributes:
        fingerprint: expected in every header.
        chunks: columns of each tensor in the row (``c_i``); seg_real: real elements of each tensor in
            this row (the rest is padding); sparse: whether tensor i carries positions.
        quantize: values are codes of ``value_format`` (else raw ``value_dtype`` values).
        value_format, group_size: the quantized format and its values per scale.
        value_dtype: dtype of raw values; raw_scale: raw values arrive multiplied by it.
        index_coding: ``"varint"`` or ``"bitmap"``.
    """
    fingerprint: int
    chunks: Sequence[int]
    seg_real: Sequence[int]
    sparse: Sequence[bool]
    quantize: bool
    value_format: str
    group_size: int
    value_dtype: torch.dtype
    index_coding: str
    raw_scale: float = 1.0

    @property
    def row_numel(self) -> int:
        return sum(self.chunks)

    @property
    def n_implied(self) -> int:
        """Values sent without a position: every real element of the tensors sent whole."""
        return sum(r for r, s in zip(self.seg_real, self.sparse) if not s)

    def value_bytes(self, kept: int) -> int:
        """Bytes of ``kept`` values in this row's format."""
        if self.quantize:
            return packed_bytes(kept, self.value_format)
        return kept * torch.empty(0, dtype=self.value_dtype).element_size()

    def sections_bytes(self, counts: Sequence[int], index_bytes: int) -> int:
        """Bytes of a payload's scales, values and positions, the cost :meth:`sends_whole` compares.

        Args:
            counts: values kept of each tensor of the row (``T`` ints).
            index_bytes: bytes of the index section.

        Returns:
            ``4 * groups + value_bytes(sum(counts)) + index_bytes``, groups restarting at each tensor (none
            without quantization). Header and padding are left out (every payload has them), and so are the
            extra words of INT2/INT1 zero bitmaps (they depend on the values, not on how many are kept).
        """
        groups = sum(-(-n // self.group_size) for n in counts) if self.quantize else 0
        return 4 * groups + self.value_bytes(sum(counts)) + index_bytes

    def sends_whole(self, counts: Sequence[int], index_bytes: int) -> bool:
        """Whether a row whose sparse selection keeps ``counts[i]`` values of tensor i with ``index_bytes`` of
        positions goes whole instead (every real element kept, no positions sent): where the sparse payload would
        not be smaller, by :meth:`sections_bytes` (the fused CPU op's send_whole_rows computes the same). True
        where ``counts`` already is every real element (``seg_real``)."""
        return self.sections_bytes(counts, index_bytes) >= self.sections_bytes(self.seg_real, 0)


@dataclass
class Body:
    """The sections of one parsed payload (views into it)."""
    kept: int
    n_indexed: int
    scales: torch.Tensor
    values: torch.Tensor
    index_bytes: torch.Tensor


def _take(buf: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype) -> Tuple[torch.Tensor, int]:
    """View ``nbytes`` of uint8 ``buf`` at ``offset`` as ``dtype``; return it and the next offset."""
    if offset + nbytes > buf.numel():
        raise DGCProtocolError(f"payload too short: need {offset + nbytes} bytes, got {buf.numel()}")
    return buf[offset:offset + nbytes].view(dtype), offset + nbytes


def parse(buf: torch.Tensor, src: int, row: RowLayout) -> Body:
    """Split one payload into its sections after checking its header against ``row``.

    Args:
        buf: 1-D uint8 payload as received.
        src: the sender's rank in the communicator (named in errors).
        row: this rank's :class:`RowLayout`.

    Raises:
        DGCProtocolError: wrong magic or fingerprint (the sender's config, communication dtype or bucket
            differ), negative or inconsistent sizes, or a length that does not match the header.
    """
    header, off = _take(buf, 0, HEADER_BYTES, torch.int32)
    magic, fp, kept, n_index, n_groups = header.tolist()
    if magic != MAGIC or fp != row.fingerprint:
        raise DGCProtocolError(
            f"rank {src} sent a payload this rank cannot read (magic {magic:#x}, fingerprint {fp} vs "
            f"{row.fingerprint}): the 'dgc' config, the communication dtype or the bucket's tensor sizes "
            "differ between ranks")
    if min(kept, n_index, n_groups) < 0:
        raise DGCProtocolError(f"rank {src} sent negative sizes in its header {header.tolist()}")
    n_indexed = kept - row.n_implied
    if n_indexed < 0 and kept != 0:
        raise DGCProtocolError(f"rank {src} kept {kept} elements, fewer than the {row.n_implied} sent whole")
    scales, off = _take(buf, off, 4 * n_groups, torch.float32)
    if row.quantize:
        values, off = _take(buf, off, row.value_bytes(kept), torch.uint8)
    else:
        values, off = _take(buf, off, row.value_bytes(kept), row.value_dtype)
    index_bytes, off = _take(buf, off, n_index, torch.uint8)
    if buf.numel() - off >= 4:
        raise DGCProtocolError(f"rank {src} sent {buf.numel()} bytes, expected {off} plus padding")
    return Body(kept, n_indexed, scales, values, index_bytes)


def implied_view(body: Body, row: RowLayout) -> Tuple[Body, RowLayout]:
    """``(body, row)`` as a decoder reads them: a payload that keeps every real element of its row without index
    bytes was sent whole (:meth:`RowLayout.sends_whole`), so it is read as a row whose tensors are all sent whole
    (every position implied, none indexed); any other payload as it is."""
    if body.index_bytes.numel() == 0 and body.kept == sum(row.seg_real) and any(row.sparse):
        return replace(body, n_indexed=0), replace(row, sparse=[False] * len(row.sparse))
    return body, row


DecodeAdd = Callable[[torch.Tensor, Body, RowLayout], None]


def decode_sum(received: Sequence[torch.Tensor], row: RowLayout, decode_add: DecodeAdd,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode every sender's payload for this row and sum them, in sender order, into a dense fp32 row.

    Args:
        received: uint8 payload from each rank of the communicator, in rank order.
        row: this rank's :class:`RowLayout`.
        decode_add: adds one parsed body into the row (the ``decode_add`` of the reference or a fused op).
        out: fp32 ``(row_numel,)`` to add into; None: a new zero row on the payloads' device.

    Returns:
        fp32 ``(sum c_i,)``: the row in padded layout (padding stays 0).

    Raises:
        DGCProtocolError: a payload is malformed or was made under another config or bucket.
    """
    if out is None:
        device = received[0].device if len(received) else "cpu"
        out = torch.zeros(row.row_numel, dtype=torch.float32, device=device)
    for src, buf in enumerate(received):
        body = parse(buf, src, row)
        if body.kept == 0:
            continue  # a rank whose input was not finite sends nothing
        try:
            decode_add(out, body, row)
        except ValueError as err:
            raise DGCProtocolError(f"rank {src}: {err}") from None
    return out
