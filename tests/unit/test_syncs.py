"""deepspeed_dgc.syncs counts the host-synchronising tensor calls of the package's own code, and only those."""

import torch

from deepspeed_dgc.memory.error_feedback import ErrorFeedback
from deepspeed_dgc.syncs import HostSyncCounter


def test_counts_calls_from_the_package_only():
    memory = ErrorFeedback("fp32")
    for k in range(3):
        memory.stage(k, torch.randn(10))
    memory.commit()
    t = torch.randn(4)
    with HostSyncCounter() as syncs:
        memory.residual_norm()  # one read-back of the summed squares (deepspeed_dgc code)
        float(t.sum())  # this test's own: not counted
        t[t > 0]
        assert sum(syncs.take().values()) == 1
        torch.Tensor.tolist(t)  # called from here: not counted
        assert not syncs.take()
    assert torch.Tensor.item is not None and bool(torch.tensor(True))  # restored on exit


def test_counts_each_kind():
    """Each kind is counted when the call site is in the package (a function compiled as if it were package code)."""
    import deepspeed_dgc
    code = compile("def f(t, m):\n    t.item(); t.tolist(); int(t[0]); float(t[0]); bool(t[0]); t[m]; t.nonzero()\n"
                   "    torch.tensor([1], device=t.device); torch.repeat_interleave(t.long(), t.long())\n",
                   deepspeed_dgc.__file__, "exec")
    scope = {"torch": torch}
    exec(code, scope)
    t = torch.ones(1)
    with HostSyncCounter() as syncs:
        scope["f"](t, t > 0)
        counts = syncs.take()
    assert counts == {"item": 1, "tolist": 1, "__int__": 1, "__float__": 1, "__bool__": 1, "bool-mask index": 1,
                      "nonzero": 1, "torch.tensor(host data, device)": 1, "repeat_interleave": 1}, counts
