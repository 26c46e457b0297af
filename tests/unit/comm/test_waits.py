"""How the extension waits for a collective: gloo on the host with a timeout, NCCL on the stream (the process group's
own timeout bounds it); both backends' timeout messages become DGCTimeoutError, other failures DGCCommError."""

import datetime

import pytest

from deepspeed_dgc.comm.communicators import DGCCommError, DGCTimeoutError, is_timeout, wait_torch_work

# the messages as the backends word them (torch 2.13: gloo's pair.cc, ProcessGroupNCCL's watchdog)
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 8000ms for recv operation"
NCCL_TIMEOUT = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLTOALL_BASE, "
                "NumelIn=4096, NumelOut=4096, Timeout(ms)=8000) ran for 8012 milliseconds before timing out.")
GLOO_RESET = "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:9951: Connection reset by peer"


class FakeWork:
    """A Work whose wait records how it was called and raises ``error``."""

    def __init__(self, error=None):
        self.error, self.calls = error, []

    def wait(self, timeout=None):
        self.calls.append(timeout)
        if self.error:
            raise RuntimeError(self.error)
        return True


@pytest.mark.parametrize("message, timeout", [(GLOO_TIMEOUT, True), (NCCL_TIMEOUT, True), (GLOO_RESET, False)])
def test_backend_messages_map_to_the_right_error(message, timeout):
    assert is_timeout(RuntimeError(message)) == timeout
    for stream_wait in (False, True):
        with pytest.raises(DGCCommError) as info:
            wait_torch_work(FakeWork(message), "the compressed all-to-all", 3, 8.0, stream_wait)
        assert isinstance(info.value, DGCTimeoutError) == timeout
        assert "the compressed all-to-all on rank 3" in str(info.value)
        if timeout:
            assert "dgc.timeout_s = 8 s" in str(info.value)


def test_nccl_waits_on_the_stream_gloo_on_the_host():
    """stream_wait (NCCL): Work.wait() without a timeout, which only makes the current stream wait; else the host waits
    with the timeout."""
    nccl, gloo = FakeWork(), FakeWork()
    wait_torch_work(nccl, "x", 0, 5.0, stream_wait=True)
    wait_torch_work(gloo, "x", 0, 5.0, stream_wait=False)
    assert nccl.calls == [None] and gloo.calls == [datetime.timedelta(seconds=5.0)]
