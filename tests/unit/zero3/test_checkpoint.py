"""The checkpoint side-car on its own: same world size, re-sharded to another, dropped where it cannot fit, refused
where it does not fit this model, damaged, another checkpoint's or missing, written atomically (a full disk), and
side-cars of an earlier version."""

import errno
import os
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepspeed_dgc.config import DGCConfig
from deepspeed_dgc.zero3.checkpoint import NOT_ROUTINE, DGCCheckpointError, load_state, read_sidecar, save_state
from deepspeed_dgc.zero3.state import DGCState

CPU = torch.device("cpu")


class TwoParams(torch.nn.Module):
    """Parameters ``a`` (n_a elements) and ``b`` (n_b), numbered ``first_ds_id``, ``first_ds_id + 1`` as ZeRO-3 would."""

    def __init__(self, n_a=10, n_b=5, first_ds_id=0):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(n_a))
        self.b = torch.nn.Parameter(torch.zeros(n_b))
        for i, p in enumerate((self.a, self.b)):
            p.ds_id, p.ds_numel = first_ds_id + i, p.numel()


def _state(cfg=None, rank=0, world=2, module=None, first_ds_id=0):
    return DGCState.build(cfg or DGCConfig(enabled=True, residual_dtype="fp32"), global_rank=rank,
                          module=module or TwoParams(first_ds_id=first_ds_id), dp_rank=rank, dp_world_size=world)


def test_sidecar_at_another_world_size_flat_reshards_hierarchical_drops(tmp_path):
    saved = []
    for rank in range(2):
        state = _state(rank=rank)
        state.memory.load({"a": torch.randn(10), "b": torch.randn(5)})
        save_state(state, str(tmp_path), "tag", world_size=2)
        saved.append(state.memory.residuals())
    fresh = _state(world=3)
    msg = load_state(fresh, str(tmp_path), "tag", world_size=3, device=CPU)
    assert "world size 2" in msg and "has 3" in msg and "re-sharded 2 residuals" in msg
    assert torch.allclose(fresh.memory.get("a") * 3, saved[0]["a"] + saved[1]["a"], atol=1e-6)
    fresh.stats.world_size = 2
    msg = load_state(fresh, str(tmp_path), "tag", world_size=2, device=CPU)
    assert msg.startswith("restored") and torch.equal(fresh.memory.get("a"), saved[0]["a"])
    hier = _state(DGCConfig(enabled=True, topology="hierarchical", ranks_per_node=1), world=3)
    hier.reducer.ranks_per_node = 1
    msg = load_state(hier, str(tmp_path), "tag", world_size=3, device=CPU)
    assert "cannot be re-sharded" in msg and "world size 2" in msg and "has 3" in msg
    assert len(hier.memory) == 0
    os.unlink(tmp_path / "tag" / "dgc_state_dp_rank_00001.pt")  # a side-car missing: nothing half-loaded
    msg = load_state(fresh, str(tmp_path), "tag", world_size=3, device=CPU)
    assert "is missing" in msg and len(fresh.memory) == 0


def test_state_that_does_not_fit_this_model_is_refused_naming_the_parameter(tmp_path):
    """A side-car saved from another model (a parameter of another size, or one this model lacks) raises
    DGCCheckpointError naming the parameter and both sizes, on load at the same and at another world size."""
    state = _state()
    state.memory.load({"a": torch.randn(10), "b": torch.randn(5)})
    save_state(state, str(tmp_path), "tag", world_size=2)
    bigger = _state(module=TwoParams(n_a=12))
    with pytest.raises(DGCCheckpointError, match=r"the residual of parameter 'a' has 10 elements, this run needs 12"):
        load_state(bigger, str(tmp_path), "tag", world_size=2, device=CPU)

    class Other(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(10))

    other = _state(module=Other())
    with pytest.raises(DGCCheckpointError, match=r"holds a residual for parameter 'b', which this model does not have"):
        load_state(other, str(tmp_path), "tag", world_size=2, device=CPU)
    state.dp_rank = 1  # both ranks' side-cars: loaded at 3 ranks, they are re-sharded, then checked
    save_state(state, str(tmp_path), "tag", world_size=2)
    other.stats.world_size = 3
    with pytest.raises(DGCCheckpointError, match=r"holds a residual for parameter 'b', which this model does not have"):
        load_state(other, str(tmp_path), "tag", world_size=3, device=CPU)


