"""Selection: DGC's sampled top-k threshold keeps within [0.8 k, 1.3 k] of the largest magnitudes."""

import pytest
import torch

from deepspeed_dgc.codec.selection import LOWER_SLACK, UPPER_SLACK, select_topk, target_count


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
