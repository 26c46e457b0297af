"""Random buckets (:class:`~deepspeed_dgc.codec.job.CompressJob`) for the codec tests, and comparisons of outputs."""

import math

import torch

from deepspeed_dgc.codec import wire
from deepspeed_dgc.codec.job import CompressJob
from deepspeed_dgc.codec.selection import draw_samples

SIZES = [[1], [3, 70, 1001], [5, 3000, 2, 65537, 64]]


def make_job(numels, rows, *, hierarchical=False, dtype=torch.float32, residual=True, loss_scale=1.0, density=0.05,
             seed=0, group_size=16, min_numel=64, samples=None, value_format="int4", index_coding="varint"):
    """A random bucket of tensors of ``numels`` elements for ``rows`` owner rows.

    Flat: each tensor is a source of its own, divided by ``rows * loss_scale``. Hierarchical: the sources are
    columns of one ``(rows, C)`` node-sum matrix (the rows of owners ``2k + 1``, as local rank 1 of 2 per node
    sees them), divided by ``loss_scale``. Sources are scaled by a random power of ten per tensor.
    """
    g = torch.Generator().manual_seed(seed)
    world = 2 * rows if hierarchical else rows
    chunks = [-(-n // world) for n in numels]
    sparse = [n >= min_numel for n in numels]
    scales = [10.0**int(torch.randint(-3, 3, (1, ), generator=g)) for _ in numels]
    if hierarchical:
        owners = [2 * k + 1 for k in range(rows)]  # local rank 1 of each node
        C = sum(chunks)
        node_sum = torch.randn(rows, C, generator=g)
        col = 0
        for n, c in zip(numels, chunks):  # padding of the node sum is 0
            real = torch.tensor([max(0, min(c, n - o * c)) for o in owners])[:, None] > torch.arange(c)
            node_sum[:, col:col + c] = torch.where(real, node_sum[:, col:col + c], 0.0)  # +0, as the reducer's
            col += c
        srcs = [node_sum.view(-1).to(dtype)] * len(numels)
        offsets = [sum(chunks[:i]) for i in range(len(chunks))]
        strides = [C] * len(numels)
        res_numels = [rows * c for c in chunks]
        divisor = loss_scale
    else:
        owners = list(range(rows))
        srcs = [(torch.randn(n, generator=g) * s).to(dtype) for n, s in zip(numels, scales)]
        offsets, strides, res_numels, divisor = [0] * len(numels), chunks, list(numels), float(rows) * loss_scale
    residuals = [torch.randn(rn, generator=g) * 0.1 if residual else None for rn in res_numels]
    if hierarchical and residual:
        for r, n, c in zip(residuals, numels, chunks):  # padding of a residual stays 0
            real = (torch.tensor([max(0, min(c, n - o * c)) for o in owners])[:, None] > torch.arange(c)).view(-1)
            r.copy_(torch.where(real, r, 0.0))
    job = CompressJob(srcs, offsets, strides, list(numels), chunks, sparse, owners, residuals, res_numels, divisor,
                      density, [], group_size, True, torch.float32, 1234, residual, value_format=value_format,
                      index_coding=index_coding)
    job.samples = samples(job) if samples else draw_samples(job.real_totals(), sparse, density,
                                                            torch.Generator().manual_seed(seed + 1), "cpu")
    return job


def assert_same(a, b):
    """Two :class:`~deepspeed_dgc.codec.job.CompressOutput` are equal: payload bytes, residual bits, counts."""
    assert (a.finite, a.kept) == (b.finite, b.kept)
    assert len(a.payloads) == len(b.payloads)
    for x, y in zip(a.payloads, b.payloads):
        assert x.dtype == y.dtype == torch.uint8 and torch.equal(x, y)
    assert (a.residuals is None) == (b.residuals is None)
    for x, y in zip(a.residuals or [], b.residuals or []):
        assert x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))  # bits, signed zeros too


def decode_row(ops, job, row, payload, out=None):
    """Row ``row``'s payload parsed and added by ``ops`` into ``out`` (default: zeros); returns ``(out, body)``."""
    layout = job.row_layout(row)
    body = wire.parse(payload, 0, layout)
    out = torch.zeros(layout.row_numel, device=payload.device) if out is None else out
    if body.kept:
        ops.decode_add(out, body, layout)
    return out, body


def acc64(job):
    """float64 owner matrix ``(R, C)`` of ``src / divisor + residual`` (padding 0): the independent oracle of what a
    job accumulates."""
    blocks = []
    R = job.rows
    for i, src in enumerate(job.srcs):
        c = job.chunks[i]
        x = torch.as_strided(src, (R, c), (job.row_strides[i], 1), job.offsets[i]).double() if job.offsets[i] or \
            job.row_strides[i] != c or src.numel() != job.numels[i] else \
            torch.nn.functional.pad(src.double(), (0, R * c - job.numels[i])).view(R, c)
        a = x / job.divisor
        if job.residuals[i] is not None:
            r = job.residuals[i].double()
            a = a + torch.nn.functional.pad(r, (0, R * c - r.numel())).view(R, c)
        blocks.append(torch.where(job.real_mask(i, "cpu"), a, torch.zeros_like(a)))
    return torch.cat(blocks, dim=1)


def dct64(s: int) -> torch.Tensor:
    """The orthonormal DCT-II ``(s, s)`` in float64 from its definition (scipy's ``dct(norm="ortho")``): the oracle of
    the decoupled-momentum codec and of its engine replays."""
    n = torch.arange(s, dtype=torch.float64)
    d = torch.cos(math.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * s))
    return d * torch.where(n[:, None] == 0, math.sqrt(1.0 / s), math.sqrt(2.0 / s))


def count_ops():
    """A :class:`~deepspeed_dgc.syncs.HostSyncCounter` for code called from the package (its ``launches`` and
    ``syncs`` after the ``with`` block)."""
    from deepspeed_dgc.syncs import HostSyncCounter
    return HostSyncCounter()
