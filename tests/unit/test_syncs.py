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
    indexing with a 0-d tensor and ``bincount`` (its range read back on CUDA) included; views are no launches."""
    import deepspeed_dgc
    code = compile("def f(t, m, i):\n    t.item(); int(t[0]); bool(t[0]); t[m]; t.nonzero(); t[i]\n"
                   "    torch.repeat_interleave(t.long(), t.long()); torch.bincount(t.long())\n    t.view(-1); (t + 1)\n",
                   deepspeed_dgc.__file__, "exec")
    scope = {"torch": torch}
    exec(code, scope)
    t = torch.ones(1)
    with HostSyncCounter() as ops:
        scope["f"](t, t > 0, torch.tensor(0))
        launches = ops.launches
        counts = ops.take()
    assert counts == {"_local_scalar_dense": 4, "index": 1, "nonzero": 1, "repeat_interleave": 1, "bincount": 1}, counts
    assert launches >= 8


def test_tracks_the_bytes_the_package_makes_until_they_are_freed():
    """With ``track_bytes``: a tensor made in package code counts from its creation (``empty`` included) until it is
    freed; in-place ops, views and the caller's own tensors do not; the peak is taken above the last mark."""
    import deepspeed_dgc
    code = compile("def make(n):\n    return torch.empty(n, dtype=torch.float32)\n"
                   "def touch(t):\n    t.add_(1); t.view(-1); return t[:2]\n", deepspeed_dgc.__file__, "exec")
    scope = {"torch": torch}
    exec(code, scope)
    n = int(torch.randint(100, 1000, ()).item())
    with HostSyncCounter(track_bytes=True) as ops:
        kept = scope["make"](n)
        assert ops.live_bytes == 4 * n and ops.peak_bytes == 4 * n
        assert ops.mark() == 4 * n
        tmp = scope["make"](2 * n)
        scope["touch"](tmp)
        own = torch.empty(5 * n)  # this test's own: not counted, nor when the package writes into it or views it
        scope["touch"](own)
        assert ops.live_bytes == 12 * n and ops.peak_bytes == 8 * n
        del tmp
        assert ops.live_bytes == 4 * n and ops.peak_bytes == 8 * n
        with ops.paused():
            extra = scope["make"](n)
        assert ops.live_bytes == 4 * n
    del kept, extra
    assert ops.live_bytes == 0
