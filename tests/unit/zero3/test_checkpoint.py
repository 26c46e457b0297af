"""The checkpoint side-car on its own: same world size, re-sharded to another, dropped where it cannot fit, refused
where it does not fit this model, damaged, another checkpoint's or missing, written atomically (a full disk), and
side-cars of an earlier version."""

import errno
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepspeed_dgc.config import DGCConfig
from deepspeed_dgc.zero3.checkpoint import (NOT_ROUTINE, DGCCheckpointError, _settings_note, gather_shards, load_state,
                                           read_sidecar, save_state, shard_numel, split_shard)
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


def _layout(world, rpn):
    """``ranks_per_node`` for :func:`gather_shards`: None (flat) or the node size."""
    return None if rpn == 0 else rpn


def _gather_oracle(shards, n, world, rpn):
    """float64 element-by-element: each saved rank's entries added at the parameter positions they stand for."""
    total = [0.0] * n
    for g, shard in enumerate(shards):
        values = shard.double().tolist()
        if rpn is None:
            for i in range(n):
                total[i] += values[i]
            continue
        c, nodes, local = -(-n // world), world // rpn, g % rpn
        for j in range(nodes):  # row j: owner j L + l's slice of the parameter
            owner = j * rpn + local
            for i in range(c):
                if owner * c + i < n:
                    total[owner * c + i] += values[j * c + i]
    return torch.tensor(total, dtype=torch.float64)


def _split_oracle(total, world, rpn, rank):
    n = total.numel()
    if rpn is None:
        return torch.tensor([x / world for x in total.tolist()], dtype=torch.float64)
    c, nodes, local = -(-n // world), world // rpn, rank % rpn
    out = []
    for j in range(nodes):
        owner = j * rpn + local
        out += [total[owner * c + i].item() / nodes if owner * c + i < n else 0.0 for i in range(c)]
    return torch.tensor(out, dtype=torch.float64)


LAYOUTS = [(1, None), (2, None), (3, None), (4, None), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (6, 2), (6, 3), (8, 2)]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 90), st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS), st.integers(0, 2**31 - 1),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_resharding_arithmetic_matches_a_float64_oracle(n, saved, new, seed, dtype):
    """Fresh random shards of a parameter of n elements in a saved layout (world, ranks per node; None: flat), in
    any storage dtype: :func:`gather_shards` equals an element-by-element float64 oracle exactly; each rank's
    :func:`split_shard` of it in a new layout equals the oracle's even split, every node a share 1 / N, every flat
    rank 1 / W (to float64 rounding); and gathering the new shards gives the whole back: the state is conserved."""
    gen = torch.Generator().manual_seed(seed)
    world, rpn = saved
    size = shard_numel(n, world, rpn)
    shards = [(torch.randn(size, generator=gen, dtype=torch.float64) * 10.0**torch.randint(-3, 4, (1, ), generator=gen))
              .to(dtype) for _ in range(world)]
    total = gather_shards(shards, n, world, rpn)
    assert total.dtype == torch.float64 and total.shape == (n, )
    assert torch.equal(total, _gather_oracle(shards, n, world, rpn))
    new_world, new_rpn = new
    mine = [split_shard(total, new_world, new_rpn, r) for r in range(new_world)]
    for r in range(new_world):
        assert mine[r].dtype == torch.float64 and mine[r].numel() == shard_numel(n, new_world, new_rpn)
        assert torch.allclose(mine[r], _split_oracle(total, new_world, new_rpn, r), rtol=1e-15, atol=0)
    back = gather_shards(mine, n, new_world, new_rpn)
    assert torch.allclose(back, total, rtol=1e-14, atol=1e-300)


def test_resharding_arithmetic_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="rank 1's shard has 5 elements, its layout needs 6"):
        gather_shards([torch.zeros(6), torch.zeros(5)], 6, 2, None)
    with pytest.raises(ValueError, match="3 shards for a world of 2"):
        gather_shards([torch.zeros(6)] * 3, 6, 2, None)
    with pytest.raises(ValueError, match="not a whole number of nodes"):
        split_shard(torch.zeros(6, dtype=torch.float64), 3, 2, 0)
    with pytest.raises(ValueError, match="outside a world of 2"):
        split_shard(torch.zeros(6, dtype=torch.float64), 2, None, 2)


def _hier(world, rpn, rank, momentum=False, module=None):
    """A state of the hierarchical topology (``rpn`` ranks per node) at ``world`` ranks, or flat (``rpn`` None)."""
    cfg = (DGCConfig(enabled=True, residual_dtype="fp32") if rpn is None else
           DGCConfig(enabled=True, residual_dtype="fp32", topology="hierarchical", ranks_per_node=rpn))
    mom = None
    if momentum:
        from deepspeed_dgc.config import DecoupledMomentumConfig
        from deepspeed_dgc.memory.momentum import DecoupledMomentum
        mom = DecoupledMomentum(DecoupledMomentumConfig(storage="fp32"))
    state = DGCState.build(cfg, global_rank=rank, ranks_per_node=rpn, momentum=mom, module=module or TwoParams(),
                           dp_rank=rank, dp_world_size=world)
    return state