def test_fp8_residuals_restore_bit_for_bit_and_an_older_sidecar_still_loads(tmp_path):
    """The default storage (fp8) is saved as its codes and scales and restored exactly. A side-car of an earlier
    version (format 1: plain fp32 residuals keyed by ZeRO-3's ds_id, no storage name, no thresholds) loads into a
    model whose parameters were numbered after another model's: mapped in order, rounded once, and the log says so."""
    gen = torch.Generator().manual_seed(3)
    module = TwoParams(n_a=1000, n_b=130)
    state = _state(DGCConfig(enabled=True), module=module)
    for k, n, e in (("a", 1000, 3), ("b", 130, 7)):
        state.memory.stage(k, torch.randn(n, generator=gen) * 10.0**e)
    state.memory.commit()
    save_state(state, str(tmp_path / "new"), "tag", world_size=2)
    fresh = _state(DGCConfig(enabled=True), module=TwoParams(n_a=1000, n_b=130))
    msg = load_state(fresh, str(tmp_path / "new"), "tag", world_size=2, device=CPU)
    assert msg.startswith("restored") and "rounded once" not in msg
    for k in ("a", "b"):
        assert all(torch.equal(a, b) for a, b in zip(fresh.memory.committed[k], state.memory.committed[k]))
    old = {3: torch.randn(1000, generator=gen), 4: torch.randn(130, generator=gen)}  # ds_ids of the saving process
    path = tmp_path / "old" / "tag" / "dgc_state_dp_rank_00000.pt"
    path.parent.mkdir(parents=True)
    torch.save({"format": 1, "world_size": 1, "dp_rank": 0, "config": {}, "residual_layout": "flat",
                "residuals": old, "generators": {}, "stats": {"steps": 4}, "momentum": None}, path)
    resumed = _state(DGCConfig(enabled=True), world=1, module=TwoParams(n_a=1000, n_b=130, first_ds_id=9))
    msg = load_state(resumed, str(tmp_path / "old"), "tag", world_size=1, device=CPU)
    assert "stored in fp32 and are now stored in fp8" in msg and resumed.reducer.thresholds == {}
    for k, v in (("a", old[3]), ("b", old[4])):
        got = resumed.memory.get(k)
        assert bool(((got - v).abs() <= 2**-4 * v.abs() + 1e-5 * float(v.abs().max())).all()) and not torch.equal(got, v)


@pytest.mark.parametrize("world", [2, 3])
def test_a_run_resumed_with_other_dgc_settings_is_told_which(tmp_path, world):
    """Saved with density 0.01 and INT4, resumed with density 0.1 and INT2 (at the same world size and re-sharded at
    another): the message names each changed setting with both values, and is not a routine one; resumed with the
    saved settings, it names none."""
    saved_cfg = DGCConfig(enabled=True, residual_dtype="fp32", density=0.01, quantization="int4")
    for rank in range(2):
        state = _state(saved_cfg, rank=rank)
        state.memory.load({"a": torch.randn(10), "b": torch.randn(5)})
        save_state(state, str(tmp_path), "tag", world_size=2)
    changed = _state(DGCConfig(enabled=True, residual_dtype="fp32", density=0.1, quantization="int2"), world=world)
    msg = load_state(changed, str(tmp_path), "tag", world_size=world, device=CPU)
    assert "settings differ from this run's (density 0.01 -> 0.1, quantization 'int4' -> 'int2')" in msg, msg
    assert any(mark in msg for mark in NOT_ROUTINE)
    same = _state(saved_cfg, world=world)
    msg = load_state(same, str(tmp_path), "tag", world_size=world, device=CPU)
    assert "differ" not in msg and not any(mark in msg for mark in NOT_ROUTINE), msg


def _saved(tmp_path, rank=0, world=2, tag="tag", n_a=10, n_b=5):
    """A side-car of fresh random residuals saved by ``rank``; returns (state, its path)."""
    state = _state(rank=rank, world=world, module=TwoParams(n_a, n_b))
    state.memory.load({"a": torch.randn(n_a), "b": torch.randn(n_b)})
    return state, save_state(state, str(tmp_path), tag, world_size=world)


def test_a_truncated_sidecar_is_refused_naming_it(tmp_path):
    """Cut at any length, a side-car raises DGCCheckpointError naming the file (not torch's zip error), and loads
    nothing; whole, it loads."""
    state, path = _saved(tmp_path)
    data = open(path, "rb").read()
    for cut in sorted(set(int(x) for x in torch.randint(0, len(data), (6,)))) + [len(data) - 1]:
        with open(path, "wb") as f:
            f.write(data[:cut])
        fresh = _state()
        with pytest.raises(DGCCheckpointError, match=r"dgc_state_dp_rank_00000\.pt"):
            load_state(fresh, str(tmp_path), "tag", world_size=2, device=CPU)
        assert len(fresh.memory) == 0
    with open(path, "wb") as f:
        f.write(data)
    fresh = _state()
    assert load_state(fresh, str(tmp_path), "tag", world_size=2, device=CPU).startswith("restored")
    assert torch.equal(fresh.memory.get("a"), state.memory.get("a"))


