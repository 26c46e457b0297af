"""Selection: which elements of a tensor are sent (DGC's sampled top-k threshold, Ok-Topk's reuse).

Pure functions on tensors. DGC (Lin et al., "Deep Gradient Compression", ICLR 2018, arXiv 1712.01887,
section 3 and its appendix) samples about 1% of ``|acc|``, takes the top-k threshold of the sample, then
corrects it towards the target count k: below 0.8 k kept it lowers the threshold (x 0.8, at most 10
rounds), above 1.3 k it takes the exact k-th largest of what was kept. The fused ops compute the same
values (``csrc/dgc/cpu_threshold.cpp``); these functions are the oracle.
"""

import math
from typing import List, Optional, Sequence

import torch

SAMPLE_FRACTION = 0.01
MIN_SAMPLE = 1024
MAX_RUN = 16  # positions per run of a large tensor's threshold sample (sample_indices)
RUN_MIN_NUMEL = 1 << 21  # from this many elements the sample is drawn in runs
UPPER_SLACK = 1.3  # kept > 1.3 k: exact top-k among the kept
LOWER_SLACK = 0.8  # kept < 0.8 k: lower the threshold
LOWER_FACTOR = 0.8
MAX_LOWER_ROUNDS = 10


def target_count(numel: int, density: float) -> int:
    """Number of elements top-k selection aims to keep: ``ceil(density * numel)``, at least 1.

    Args:
        numel: elements in the tensor (>= 1).
        density: fraction in (0, 1].
    """
    return min(numel, max(1, math.ceil(density * numel)))


def sample_size(numel: int) -> int:
    """Positions in DGC's threshold sample of a tensor of ``numel`` elements: ``max(1024, numel // 100)``."""
    return max(MIN_SAMPLE, int(numel * SAMPLE_FRACTION))


def run_length(numel: int) -> int:
    """Positions per run of the threshold sample of a tensor of ``numel`` elements: ``MAX_RUN`` (16 fp32 values, one
    64-byte cache line) from ``RUN_MIN_NUMEL`` (2^21) elements on, where the sample (at least 20,971 positions, so at
    least 1310 runs) is gathered from memory rather than cache; 1 (independent positions) below."""
    return MAX_RUN if numel >= RUN_MIN_NUMEL else 1


