"""deepspeed_dgc.zero3.saving without processes: the in-progress mark, what the refusal says, and the guard on
DeepSpeed's checkpoint writes (the multi-process behaviour: tests/faults/test_full_disk.py and
tests/distributed/test_checkpoint.py)."""

import errno
import os
import time

import pytest

from deepspeed_dgc.zero3.checkpoint import DGCCheckpointError
from deepspeed_dgc.zero3.saving import GuardedWrites, begin_save, complete_tags, end_save, incomplete


def _tag(root, name, mark=False, age=0.0):
    """A tag directory with DeepSpeed's model states written ``age`` seconds ago, and the mark if ``mark``."""
    here = root / name
    here.mkdir()
    states = here / "mp_rank_00_model_states.pt"
    states.write_bytes(b"x")
    os.utime(states, (time.time() - age, time.time() - age))
    if mark:
        begin_save(str(root), name)


def test_a_marked_tag_is_incomplete_until_its_save_ends(tmp_path):
    """begin_save marks the tag, end_save removes the mark (twice is harmless); the refusal names the directory, what
    it holds and the tag 'latest' names."""
    _tag(tmp_path, "global_step5")
    (tmp_path / "latest").write_text("global_step5")
    assert incomplete(str(tmp_path), "global_step5") is None
    begin_save(str(tmp_path), "global_step8")
    (tmp_path / "global_step8" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"cut")
    why = incomplete(str(tmp_path), "global_step8")
    assert f"checkpoint {tmp_path}/global_step8 is incomplete" in why
    assert "present: zero_pp_rank_0_mp_rank_00_optim_states.pt" in why
    assert "'latest' names 'global_step5', the last checkpoint saved whole" in why
    end_save(str(tmp_path), "global_step8")
    end_save(str(tmp_path), "global_step8")
    assert incomplete(str(tmp_path), "global_step8") is None


def test_a_cut_save_into_the_tag_latest_names_points_to_the_whole_ones(tmp_path):
    """A save into the very tag 'latest' names, cut short: the refusal says so and lists the complete tags, newest
    first (another marked tag is not among them)."""
    _tag(tmp_path, "global_step5", age=300)
    _tag(tmp_path, "global_step8", age=100)
    _tag(tmp_path, "global_step9", mark=True, age=50)
    _tag(tmp_path, "global_step10", mark=True)
    (tmp_path / "latest").write_text("global_step10")
    assert complete_tags(str(tmp_path)) == ["global_step8", "global_step5"]
    why = incomplete(str(tmp_path), "global_step10")
    assert "'latest' names this tag: a save into it was cut short; complete here, newest first: global_step8, " \
           "global_step5; load one by its tag" in why, why


class _Engine:
    """A checkpoint engine whose writes fail with ``err`` from the ``fail_at``-th on."""

    def __init__(self, err, fail_at=1):
        self.err, self.fail_at, self.written = err, fail_at, []

    def save(self, state_dict, path):
        if len(self.written) + 1 >= self.fail_at:
            raise self.err
        self.written.append(path)


@pytest.mark.parametrize("err, cause", [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on the device"),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 128 vs 0"), None),
    (PermissionError(errno.EACCES, "Permission denied"), None),
])
def test_a_failed_write_is_held_and_no_more_is_written(tmp_path, err, cause):
    """Inside the guard a failed write is recorded (naming the file and the cause) instead of raised, and the writes
    after it are skipped; outside it the engine's own save is back. torch's 'unexpected pos' on a file system with
    more than 1 MiB free is not put down to a full disk."""
    engine = _Engine(err, fail_at=2)
    with GuardedWrites(engine) as guard:
        engine.save({}, str(tmp_path / "a.pt"))
        engine.save({}, str(tmp_path / "b.pt"))
        engine.save({}, str(tmp_path / "c.pt"))
    assert engine.written == [str(tmp_path / "a.pt")]
    assert len(guard.errors) == 1 and isinstance(guard.errors[0], DGCCheckpointError)
    text = str(guard.errors[0])
    assert f"writing {tmp_path}/b.pt failed: " in text and type(err).__name__ in text
    if cause:
        assert cause in text
    else:
        assert "no space left" not in text and "see the cause" in text
    with pytest.raises(type(err)):
        engine.save({}, str(tmp_path / "d.pt"))


class _DeepSpeedEngine:
    """A DeepSpeed engine's recovery-script copy (``_copy_recovery_script``, rank 0's plain file copy into the save
    directory) that really copies two scripts with ``shutil.copyfile``, failing with ``err`` when it is set."""

    def __init__(self, src, err=None):
        self.src, self.err, self.copied = src, err, []

    def _copy_recovery_script(self, save_path):
        import shutil
        if self.err is not None:
            raise self.err
        for name in ("zero_to_fp32.py", "zero_to_torch.py"):
            self.copied.append(shutil.copyfile(self.src, os.path.join(save_path, name)))


@pytest.mark.parametrize("first_write_fails", [False, True])
def test_the_recovery_script_copy_is_guarded_too(tmp_path, first_write_fails):
    """DeepSpeed copies its recovery scripts on rank 0 only, outside its checkpoint engine: a failed copy (ENOSPC) is
    held like a failed write, naming the scripts and the directory, and after a failed write the copy is not
    attempted (it would truncate the scripts an earlier save left); outside the guard the engines are as before (an
    instance attribute the engine had of its own is put back)."""
    src = tmp_path / "script.py"
    src.write_text("print('recover')\n")
    writes = _Engine(OSError(errno.ENOSPC, "No space left on device"), fail_at=1 if first_write_fails else 99)
    engine = _DeepSpeedEngine(str(src), err=OSError(errno.ENOSPC, "No space left on device"))
    own = engine.__dict__.setdefault("_copy_recovery_script", engine._copy_recovery_script)
    with GuardedWrites(writes, engine) as guard:
        writes.save({}, str(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
        engine._copy_recovery_script(str(tmp_path))
    assert len(guard.errors) == 1, guard.errors
    text = str(guard.errors[0])
    if first_write_fails:
        assert f"writing {tmp_path}/zero_pp_rank_0_mp_rank_00_optim_states.pt failed" in text, text
    else:
        assert f"copying DeepSpeed's recovery scripts (zero_to_fp32.py, zero_to_torch.py) into {tmp_path} failed: " \
               "no space left on the device" in text, text
    assert engine.__dict__["_copy_recovery_script"] is own
    other = _DeepSpeedEngine(str(src))
    with GuardedWrites(_Engine(None, fail_at=99), other) as guard:
        other._copy_recovery_script(str(tmp_path))
    assert not guard.errors and other.copied == [str(tmp_path / "zero_to_fp32.py"), str(tmp_path / "zero_to_torch.py")]
    assert (tmp_path / "zero_to_fp32.py").read_text() == src.read_text()
    assert "_copy_recovery_script" not in other.__dict__