@settings(max_examples=60, deadline=None)
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)), min_size=1, max_size=4))
def test_random_damage_is_refused_or_harmless(tmp_path_factory, flips):
    """Bits flipped anywhere in a side-car (most of it residual values): reading it raises DGCCheckpointError (nothing
    else), or, where the flips hit bytes no reader looks at, returns exactly what was saved; never other residuals."""
    tmp_path = tmp_path_factory.mktemp("damage")
    state, path = _saved(tmp_path, n_a=3000, n_b=1000)
    clean = read_sidecar(path, "tag")
    data = bytearray(open(path, "rb").read())
    for where, bit in flips:
        data[int(where * len(data))] ^= 1 << bit
    with open(path, "wb") as f:
        f.write(bytes(data))
    try:
        got = read_sidecar(path, "tag")
    except DGCCheckpointError as err:
        assert path in str(err)
        return
    assert got.keys() == clean.keys()
    for k in ("a", "b"):
        assert torch.equal(got["residuals"][k], clean["residuals"][k])


def test_a_damaged_byte_of_the_state_is_named_by_the_checksum(tmp_path):
    """A byte flipped in the middle of a side-car (its state) loads as bytes but fails the SHA-256: the error says the
    content does not match the checksum."""
    _, path = _saved(tmp_path, n_a=3000, n_b=1000)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(DGCCheckpointError, match=r"00000\.pt is damaged: its content does not match the checksum"):
        read_sidecar(path, "tag")


def test_a_sidecar_of_another_checkpoint_or_rank_is_refused(tmp_path):
    """A side-car copied from another tag, or rank 1's renamed as rank 0's, raises DGCCheckpointError saying so."""
    _, path = _saved(tmp_path, tag="step5")
    (tmp_path / "step9").mkdir()
    shutil.copy(path, tmp_path / "step9" / "dgc_state_dp_rank_00000.pt")
    with pytest.raises(DGCCheckpointError, match=r"saved for checkpoint 'step5', not 'step9'"):
        load_state(_state(), str(tmp_path), "step9", world_size=2, device=CPU)
    _, p1 = _saved(tmp_path, rank=1, tag="mixed")
    _saved(tmp_path, rank=0, tag="mixed")
    os.replace(p1, tmp_path / "mixed" / "dgc_state_dp_rank_00000.pt")
    with pytest.raises(DGCCheckpointError, match=r"state of data-parallel rank 1, read by rank 0"):
        load_state(_state(), str(tmp_path), "mixed", world_size=2, device=CPU)
    with pytest.raises(DGCCheckpointError, match=r"dgc_state_dp_rank_00001\.pt is missing"):
        load_state(_state(rank=1), str(tmp_path), "mixed", world_size=2, device=CPU)


def test_missing_sidecars_fail_where_the_checkpoint_says_it_has_them(tmp_path):
    """No side-car in the tag: a checkpoint DeepSpeed's files mark as saved with DGC (``expect_sidecars``) raises
    naming the missing file; one saved without DGC restarts the residuals at zero, as before."""
    (tmp_path / "tag").mkdir()
    with pytest.raises(DGCCheckpointError, match=r"saved with deepspeed_dgc state, but its side-car .* is missing"):
        load_state(_state(), str(tmp_path), "tag", world_size=2, device=CPU, expect_sidecars=True)
    msg = load_state(_state(), str(tmp_path), "tag", world_size=2, device=CPU)
    assert "saved without DGC" in msg


def test_a_full_disk_raises_naming_the_file_and_keeps_the_old_sidecar(tmp_path, monkeypatch):
    """Writing fails with ENOSPC (at the fsync, after bytes went to a temporary file): DGCCheckpointError says no
    space is left and names the side-car; the temporary file is gone and the side-car written before is untouched."""
    state, path = _saved(tmp_path)
    before = open(path, "rb").read()
    state.memory.load({"a": torch.randn(10), "b": torch.randn(5)})

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DGCCheckpointError, match=r"could not write .*dgc_state_dp_rank_00000\.pt: no space left"):
        save_state(state, str(tmp_path), "tag", world_size=2)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "tag")) == ["dgc_state_dp_rank_00000.pt"]
    assert open(path, "rb").read() == before
