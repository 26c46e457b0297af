"""The main job under the ``deepspeed`` launcher, as a user runs it, with one rank killed (SIGKILL) or stopped
(SIGSTOP) from outside at whatever point of a step it is in (issue 52, item 1): the other rank ends with an error
within ``dgc.timeout_s`` plus ``STOP_MARGIN_S`` for a stop (``examples/train_char_gpt.py`` passes a ``timeout_s`` that
is set to ``deepspeed.init_distributed``, so DeepSpeed's own collectives wait no longer) and within ``KILL_S`` for a
kill; the launcher then exits with a non-zero status and no process is left behind. DeepSpeed's ``launch.py`` ends
the remaining ranks with SIGTERM and waits up to 30 s before SIGKILL (``terminate_process_tree``), and a stopped
process does not act on SIGTERM: after a stop the launcher itself exits up to ``LAUNCHER_GRACE_S`` later."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from dist_launch import ROOT, free_port, mpi_job_env, remove_shm_buffers

from ..distributed.test_main_job import TINY_MODEL

TIMEOUT_S = 8
STOP_MARGIN_S = 15.0  # after the timeout: the error path, the launcher killing the other ranks
KILL_S = 15.0  # a killed rank: the launcher notices its exit and ends the others
LAUNCHER_GRACE_S = 30.0 + 5.0  # DeepSpeed's launch.py: SIGTERM, 30 s, SIGKILL


def _steps(prefix: str, rank: int) -> list:
    try:
        with open(f"{prefix}.rank{rank}.jsonl") as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGKILL, id="kill"),
                                 pytest.param(signal.SIGSTOP, id="stop")])
def test_a_rank_killed_or_stopped_from_outside_ends_the_launch_with_an_error(sig):
    """Decoupled momentum (the recommended config), 2 ranks, ``dgc.timeout_s`` 8. Once rank 1 has logged 3 steps it
    gets ``sig`` from outside, mid-run. The launcher exits non-zero, within the bound of the module docstring, its
    output naming the error (a stop: the timeout; a kill: the lost peer), and no rank process is left."""
    out = tempfile.mkdtemp()
    port = free_port()
    log = os.path.join(out, "steps")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
           "examples/train_char_gpt.py", "--deepspeed_config", "configs/zero3_dgc_adam.json", *TINY_MODEL,
           "--max-steps", "2000", "--eval-interval", "100000", "--dgc-set", f"timeout_s={TIMEOUT_S}", "--step-log", log]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=mpi_job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    victim = None
    try:
        deadline = time.time() + 300
        while len(_steps(log, 1)) < 3:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.time() < deadline, "the job did not reach step 3"
            time.sleep(0.2)
        victim = _steps(log, 1)[-1]["pid"]
        other = _steps(log, 0)[-1]["pid"]
        os.kill(victim, sig)
        hit = time.time()
        bound = TIMEOUT_S + STOP_MARGIN_S if sig == signal.SIGSTOP else KILL_S
        while _alive(other) and time.time() < hit + bound + 60:
            time.sleep(0.1)
        other_took = time.time() - hit
        launcher_bound = bound + (LAUNCHER_GRACE_S if sig == signal.SIGSTOP else 0.0)
        try:
            output, _ = proc.communicate(timeout=max(1.0, hit + launcher_bound + 60 - time.time()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher still ran {launcher_bound + 60:.0f} s after rank 1 got {sig.name}")
        took = time.time() - hit
        assert proc.returncode != 0, output[-3000:]
        assert other_took <= bound, f"rank 0 ended {other_took:.1f} s after rank 1 got {sig.name} (bound {bound} s): " \
            + output[-3000:]
        assert took <= launcher_bound, f"the launcher ended {took:.1f} s after rank 1 got {sig.name}: " + output[-3000:]
        if sig == signal.SIGSTOP:
            assert other_took >= TIMEOUT_S - 1, other_took  # waited for the timeout, not less
            assert "dgc.timeout_s = 8" in output or "Timed out waiting 8000ms" in output, output[-3000:]
        else:
            assert "DGCCommError" in output or "Connection closed by peer" in output or \
                "Connection reset by peer" in output or "exits with return code = -9" in output, output[-3000:]
        if os.environ.get("DGC_FAULT_TABLE"):  # a row of results/faults.md
            with open(os.environ["DGC_FAULT_TABLE"], "a") as f:
                f.write(json.dumps({"method": "decoupled_momentum (launcher, main job)", "kind": sig.name,
                                    "phase": "from outside, mid-run", "rank0_exit_after_s": round(other_took, 2),
                                    "launcher_exit_after_s": round(took, 2), "launcher_status": proc.returncode})
                        + "\n")
        time.sleep(1.0)
        left = [pid for pid in (other, victim) if _alive(pid)]
        assert not left, f"rank processes left behind: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        remove_shm_buffers(port)