@pytest.mark.parametrize("saved, new", [((4, 2), (2, 1)), ((2, 1), (4, 2)), ((4, 2), (3, None)), ((2, None), (4, 2)),
                                        ((4, 2), (4, 1)), ((4, 2), (4, None))])
def test_sidecars_at_another_world_size_or_layout_are_resharded_and_conserved(tmp_path, saved, new):
    """Random residuals and local momenta saved by every rank of one layout (world, ranks per node; None: flat),
    loaded by every rank of another (another world size, another node size at the same world size, flat <->
    hierarchical): each kind's whole state, put together from the new ranks as from the saved ones, is the same
    (fp32 storage: to fp32 rounding of each share), the step counters are rank 0's, the thresholds are gone, and
    the message says what was done."""
    (world, rpn), (new_world, new_rpn) = saved, new
    residuals, momenta = [], []
    for rank in range(world):
        state = _hier(world, rpn, rank, momentum=True)
        res = {k: torch.randn(shard_numel(n, world, rpn)) for k, n in (("a", 10), ("b", 5))}
        mom = {k: torch.randn(shard_numel(n, world, rpn)) for k, n in (("a", 10), ("b", 5))}
        state.memory.load(res)
        state.momentum.store.load(mom)
        state.momentum.steps_done = 7
        state.reducer.steps_applied = 7
        state.reducer.thresholds = {"a": [0.5, 0.1, 1, False]}
        save_state(state, str(tmp_path), "tag", world_size=world)
        residuals.append(res)
        momenta.append(mom)
    loaded = []
    for rank in range(new_world):
        fresh = _hier(new_world, new_rpn, rank, momentum=True)
        fresh.reducer.thresholds = {"b": [0.5, 0.1, 1, False]}
        msg = load_state(fresh, str(tmp_path), "tag", world_size=new_world, device=CPU)
        assert f"saved at data-parallel world size {world}, this run has {new_world}: re-sharded 2 residuals" in msg
        assert fresh.reducer.steps_applied == 7 and fresh.momentum.steps_done == 7 and fresh.reducer.thresholds == {}
        loaded.append((fresh.memory.residuals(), fresh.momentum.momenta()))
    for k, n in (("a", 10), ("b", 5)):
        for i, saved_kind in enumerate((residuals, momenta)):
            before = gather_shards([s[k] for s in saved_kind], n, world, rpn)
            after = gather_shards([lr[i][k] for lr in loaded], n, new_world, new_rpn)
            assert torch.allclose(after, before, rtol=1e-6, atol=1e-6), (k, i)


def test_resharding_refuses_sidecars_that_do_not_belong_together(tmp_path):
    """Nothing is half-loaded: a saved rank's side-car missing, or one whose residuals have another size than its
    saved layout gives, raises DGCCheckpointError naming that file, and the loading state keeps what it had."""
    for rank in range(4):
        state = _hier(4, 2, rank)
        state.memory.load({"a": torch.randn(6), "b": torch.randn(4)})
        save_state(state, str(tmp_path), "tag", world_size=4)
    fresh = _hier(2, 1, 0)
    mine = {"a": torch.ones(10), "b": torch.ones(6)}
    fresh.memory.load(mine)
    bad = _hier(4, 2, 3, module=TwoParams(n_a=14))
    bad.memory.load({"a": torch.randn(8), "b": torch.randn(4)})
    save_state(bad, str(tmp_path), "tag", world_size=4)
    with pytest.raises(DGCCheckpointError, match=r"dgc_state_dp_rank_00003\.pt: the residual of parameter 'a' has 8 "
                                                 r"elements, its saved layout needs 6"):
        load_state(fresh, str(tmp_path), "tag", world_size=2, device=CPU)
    os.unlink(tmp_path / "tag" / "dgc_state_dp_rank_00002.pt")
    with pytest.raises(DGCCheckpointError, match=r"dgc_state_dp_rank_00002\.pt is missing"):
        load_state(fresh, str(tmp_path), "tag", world_size=2, device=CPU)
    assert all(torch.equal(fresh.memory.get(k), v) for k, v in mine.items())


def test_sidecar_at_another_world_size_flat_reshards(tmp_path):
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
    hier = _state(DGCConfig(enabled=True, residual_dtype="fp32", topology="hierarchical", ranks_per_node=1), world=3)
    hier.reducer.ranks_per_node = 1
    msg = load_state(hier, str(tmp_path), "tag", world_size=3, device=CPU)
    assert "re-sharded 2 residuals (flat -> hierarchical, 1 ranks per node" in msg
    assert torch.allclose(hier.memory.get("a").view(3, 4).reshape(-1)[:10] * 3, saved[0]["a"] + saved[1]["a"],
                          atol=1e-6)
    os.unlink(tmp_path / "tag" / "dgc_state_dp_rank_00001.pt")  # a side-car missing: nothing half-loaded
    before = fresh.memory.residuals()
    with pytest.raises(DGCCheckpointError, match=r"dgc_state_dp_rank_00001\.pt is missing"):
        load_state(fresh, str(tmp_path), "tag", world_size=3, device=CPU)
    assert all(torch.equal(fresh.memory.get(k), v) for k, v in before.items())


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


