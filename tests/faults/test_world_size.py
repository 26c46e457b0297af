"""Resume at another world size through DeepSpeed's universal checkpoint, for every method's state, flat and
hierarchical, in real processes: saved at 2 ranks and resumed at 4, saved at 4 and resumed at 2.

The hierarchical topology runs as 2 nodes at both sizes (``ranks_per_node`` = world / 2): 2 nodes of 1 rank at 2
ranks, 2 nodes of 2 at 4 (at 2 ranks as 1 node of 2, most methods send the node's sum whole and keep no residual,
so there would be nothing to re-shard).

What each case checks:

(a) conservation: the whole run's residuals and local momenta, put together from the saved side-cars (float64: the
    flat ranks' sum, or the hierarchical node-level slices assembled per node and summed over nodes), equal those the
    new ranks loaded, put together the same way, within the rounding of their storage (fp32: 1e-6 relative; bf16:
    2^-8; fp8: 2^-4 of each value plus a flush to zero below its group's absmax);
(b) the loss: the mean loss of the resumed steps 5..9 over the new ranks is within 1% of the reference's.

Every run sees the same global batches at both sizes (``scenarios.world_size``: each of 2 ranks takes the inputs of
2 of the 4 ranks, with a micro-batch of 8), so the mean gradient of every step, and the mean loss over the ranks,
do not depend on the world size. The reference is then the uninterrupted run at the old size that wrote the
checkpoint, over the same steps 5..9: it starts from the same state at the same step and, in exact arithmetic (no
compression), is the uninterrupted run at the new size as well; what is left of the gap is what the resume changed
plus the compression's own dependence on the world size in those 5 steps. Also printed (``-s``), not asserted: an
uninterrupted run at the new size from step 0; its gap also holds 5 more steps of that dependence (compressed
momentum at 2 vs 4 ranks differs by about 9% by then), which says nothing about the resume. Not the reference: the
same universal checkpoint resumed with the DGC state zeroed (it shows what is lost, not what should be), nor
resumed by stock ZeRO-3 with DGC off (another optimizer for decoupled momentum's sign step and momentum
correction, whose momentum lives in the side-car). Measured gaps: docs/faults.md. The 1% bound is weak on this
small model (the state's effect on the loss of 5 steps is small): negating the re-sharded state fails it for
momentum correction only; the conservation checks are what pin the rule down.
"""

import subprocess
import sys
import tempfile
import time

import pytest
import torch

from dist_launch import run_scenarios
from deepspeed_dgc.memory.error_feedback import ErrorFeedback
from deepspeed_dgc.zero3.checkpoint import gather_shards, read_sidecar, saved_ranks_per_node

from scenarios.world_size import ResumeSameData, SaveMidwaySameData, TrainSameData

from distributed.test_checkpoint import DEMO, MASK, MC, MOMENTUM
from distributed.test_engine import SPARSE

STEPS, SAVE_AT = 10, 5
PARAMS = {"l1.weight": 24 * 101, "l1.bias": 101, "ln.weight": 101, "ln.bias": 101, "l2.weight": 101 * 37, "l2.bias": 37}

METHODS = {  # method -> ds_config (flat); the hierarchical variant adds the topology (config_for)
    "sparse": {"dgc": SPARSE},  # top-k with error feedback
    "int4": {"dgc": {"enabled": True}},  # the default: dense INT4, fp8 residuals
    "compressed_momentum": MOMENTUM,  # frozen after step 3: the saved state is past the freeze
    "momentum_correction": MC,
    "decoupled_momentum": DEMO,
    "shared_mask": MASK,
}
DIRECTIONS = {"2to4": (2, 4), "4to2": (4, 2)}
CI_CASE = ("decoupled_momentum", "hierarchical", "4to2")


