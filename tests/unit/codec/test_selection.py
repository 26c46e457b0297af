"""Selection: DGC's sampled top-k threshold keeps within [0.8 k, 1.3 k] of the largest magnitudes."""

import pytest
import torch

from deepspeed_dgc.codec.selection import sample_indices, select_topk, target_count, topk_threshold

LOWER_SLACK, UPPER_SLACK = 0.8, 1.3  # DGC's bounds (the paper's numbers, not the module's constants)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _heavy_tailed(n, seed):
    """Gaussian over a power of a uniform: a power-law tail, like real gradient magnitudes."""
    g = _gen(seed)
    return torch.randn(n, generator=g) / torch.rand(n, generator=g).clamp_min(1e-6)**0.8


@pytest.mark.parametrize("dist", ["normal", "heavy", "sparse_spikes"])
@pytest.mark.parametrize("n", [4099, 100_003, 1 << 20])
@pytest.mark.parametrize("density", [0.1, 0.01, 0.001])
def test_threshold_count_within_dgc_bounds(dist, n, density):
    seed = n + int(density * 1e4)
    if dist == "normal":
        x = torch.randn(n, generator=_gen(seed))
    elif dist == "heavy":
        x = _heavy_tailed(n, seed)
    else:  # mostly tiny noise plus rare spikes: the sample often misses the spikes
        x = torch.randn(n, generator=_gen(seed)) * 1e-3
        x[torch.randint(0, n, (max(1, n // 5000), ), generator=_gen(seed + 1))] = 100.0
    k = target_count(n, density)
    count = int(select_topk(x, density, _gen(seed + 2)).sum())
    assert LOWER_SLACK * k <= count <= UPPER_SLACK * k, (count, k)


def test_selection_keeps_largest_magnitudes():
    x = torch.randn(50_000, generator=_gen(3))
    mask = select_topk(x, 0.01, _gen(4))
    assert float(x[mask].abs().min()) >= float(x[~mask].abs().max())


def test_density_one_keeps_everything():
    x = torch.randn(999, generator=_gen(5))
    assert bool(select_topk(x, 1.0).all())


@pytest.mark.parametrize("which", ["largest", "smallest"])
def test_corrections_bring_a_bad_sample_back_to_k(which):
    """A sample of the largest magnitudes puts the first threshold far too high (DGC's lowering rounds must bring the
    count up to 0.8 k); a sample of the smallest puts it far too low (the exact top-k step must cut to k)."""
    mag = torch.randn(100_000, generator=_gen(11)).abs()
    k = 1000
    order = torch.argsort(mag, descending=which == "largest")
    threshold = topk_threshold(mag, k, order[:2000])
    count = int((mag >= threshold).sum())
    if which == "largest":
        assert LOWER_SLACK * k <= count <= UPPER_SLACK * k, count
        assert count < 2000  # lowered a few times (x 0.8), not down to the whole tail
    else:
        assert count == k


@pytest.mark.parametrize("m, runs, length", [(150_001, 1500, 1), ((1 << 21) - 1, 20971, 1), (1 << 21, 1310, 16),
                                             (3_000_017, 1875, 16)])
def test_sample_is_runs_of_contiguous_positions_covering_the_tensor_evenly(m, runs, length):
    """From 2^21 elements, runs of 16 contiguous positions from multiples of 16, at least 1024 of them; below, single
    positions; over many draws every sixteenth of the tensor is hit as often as uniform sampling would (a chi-square
    test at about 1e-4)."""
    gen = _gen(m)
    s = sample_indices(m, m // 100, gen)
    assert s.dtype == torch.int64 and s.numel() == runs * length and runs >= 1024
    r = s.view(runs, length)
    assert bool((r[:, 0] % length == 0).all()) and bool((r - r[:, :1] == torch.arange(length)).all())
    assert 0 <= int(s.min()) and int(s.max()) < m
    starts = torch.cat([sample_indices(m, m // 100, gen)[::length] for _ in range(40)])
    counts = torch.bincount(starts * 16 // (m // length * length), minlength=16).double()
    expected = starts.numel() / 16
    assert float(((counts - expected)**2 / expected).sum()) < 45.0, counts  # chi-square, 15 degrees of freedom


def test_small_tensors_are_sampled_by_independent_positions():
    """Below 2^21 elements the draw is DGC's: torch.randint's positions, unchanged by the runs."""
    m = (1 << 21) - 1
    assert torch.equal(sample_indices(m, m // 100, _gen(7)), torch.randint(0, m, (m // 100, ), generator=_gen(7)))