def test_a_methods_settings_are_compared_one_by_one_and_ones_not_recorded_then_are_not_reported():
    """A side-car's ``decoupled_momentum`` section against this run's: a changed setting is named with both values
    (``decoupled_momentum.chunk 64 -> 32``), one the saved version did not record yet (``lr_scale``, added later) is
    not reported; a method switched on names the whole section."""
    now = SimpleNamespace(cfg=DGCConfig(enabled=True, decoupled_momentum={"chunk": 32, "lr_scale": 1.25}))
    saved = DGCConfig(enabled=True, decoupled_momentum={"chunk": 64}).model_dump(mode="json")
    del saved["decoupled_momentum"]["lr_scale"]  # as a version before the setting wrote it
    assert _settings_note(now, saved).startswith("; the saved run's 'dgc' settings differ from this run's "
                                                 "(decoupled_momentum.chunk 64 -> 32): "), _settings_note(now, saved)
    saved["decoupled_momentum"]["chunk"] = 32
    assert _settings_note(now, saved) == ""
    note = _settings_note(now, DGCConfig(enabled=True).model_dump(mode="json"))
    assert "(decoupled_momentum None -> {'chunk': 32, " in note and "'lr_scale': 1.25" in note, note


def test_widening_the_residual_storage_is_exact_and_neutral_settings_are_not_reported(tmp_path):
    """fp8 residuals resumed with fp32 storage: the message says they were converted exactly (not rounded), and they
    equal the fp8 values decoded. A resume that changes only ``timeout_s`` or ``stats_interval`` reports no changed
    setting, nor one of the policy, the kernels or the weights' all-gather (they change nothing the state means); one
    that changes ``density`` does."""
    state = _state(DGCConfig(enabled=True, residual_dtype="fp8"))
    state.memory.load({"a": torch.randn(10) * 3, "b": torch.randn(5)})
    saved = {k: state.memory.get(k).clone() for k in ("a", "b")}
    save_state(state, str(tmp_path), "tag", world_size=2)
    wide = _state(DGCConfig(enabled=True, residual_dtype="fp32", timeout_s=8.0, stats_interval=7, policy="auto",
                            policy_interval=3, kernels="reference", weights={"quantization": "int8"}))
    msg = load_state(wide, str(tmp_path), "tag", world_size=2, device=CPU)
    assert "stored in fp8 and are now stored in fp32 ('dgc.residual_dtype'), converted exactly" in msg, msg
    assert "rounded once" not in msg and "settings differ from this run's (residual_dtype 'fp8' -> 'fp32')" in msg, msg
    assert "timeout_s" not in msg and "stats_interval" not in msg and "policy" not in msg, msg
    assert "kernels" not in msg and "weights" not in msg, msg
    for k, v in saved.items():
        assert torch.equal(wide.memory.get(k), v)
    msg = load_state(_state(DGCConfig(enabled=True, residual_dtype="fp8", density=0.5)), str(tmp_path), "tag",
                     world_size=2, device=CPU)
    assert "density 1.0 -> 0.5" in msg, msg


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


def test_a_sidecar_of_another_save_of_the_same_tag_is_refused_naming_its_method(tmp_path):
    """Two runs save the same tag: run B's (decoupled momentum) rank-1 side-car copied into run A's checkpoint. Its
    tag, rank and world size match; the save id DeepSpeed's files of A record does not: DGCCheckpointError names the
    file, both ids and B's method. A's own side-cars load; without an id (a checkpoint saved before ids) nothing is
    compared."""
    a_id, b_id = int(torch.randint(1, 2**62, ())), int(torch.randint(1, 2**62, ()))
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    for rank in range(2):
        state = _state(rank=rank)
        state.memory.load({"a": torch.randn(10), "b": torch.randn(5)})
        save_state(state, str(run_a), "step5", world_size=2, save_id=a_id)
        demo = _state(DGCConfig(enabled=True, decoupled_momentum={"chunk": 4, "topk": 1}), rank=rank)
        save_state(demo, str(run_b), "step5", world_size=2, save_id=b_id)
    assert load_state(_state(rank=1), str(run_a), "step5", world_size=2, device=CPU, save_id=a_id).startswith("restored")
    shutil.copy(run_b / "step5" / "dgc_state_dp_rank_00001.pt", run_a / "step5" / "dgc_state_dp_rank_00001.pt")
    fresh = _state(rank=1)
    with pytest.raises(DGCCheckpointError, match=rf"dgc_state_dp_rank_00001\.pt was written by another save than the "
                       rf"DeepSpeed files of its checkpoint \(save id {b_id:#x}, theirs {a_id:#x}\).*saved with "
                       "decoupled_momentum"):
        load_state(fresh, str(run_a), "step5", world_size=2, device=CPU, save_id=a_id)
    assert len(fresh.memory) == 0
    assert load_state(_state(rank=0), str(run_a), "step5", world_size=2, device=CPU, save_id=a_id).startswith("restored")
    read_sidecar(str(run_a / "step5" / "dgc_state_dp_rank_00001.pt"), "step5")  # no id to compare with: read


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