def config_for(method: str, topology: str, world: int) -> dict:
    """The ds_config of ``method`` at ``world`` ranks: flat, or hierarchical as 2 nodes of world / 2; each rank's
    micro-batch holds the inputs of 4 / world ranks (the global batch of 4 ranks at either size)."""
    config = dict(METHODS[method], train_micro_batch_size_per_gpu=4 * 4 // world)
    if topology == "flat":
        return config
    dgc = dict(config["dgc"], topology="hierarchical", ranks_per_node=world // 2)
    if method == "momentum_correction":  # as tests/distributed/test_checkpoint.py's MC_HIER
        dgc.pop("local_clip_norm", None)
    if method == "compressed_momentum":  # as MOMENTUM_HIER
        dgc["residual_dtype"] = "fp8"
    return dict(config, dgc=dgc)


ALL_CASES = [(m, t, d) for d in DIRECTIONS for t in ("flat", "hierarchical") for m in METHODS]
_RUNS = {}


def _run_cases(cases):
    """Run ``cases`` (method, topology, direction) not run yet, batched: per old world size one launch saves every
    case (10 steps, saving after step 5), each checkpoint is converted by ``ds_to_universal``, and per new world
    size one launch resumes every case from its universal checkpoint and runs every case's reference (10
    uninterrupted steps at the new size). Stores case -> dict(saved=..., resumed=..., reference=..., sides=...,
    seconds=...)."""
    todo = [c for c in cases if c not in _RUNS]
    if not todo:
        return
    began = time.time()
    out = tempfile.mkdtemp()
    name = {c: "-".join(c) for c in todo}
    saved, by_new = {}, {}
    for old in (2, 4):
        mine = [c for c in todo if DIRECTIONS[c[2]][0] == old]
        if mine:
            saved.update(run_scenarios({name[c]: SaveMidwaySameData(steps=STEPS, ckpt=f"{out}/{name[c]}", save_at=SAVE_AT,
                                                            config=config_for(c[0], c[1], old)) for c in mine},
                                       world=old, timeout_s=600))
    for c in todo:
        tag = open(f"{out}/{name[c]}/latest").read().strip()
        # deepspeed_dgc's converter: DeepSpeed's ds_to_universal, with zero Adam moments (step 0) staged for the
        # checkpoints whose optimizer keeps none (momentum correction's SGD, decoupled momentum's sign update), on
        # which DeepSpeed's raises KeyError; the load then says that they start from zero
        conv = subprocess.run([sys.executable, "-m", "deepspeed_dgc", "universal", "--input_folder",
                               f"{out}/{name[c]}/{tag}", "--output_folder", f"{out}/{name[c]}/{tag}_universal"],
                              capture_output=True, text=True, timeout=300)
        assert conv.returncode == 0, conv.stderr[-3000:]
        if c[0] in ("momentum_correction", "decoupled_momentum"):
            assert "the universal checkpoint holds zeros for them" in conv.stdout, conv.stdout[-2000:]
        old = DIRECTIONS[c[2]][0]
        sides = [read_sidecar(f"{out}/{name[c]}/{tag}/dgc_state_dp_rank_{r:05d}.pt", tag) for r in range(old)]
        by_new.setdefault(DIRECTIONS[c[2]][1], []).append(c)
        _RUNS[c] = dict(saved=saved[name[c]], sides=sides)
    for new, mine in by_new.items():
        jobs = {}
        for c in mine:
            cfg = config_for(c[0], c[1], new)
            jobs[name[c] + "-resumed"] = ResumeSameData(steps=STEPS, ckpt=f"{out}/{name[c]}", resume_at=SAVE_AT,
                                                config=dict(cfg, checkpoint={"load_universal": True}))
            jobs[name[c] + "-reference"] = TrainSameData(steps=STEPS, config=cfg)
        records = run_scenarios(jobs, world=new, timeout_s=600)
        for c in mine:
            _RUNS[c].update(resumed=records[name[c] + "-resumed"], reference=records[name[c] + "-reference"])
    seconds = time.time() - began
    for c in todo:
        _RUNS[c]["seconds"] = seconds / len(todo)


def whole(entries_per_rank, world, ranks_per_node):
    """Per key, the whole run's state (float64) from every rank's entries."""
    return {k: gather_shards([ErrorFeedback.decode(e[k]) for e in entries_per_rank], PARAMS[k], world, ranks_per_node)
            for k in entries_per_rank[0]}


def tolerance(storage: str, before: torch.Tensor) -> torch.Tensor:
    """What the new ranks' storage may round the whole ``before`` by, per element (each share rounded once)."""
    scale = float(before.abs().max()) if before.numel() else 0.0
    if storage == "fp8":  # e4m3 relative 2^-4; a share far below its group's absmax may flush to zero
        return 2**-4 * before.abs() + 1e-5 * scale
    if storage == "bf16":
        return 2**-8 * before.abs() + 1e-6 * scale
    return 1e-6 * before.abs() + 1e-7 * scale


def mean_loss(records, first=0):
    """The mean loss over every rank of steps ``first`` on (a resumed record holds those steps only)."""
    losses = [x for rec in records for x in rec.losses[first:]]
    return sum(losses) / len(losses)


def check_case(case):
    method, topology, direction = case
    old, new = DIRECTIONS[direction]
    run = _RUNS[case]
    sides, resumed, reference = run["sides"], run["resumed"], run["reference"]
    assert all(len(r.losses) == STEPS - SAVE_AT for r in resumed)
    saved_rpn = saved_ranks_per_node(sides[0])
    new_rpn = new // 2 if topology == "hierarchical" else None
    assert saved_rpn == (old // 2 if topology == "hierarchical" else None)
    # (a) conservation of the residuals
    before = whole([s["residuals"] for s in sides], old, saved_rpn)
    after = whole([r.loaded_residuals for r in resumed], new, new_rpn)
    assert set(before) == set(after)
    storage = resumed[0].residual_storage
    for k in before:
        gap = (after[k] - before[k]).abs()
        assert bool((gap <= tolerance(storage, before[k])).all()), (case, k, float(gap.max()))
    if method in ("sparse", "int4", "compressed_momentum", "momentum_correction", "shared_mask"):
        assert any(bool(v.abs().sum() > 0) for v in before.values()), case  # there was something to conserve
    # ... and of the local momenta (stored in fp32, or bf16 for decoupled momentum; loaded as fp32 tensors)
    if sides[0].get("momentum"):
        before = whole([s["momentum"]["momenta"] for s in sides], old, saved_rpn)
        after = whole([r.loaded_momenta for r in resumed], new, new_rpn)
        assert set(before) == set(after) and any(bool(v.abs().sum() > 0) for v in before.values()), case
        mstorage = METHODS[method]["dgc"].get("decoupled_momentum", {}).get("storage", "fp32")
        for k in before:
            gap = (after[k] - before[k]).abs()
            assert bool((gap <= tolerance(mstorage, before[k])).all()), (case, k, float(gap.max()))
    else:
        assert not any(r.loaded_momenta for r in resumed)
    # (b) the loss after the resume
    got, want = mean_loss(resumed), mean_loss(run["saved"], SAVE_AT)
    from_start = mean_loss(reference, SAVE_AT)
    gap = (got - want) / want
    print(f"\n{'-'.join(case)}: resumed at {new} ranks, mean loss of steps {SAVE_AT}..{STEPS - 1} {got:.6f}; "
          f"uninterrupted at {old} ranks {want:.6f} (gap {100 * gap:+.3f}%); at {new} ranks from step 0 "
          f"{from_start:.6f} (gap {100 * (got - from_start) / from_start:+.3f}%) ({run['seconds']:.0f} s)")
    assert abs(gap) < 0.01, (case, got, want)


SLOW_CASES = [c for c in ALL_CASES if c != CI_CASE]


@pytest.fixture(scope="module")
def slow_runs():
    _run_cases(SLOW_CASES + [CI_CASE])
    return _RUNS


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=["-".join(c) for c in SLOW_CASES])
def test_resume_at_another_world_size(slow_runs, case):
    """Every method, flat and hierarchical, 2 -> 4 and 4 -> 2 ranks (see the module docstring)."""
    check_case(case)


def test_decoupled_momentum_hierarchical_4_to_2():
    """The CI case: decoupled momentum (bf16 momenta, INT2 DCT coefficients) saved at 4 ranks as 2 nodes of 2 and
    resumed at 2 ranks as 2 nodes of 1: its momenta, node-level slices of 2 x ceil(n / 4) elements per rank, are
    assembled per node, summed and split over the new nodes (each new rank's share has 2 x ceil(n / 2) elements);
    their sum is conserved within bf16's rounding, and the loss of steps 5..9 is within 1% of a run at 2 ranks."""
    _run_cases([CI_CASE])
    check_case(CI_CASE)