def sample_indices(numel: int, k: int, generator: Optional[torch.Generator] = None, device=None) -> Optional[torch.Tensor]:
    """Random positions on which DGC estimates the top-k threshold (Lin et al. 2018, appendix: about 1% of the
    elements); on tensors of 2^21 elements or more, drawn as runs of 16 contiguous positions (cluster sampling).

    DGC draws the sampled positions independently, as this does for tensors under 2^21 elements. From 2^21 on,
    ``n = m // 100`` positions are drawn as ``n // 16`` runs of 16 contiguous positions, each run starting at a
    uniformly drawn multiple of 16 in ``[0, m - 16]`` (with replacement): the sample then reads 16 times fewer cache
    lines of the gradient and the residual, which makes the fused op faster on large tensors. The price is a wider
    spread of the first threshold's count around k (neighbouring magnitudes are correlated), so DGC's correction
    rounds run a little more often (results/kernels.md). The last ``m % 16`` elements
    are in no run.

    Args:
        numel: elements m to select from.
        k: target count (:func:`target_count`).
        generator: random generator on ``device``; None uses torch's default.
        device: where the indices live.

    Returns:
        int64 tensor of ``max(1024, m // 100)`` positions in ``[0, m)`` (from 2^21 elements: ``(m // 100 // 16) * 16``
        positions in runs of 16), or None when every element is its own sample (``m <= 1024``) or no selection is
        needed (``k >= m``).
    """
    if k >= numel or numel <= MIN_SAMPLE:
        return None
    n_sample = sample_size(numel)
    length = run_length(numel)
    if length == 1:
        return torch.randint(0, numel, (n_sample, ), device=device, generator=generator)
    starts = torch.randint(0, numel // length, (n_sample // length, 1), device=device, generator=generator) * length
    return (starts + torch.arange(length, device=device)).reshape(-1)


def draw_samples(real_totals: Sequence[int], estimate: Sequence[bool], density: float,
                 generator: Optional[torch.Generator], device) -> List[Optional[torch.Tensor]]:
    """Threshold samples of a bucket's tensors, drawn in tensor order from ``generator``.

    Args:
        real_totals: real elements per tensor (all owner rows of a :class:`~deepspeed_dgc.codec.job.CompressJob`).
        estimate: per tensor, whether its threshold is estimated (sparse and not reused).
        density: the bucket's density.
        generator: random generator on ``device``.

    Returns:
        Per tensor, :func:`sample_indices` (None for tensors not estimated or small enough to use whole).
        Reference and fused ops use the same draws, so they select the same elements.
    """
    return [
        sample_indices(m, target_count(m, density), generator, device) if e else None
        for m, e in zip(real_totals, estimate)
    ]


def topk_threshold(mag: torch.Tensor, k: int, sample: Optional[torch.Tensor]) -> torch.Tensor:
    """DGC's top-k threshold: estimated on a sample, then corrected towards k.

    The threshold is the ``ceil(s * k / m)``-th largest of the ``s`` sampled magnitudes. If it keeps
    fewer than 0.8 k elements it is multiplied by 0.8 (fp32), at most 10 times; if it then keeps more
    than 1.3 k, it becomes the k-th largest of the kept magnitudes (an exact top-k up to ties).
    Lin et al., ICLR 2018, section 3 and the sampling of its appendix.

    Args:
        mag: 1-D fp32 tensor of m >= 1 finite magnitudes.
        k: target count, ``1 <= k < m``.
        sample: int64 positions into ``mag`` (:func:`sample_indices`), or None for all of ``mag``.

    Returns:
        0-d fp32 tensor: keep the elements with ``mag >= threshold``.
    """
    m = mag.numel()
    s = mag if sample is None else mag[sample]
    k_sample = max(1, math.ceil(s.numel() * k / m))
    threshold = torch.topk(s, k_sample, sorted=False).values.min()
    count = int((mag >= threshold).sum())
    rounds = 0
    while count < LOWER_SLACK * k and rounds < MAX_LOWER_ROUNDS:
        threshold = threshold * LOWER_FACTOR
        count = int((mag >= threshold).sum())
        rounds += 1
    return _cap_upper(mag, k, threshold, count)


def _cap_upper(mag: torch.Tensor, k: int, threshold: torch.Tensor, count: int) -> torch.Tensor:
    """DGC's upper correction: more than 1.3 k kept (``count``) becomes the k-th largest of the kept."""
    if count > UPPER_SLACK * k:
        threshold = torch.topk(mag[mag >= threshold], k, sorted=False).values.min()
    return threshold


def reused_threshold(mag: torch.Tensor, k: int, threshold: float) -> torch.Tensor:
    """A threshold estimated at an earlier step, reused (Ok-Topk's threshold reuse: Li and Hoefler, PPoPP 2022,
    "Near-Optimal Sparse Allreduce for Distributed Deep Learning", section 3.1.3).

    The count it keeps may differ from k; no lowering rounds run (error feedback carries what stays below it to
    the next step), but if it keeps more than 1.3 k it becomes the k-th largest of the kept, as in
    :func:`topk_threshold`, so a payload never grows past that bound.

    Args:
        mag: 1-D fp32 tensor of m >= 1 finite magnitudes.
        k: target count, ``1 <= k < m``.
        threshold: the reused threshold, in the units of ``mag`` (>= 0); rounded to fp32.

    Returns:
        0-d fp32 tensor: keep the elements with ``mag >= threshold``.
    """
    t = torch.tensor(threshold, dtype=torch.float32, device=mag.device)
    return _cap_upper(mag, k, t, int((mag >= t).sum()))


def select_topk(x: torch.Tensor, density: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Select about ``density * numel`` elements of largest magnitude, as DGC does.

    :func:`sample_indices` then :func:`topk_threshold` on ``|x|``.

    Args:
        x: 1-D floating tensor of n >= 1 elements, finite.
        density: target fraction kept, in (0, 1]; 1 keeps everything.
        generator: random generator for the sample (on ``x.device``); None uses torch's default.

    Returns:
        Bool mask, shape ``(n,)``, True where the element is kept. Its count is at least k (more only
        on ties) when the exact step ran, and otherwise within [0.8 k, 1.3 k] unless 10 lowering
        rounds did not reach 0.8 k (e.g. most elements are exactly zero).
    """
    n = x.numel()
    k = target_count(n, density)
    if k >= n:
        return torch.ones(n, dtype=torch.bool, device=x.device)
    mag = x.abs()
    return mag >= topk_threshold(mag, k, sample_indices(n, k, generator, x.device))
