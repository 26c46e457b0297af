"""The soak (issue 52 item 6, benchmarks/soak.py): the main job on 2 ranks, SIGKILLed mid-step after a checkpoint and
resumed, against the same steps uninterrupted. Resumed losses must equal the uninterrupted run's bit for bit, the
extension's state bytes must not change after warm-up, and each launch's resident memory must stop growing after it.

The short case runs in CI (about 65 s: 60 steps, a checkpoint every 10, one kill after the checkpoint of step 30);
the full one (3000 steps, a checkpoint every 100, a kill every 500, about 40 minutes) is marked slow (`make faults`).
"""

import pytest

from benchmarks import soak

# Resident memory of a launch may grow this much after its warm-up. The short case's launches are 30-60 steps long and
# its warm-up 10 steps: each launch's first checkpoint saves and evaluations still allocate after that (about +2-4%
# seen), so its bound is loose; the full case's is the 1% after a warm-up of 200 steps.
SHORT_RSS_GROWTH_PCT = 8.0
FULL_RSS_GROWTH_PCT = 1.0


def run(tmp_path, steps, checkpoint_every, resume_every, warmup, *extra):
    opts = soak.parse_args(["--steps", str(steps), "--checkpoint-every", str(checkpoint_every), "--resume-every",
                            str(resume_every), "--warmup", str(warmup), "--out-dir", str(tmp_path / "runs"),
                            "--json", str(tmp_path / "soak.json"), "--plot", str(tmp_path / "soak.png"),
                            "--launch-timeout-s", str(max(300, steps)), *extra])
    result = soak.run_soak(opts)
    soak.print_summary(result)
    assert (tmp_path / "soak.json").is_file() and (tmp_path / "soak.png").is_file()
    return result["summary"]


def check(found, steps, checkpoint_every, resume_every):
    """Assert what must hold whatever the allocator does; returns the launches (job, segment, rank, growth %) whose
    resident memory grew after warm-up, largest first."""
    kill_points = list(range(resume_every, steps - 1, resume_every))
    # one kill per multiple of resume_every, after its checkpoint and before the next one; the launcher saw it
    assert len(found["kills"]) == len(kill_points)
    for k, last_logged in zip(kill_points, found["kills"]):
        assert k + 1 <= last_logged < k + checkpoint_every
    assert all(rc != 0 for rc in found["launcher_rc_after_kill"])
    # resumed from the checkpoint: every step's loss as uninterrupted, bit for bit (so the validation losses too),
    # and the steps a killed launch ran past its checkpoint gave the same losses when they ran again
    assert found["max_abs_loss_diff"] == 0.0, found["first_step_with_loss_diff"]
    assert found["steps_with_loss_diff"] == 0
    assert found["val_losses_equal"]
    assert found["replayed_steps"] and found["replayed_steps_with_other_loss"] == []
    # the extension's state: one size on every rank, in every launch, after warm-up
    assert found["state_bytes_constant"] and found["state_bytes_after_warmup"][0] > 0
    growth = [(job, g["segment"], g["rank"], g["max_growth_pct"]) for job, rows in found["memory_growth"].items()
              for g in rows]
    assert all(pct is not None for *_, pct in growth), growth
    return sorted(growth, key=lambda row: -row[3])


def test_soak_short(tmp_path):
    found = run(tmp_path, steps=60, checkpoint_every=10, resume_every=30, warmup=10)
    growth = check(found, 60, 10, 30)
    assert growth[0][3] <= SHORT_RSS_GROWTH_PCT, growth


@pytest.mark.slow
def test_soak_full(tmp_path):
    """The full soak, with glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_=131072``, as
    docs/faults.md advises for long CPU runs). With glibc's default, dynamic threshold the extension's path grows each
    rank's resident memory for about 2000 steps before it levels off (+13-17% after step 200 in one launch; stock
    ZeRO-3's does not; results/soak.md): not a leak of the extension's state (its bytes are constant, asserted
    below), but not the issue's 1% either, so this test fixes the threshold and holds the 1% strictly."""
    found = run(tmp_path, 3000, 100, 500, 200, "--env", "MALLOC_MMAP_THRESHOLD_=131072")
    growth = check(found, 3000, 100, 500)
    assert growth[0][3] <= FULL_RSS_GROWTH_PCT, growth
    # and across launches: each one's memory at its warm-up step within 2% of the first launch's
    assert found["max_abs_pct_across_segments"] <= 2 * FULL_RSS_GROWTH_PCT
