"""The checkpoint side-car on its own: same world size, re-sharded to another, dropped where it cannot fit, and
side-cars of an earlier version."""

import os

import torch

from deepspeed_dgc.config import DGCConfig
from deepspeed_dgc.zero3.checkpoint import FORMAT, load_state, save_state
from deepspeed_dgc.zero3.state import DGCState


def test_sidecar_at_another_world_size_flat_reshards_hierarchical_drops(tmp_path):
    saved = []
    for rank in range(2):
        state = DGCState.build(DGCConfig(enabled=True, residual_dtype="fp32"), global_rank=rank)
        state.dp_rank = rank
        state.memory.load({3: torch.randn(10), 7: torch.randn(5)})
        save_state(state, str(tmp_path), "tag", world_size=2)
        saved.append(state.memory.residuals())
    fresh = DGCState.build(DGCConfig(enabled=True, residual_dtype="fp32"), global_rank=0)
    msg = load_state(fresh, str(tmp_path), "tag", world_size=3, device=torch.device("cpu"))
    assert "world size 2" in msg and "has 3" in msg and "re-sharded 2 residuals" in msg
    assert torch.allclose(fresh.memory.get(3) * 3, saved[0][3] + saved[1][3], atol=1e-6)
    msg = load_state(fresh, str(tmp_path), "tag", world_size=2, device=torch.device("cpu"))
    assert msg.startswith("restored") and torch.equal(fresh.memory.get(3), saved[0][3])
    hier = DGCState.build(DGCConfig(enabled=True, topology="hierarchical", ranks_per_node=1), global_rank=0)
    hier.reducer.ranks_per_node = 1
    msg = load_state(hier, str(tmp_path), "tag", world_size=3, device=torch.device("cpu"))
    assert "cannot be re-sharded" in msg and "world size 2" in msg and "has 3" in msg
    assert len(hier.memory) == 0
    os.unlink(tmp_path / "tag" / "dgc_state_dp_rank_00001.pt")  # a side-car missing: nothing half-loaded
    msg = load_state(fresh, str(tmp_path), "tag", world_size=3, device=torch.device("cpu"))
    assert "is missing" in msg and len(fresh.memory) == 0


def test_fp8_residuals_restore_bit_for_bit_and_an_older_fp32_sidecar_still_loads(tmp_path):
    """The default storage (fp8) is saved as its codes and scales and restored exactly; a side-car of an earlier
    version (plain fp32 residuals, no storage name, no thresholds) loads into it, rounded once, and the log says so."""
    gen = torch.Generator().manual_seed(3)
    state = DGCState.build(DGCConfig(enabled=True), global_rank=0)
    state.dp_rank = 0
    for k, n in ((3, 1000), (7, 130)):
        state.memory.stage(k, torch.randn(n, generator=gen) * 10.0**k)
    state.memory.commit()
    save_state(state, str(tmp_path / "new"), "tag", world_size=2)
    fresh = DGCState.build(DGCConfig(enabled=True), global_rank=0)
    msg = load_state(fresh, str(tmp_path / "new"), "tag", world_size=2, device=torch.device("cpu"))
    assert msg.startswith("restored") and "rounded once" not in msg
    for k in (3, 7):
        assert all(torch.equal(a, b) for a, b in zip(fresh.memory.committed[k], state.memory.committed[k]))
    old = {k: torch.randn(n, generator=gen) for k, n in ((3, 1000), (7, 130))}
    path = tmp_path / "old" / "tag" / "dgc_state_dp_rank_00000.pt"
    path.parent.mkdir(parents=True)
    torch.save({"format": FORMAT, "world_size": 1, "dp_rank": 0, "config": {}, "residual_layout": "flat",
                "residuals": old, "generators": {}, "stats": {"steps": 4}, "momentum": None}, path)
    msg = load_state(fresh, str(tmp_path / "old"), "tag", world_size=1, device=torch.device("cpu"))
    assert "stored in fp32 and are now stored in fp8" in msg and fresh.reducer.thresholds == {}
    for k, v in old.items():
        got = fresh.memory.get(k)
        assert bool(((got - v).abs() <= 2**-4 * v.abs() + 1e-5 * float(v.abs().max())).all()) and not torch.equal(got, v)
