"""Policy scenarios: ``"dgc": {"policy": "auto"}`` with the ranks' measurements scripted."""

from dataclasses import dataclass

from . import scenario
from .training import Train, TrainRecord, build, new_record, run_steps

TIMES = {"c": ([3.0, 0.5], [1.0, 2.0]), "s": ([0.5, 3.0], [2.0, 1.0]), "C": ([10.0, 0.5], [1.0, 2.0])}


@dataclass
class ScriptedPolicy(Train):
    """:class:`~.training.Train` with policy ``"auto"`` whose k-th round of measurements agrees on ``script[k]``
    (cycled) for every bucket and gather, the ranks' own times disagreeing (the real exchanges still run).

    ``script`` letters: ``"c"`` compressed (rank 0: stock 3 s, compressed 0.5 s; rank 1: 1 s and 2 s; the maxima
    3 s and 2 s), ``"s"`` stock (the same, swapped), ``"C"`` compressed by far (rank 0: stock 10 s, compressed 0.5 s;
    rank 1: 1 s and 2 s), so that after the first run stock is more than twice as slow by the agreed times but not by
    rank 1's own.
    """
    script: str = "c"

    def __post_init__(self):
        super().__post_init__()
        if not self.script or set(self.script) - set(TIMES):
            raise ValueError(f"ScriptedPolicy: script {self.script!r} must be a non-empty string of {sorted(TIMES)}")


@scenario(ScriptedPolicy)
def scripted_policy(job: ScriptedPolicy, rank: int) -> TrainRecord:
    """Train with the policy's measurements replaced by the script's times after each real exchange."""
    built = build(job, rank)
    script_policy(built.engine._dgc_state, job.script, rank)
    return run_steps(job, rank, built, new_record(built.engine))


def script_policy(state, script: str, rank: int) -> None:
    """The measurements of ``state.policy`` (a LinkPolicy) at applied step t agree on ``script[(t // interval) %
    len]``: each timed run still runs, but its time is replaced by the scripted one before the ranks agree. Rank 1's
    times alone would choose the other way; rank 0's make the largest over the ranks choose as scripted."""
    policy = state.policy
    measured = policy._timed

    def scripted(option, fn, device):
        measured(option, fn, device)  # the real exchange runs
        want = script[(state.reducer.steps_applied // policy.interval) % len(script)]
        return TIMES[want][rank == 1][option]

    policy._timed = scripted
