"""deepspeed_dgc.syncs counts, on aten ops, the launches and host synchronisations of the package's own code, and
only those: the reads that method wrappers miss (indexing with a 0-d tensor) included."""

import torch

from deepspeed_dgc.memory.error_feedback import ErrorFeedback
from deepspeed_dgc.syncs import HostSyncCounter


def test_counts_ops_from_the_package_only():
    memory = ErrorFeedback("fp32")
    for k in range(3):
        memory.stage(k, torch.randn(10))
    memory.commit()
    t = torch.randn(4)
    with HostSyncCounter() as ops:
        memory.residual_norm()  # one read-back of the summed squares (deepspeed_dgc code)
        float(t.sum())  # this test's own: not counted
        t[t > 0]
        assert sum(ops.take().values()) == 1
        torch.Tensor.tolist(t)  # called from here: not counted
        assert not ops.take() and ops.launches == 0
    assert torch.Tensor.item is not None and bool(torch.tensor(True))


def test_counts_each_kind_and_every_launch():
    """Each kind is counted when the call site is in the package (a function compiled as if it were package code),
    indexing with a 0-d tensor included; views are no launches."""
    import deepspeed_dgc
    code = compile("def f(t, m, i):\n    t.item(); int(t[0]); bool(t[0]); t[m]; t.nonzero(); t[i]\n"
                   "    torch.repeat_interleave(t.long(), t.long())\n    t.view(-1); (t + 1)\n",
                   deepspeed_dgc.__file__, "exec")
    scope = {"torch": torch}
    exec(code, scope)
    t = torch.ones(1)
    with HostSyncCounter() as ops:
        scope["f"](t, t > 0, torch.tensor(0))
        launches = ops.launches
        counts = ops.take()
    assert counts == {"_local_scalar_dense": 4, "index": 1, "nonzero": 1, "repeat_interleave": 1}, counts
    assert launches >= 8
