"""A rank that dies or hangs mid-training makes the others fail within dgc.timeout_s, not hang."""

import tempfile

import pytest
import torch

from dist_launch import launch_scenarios, run_scenario
from scenarios import PeerFault, Train

from .test_engine import SPARSE

FAIL_TIMEOUT_S = 8.0
MARGIN_S = 15.0  # process start-up of the error path, traceback printing, teardown
DROP_S = 3.0  # a killed peer's sockets reset at once (0.01-0.02 s measured): far below timeout_s


@pytest.mark.parametrize("mode, expected", [("die", "DGCCommError"), ("hang", "DGCTimeoutError"),
                                            ("stop", "DGCTimeoutError")])
def test_peer_failure_ends_the_other_rank_with_an_error(mode, expected):
    """Rank 1 is killed, hangs, or is stopped by SIGSTOP (frozen with its connections open) inside its reduce-scatter
    at step 3, with dgc.timeout_s 8. Killed: rank 0 raises DGCCommError at its next exchange with it, within DROP_S of
    the kill (the connection drop, not the timeout). Hung or stopped: rank 0 raises DGCTimeoutError naming the
    collective after timeout_s, and within timeout_s + 10 s. Either way rank 0 exits with an error."""
    out = tempfile.mkdtemp()
    job = PeerFault(steps=6, kind=mode, out=out, config={"dgc": dict(SPARSE, timeout_s=FAIL_TIMEOUT_S)})
    ranks = launch_scenarios([job], timeout_s=FAIL_TIMEOUT_S + 120, out=out)
    failed_at = float(open(f"{out}/failed_at").read())
    rank0 = ranks[0]
    assert rank0.returncode != 0, "rank 0 finished training although its peer was gone"
    err = torch.load(f"{out}/rank0_error.pt", weights_only=False)
    assert err.error.startswith(expected), err.error
    if mode in ("hang", "stop"):  # our collective noticed, after timeout_s and not much later
        assert "dgc.timeout_s = 8" in err.error and "exchange" in err.error, err.error  # names it
        assert FAIL_TIMEOUT_S - 1 <= err.at - failed_at <= FAIL_TIMEOUT_S + 10
    assert rank0.ended_at - failed_at <= FAIL_TIMEOUT_S + MARGIN_S, "rank 0 took too long to exit"
    if mode == "die":
        assert ranks[1].returncode == -9
        assert err.at - failed_at <= DROP_S, f"rank 0 noticed the killed peer {err.at - failed_at:.1f} s late"


def test_timeout_defaults_to_the_process_groups():
    """``dgc.timeout_s`` unset: the extension's collectives take the partition group's own timeout, as ZeRO-3's own
    collectives on it do: DeepSpeed builds its data-parallel group with torch's default (30 minutes for gloo; the
    world's, ``DEEPSPEED_TIMEOUT`` minutes, is another group's), not the 600 s the extension used to wait; set, it
    is kept."""
    env = {"DEEPSPEED_TIMEOUT": "3"}
    ranks = run_scenario(Train(steps=1, config={"dgc": dict(SPARSE)}), timeout_s=180, extra_env=env)
    assert [r.timeout_s for r in ranks] == [1800.0, 1800.0]
    ranks = run_scenario(Train(steps=1, config={"dgc": dict(SPARSE, timeout_s=42.0)}), timeout_s=180, extra_env=env)
    assert [r.timeout_s for r in ranks] == [42.0, 42.0]
