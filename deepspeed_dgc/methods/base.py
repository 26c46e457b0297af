"""One interface for the ways of reducing a bucket, and the table that picks one from the config.

A method takes a whole bucket (:class:`Bucket`) and one exchange (:class:`Exchange`: a communicator, this rank's row,
the owner of every row) and does steps 2-6 of the compressed reduce-scatter (:mod:`deepspeed_dgc.zero3.reduce_scatter`):
what each owner row is sent, the exchange, this rank's row of the sum, and what it keeps for the next step (residuals,
momenta). After the models of GRACE (Xu et al., ICDCS 2021: a compressor, a memory and a communicator behind one
step) and PyTorch's DDP communication hooks (a state object and one function per bucket).

A method whose payload sizes follow from the bucket's shape alone (:meth:`~GradientMethod.fixed_payloads`) says in which padded owner
matrix it codes a bucket (:meth:`GradientMethod.layout`), so that the hierarchical topology
(:class:`~deepspeed_dgc.methods.hierarchical.Hierarchical`, which wraps any method) hands it the node-level sums in
that matrix. The owners' side (a replaced optimizer step, something done after each step) is the method's too:
:meth:`~GradientMethod.install` and :meth:`~GradientMethod.after_step`.

Adding a method: a module defining a subclass of :class:`GradientMethod`, decorated with :func:`register` (its name,
when the config asks for it, and its order), imported on every rank before ``deepspeed.initialize`` (the package's
``__init__`` imports the modules of this package). ``when`` reads the existing ``"dgc"`` keys: the config refuses
unknown keys, so a method switched on by a key of its own also adds that key to :mod:`deepspeed_dgc.config`. The
reducer and the patches stay as they are. A method that the hierarchical topology is to wrap says its owner matrix
(:meth:`GradientMethod.layout`); one that does not is refused with that topology at initialize.
"""

from dataclasses import dataclass, field
from typing import Callable, ClassVar, Dict, Hashable, List, Optional, Sequence, Tuple, Type

import torch

from ..codec.layout import BucketLayout, Workspace, real_count


@dataclass
class Bucket:
    """One call's bucket, fixed at entry.

    Attributes:
        keys: stable key of each tensor; numels: elements per tensor; chunks: ``ceil(n_i / W)``; world: W.
        grads: the gradients as given (any float dtype, multiplied by the loss scale); srcs: the gradients in the
            communication dtype (what stock sends), flat.
        divisor: the sources are divided by it in the first fp32 pass (``W * loss_scale``).
        loss_scale: restored on exit; comm_dtype: of raw values and of the dense intra-node hop.
        density, quantization, group_size: the top-k codec of this bucket; sparse: per tensor, whether top-k is asked.
        fingerprint: written in every header (config and bucket shape).
        density_pending: ``density: "auto"`` on the hierarchical topology: estimated after the dense hop.
        workspace: memory the bucket's stages may overwrite (the gradients once read, where the caller allows).
    """
    keys: List[Hashable]
    numels: List[int]
    chunks: List[int]
    world: int
    grads: List[torch.Tensor]
    srcs: List[torch.Tensor]
    divisor: float
    loss_scale: float
    comm_dtype: torch.dtype
    density: float = 1.0
    quantization: str = "none"
    group_size: int = 0
    sparse: List[bool] = field(default_factory=list)
    fingerprint: int = 0
    density_pending: bool = False
    workspace: Workspace = field(default_factory=Workspace)

    @property
    def device(self) -> torch.device:
        return self.srcs[0].device


@dataclass
class Exchange:
    """Where a bucket's rows go: ``comm`` (None: one row, nothing crosses the network), this rank's ``row``, and the
    owner index of every row (flat: ``0..W-1``; hierarchical: the owners ``k L + l`` of this local rank)."""
    comm: Optional[object]
    row: int
    owners: Tuple[int, ...]

    @property
    def rows(self) -> int:
        return len(self.owners)


@dataclass
class Reduced:
    """What a method gives back: ``out``, this rank's row of the sum over senders (fp32, unscaled, in the method's
    columns), ``views`` the real part of each tensor's slice in it (bucket order), whether this rank's input was
    finite (the fixed-size methods say True and poison the rows instead), and the values sent (all rows)."""
    out: torch.Tensor
    views: List[torch.Tensor]
    finite: bool
    kept: int


class GradientMethod:
    """A way of reducing whole buckets (see the module docstring).

    Args:
        reducer: the :class:`~deepspeed_dgc.zero3.reduce_scatter.CompressedReduceScatter` it serves: its config,
            memory, momentum state, schedule, generators and the checks of the exchange.
    """

    name: ClassVar[str] = ""
    resolves_density: ClassVar[bool] = False  # a pending density: "auto" is estimated by the method itself
    # on one node (nothing crosses a node) the hierarchical topology hands the node's sum to whole(); False: to
    # reduce() over no network, for a method whose step depends on its own extraction (decoupled momentum)
    whole_on_one_node: ClassVar[bool] = True

    def __init__(self, reducer):
        self.reducer = reducer
        self.cfg = reducer.cfg

    def fixed_payloads(self, bucket: Bucket) -> bool:
        """Whether every payload of ``bucket`` has a size known from its shape (one ``all_to_all_single``, no size
        exchange; the hierarchical hop then exchanges its dense rows the same way)."""
        return True

    def layout(self, bucket: Bucket, owners: Sequence[int]) -> Optional[BucketLayout]:
        """The padded owner matrix this method codes ``bucket`` in, for rows of ``owners`` (None: it takes the
        sources per tensor)."""
        return None

    def reduce_all(self, bucket: Bucket, comms) -> Reduced:
        """The whole reduction of a bucket over a partition group's communicators
        (:class:`~deepspeed_dgc.comm.topology.ReduceComms`): on the flat topology, one exchange over all ranks."""
        return self.reduce(bucket, Exchange(comms.flat, comms.rank, tuple(range(comms.world_size))))

    def reduce(self, bucket: Bucket, exchange: Exchange, A: Optional[torch.Tensor] = None) -> Reduced:
        """Steps 2-6 of one bucket over one exchange.

        Args:
            bucket: the bucket; exchange: where its rows go.
            A: the sources as an owner matrix of :meth:`layout` for ``exchange``'s owners (fp32, to be divided by
                ``bucket.divisor``: the hierarchical topology's node-level sums), or None: ``bucket``'s per-tensor
                sources.
        """
        raise NotImplementedError

    def whole(self, bucket: Bucket, A: torch.Tensor, L: BucketLayout) -> Reduced:
        """One row that crosses no network (the hierarchical topology on one node): its sum sent whole, ``A`` (fp32
        ``(1, C)`` of ``L``, to be divided by ``bucket.divisor``). A method with state of its own (a momentum)
        updates it here too."""
        out = A[0].div_(bucket.divisor) if bucket.divisor != 1 else A[0]
        return Reduced(out, L.row_slices(out, 0), True, sum(L.real[0]))

    def send_by_stock(self, grads: Sequence[torch.Tensor], keys: Sequence[Hashable], comms, comm_dtype: torch.dtype,
                      loss_scale: float) -> None:
        """``policy: "auto"``: this bucket goes by stock's reduce-scatter instead. Make ``grads`` (this rank's full
        gradients, times ``loss_scale``, which stock is about to divide by W and sum) carry what the method has not
        sent yet, and stage what it keeps, so that the owners' step stays the method's.

        Here: the error-feedback residuals go along. Each residual (unscaled, in the units of the mean) is added to
        this rank's gradient times ``W * loss_scale``, and a zero residual is staged in its place (kept if the step is
        applied). Flat topology: the residual is the whole tensor's (``n`` elements); hierarchical: the node-level
        rows of the owners ``k L + local`` (``N x ceil(n / W)``), added at those owners' slices (the node's dense sum
        then carries them)."""
        scale = comms.world_size * loss_scale
        residuals = self.reducer.memory.flush(keys)
        for g, key in zip(grads, keys):
            residual = residuals.get(key)
            if residual is None:
                continue
            flat = g.view(-1)
            if not comms.hierarchical:
                flat.add_(residual.view(-1)[:flat.numel()].to(flat.dtype), alpha=scale)
                continue
            n, L, W = flat.numel(), comms.ranks_per_node, comms.world_size
            c = -(-n // W)
            rows = residual.view(-1, c)
            for k in range(rows.shape[0]):
                owner = k * L + comms.local_rank
                count = real_count(n, owner, c)
                if count > 0:
                    flat.narrow(0, owner * c, count).add_(rows[k, :count].to(flat.dtype), alpha=scale)

    # ---- the owners' side and the step's end --------------------------------------------------------------------

    def partitions_hold(self, state) -> Optional[str]:
        """None where ZeRO-3's gradient partitions hold the averaged gradient (as the owners reconstructed it) after
        the reduce-scatter; else what they hold instead, in words (DeepSpeed's gradient APIs then raise, naming it:
        :mod:`deepspeed_dgc.zero3.ds_api`)."""
        return None

    def install(self, engine, opt, state) -> None:
        """Replace what the owners do with the sum (the optimizer's step, clipping), if the method changes it."""

    def after_step(self, opt, state, applied: bool) -> None:
        """After every optimizer step: what the method does then (collective where it says)."""

    def before_load(self, opt, state) -> None:
        """Before a checkpoint is loaded into the engine: undo what :meth:`after_step` set up that the checkpoint
        decides afresh."""

    def after_load(self, opt, state) -> None:
        """After a checkpoint was loaded (on every rank: collective where it says): set up again what the loaded
        state decides."""


METHODS: Dict[str, Type[GradientMethod]] = {}
_WHEN: Dict[str, Tuple[Callable, int]] = {}


def register(name: str, when: Callable[[object, str], bool],
             order: int = 0) -> Callable[[Type[GradientMethod]], Type[GradientMethod]]:
    """Class decorator: make a method available under ``name``, chosen for a ``"dgc"`` config and device type where
    ``when(cfg, device_type)`` holds (of several, the highest ``order``: a momentum method before plain top-k; two of
    the highest order that both want a config are an error at initialize).

    Raises:
        ValueError: ``name`` is empty or already registered, ``when`` is not callable, ``order`` is not an int, or
            the decorated class is not a :class:`GradientMethod`.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register: a gradient method needs a non-empty name, got {name!r}")
    if name in METHODS:
        raise ValueError(f"register: a gradient method named {name!r} is registered already "
                         f"({METHODS[name].__module__}.{METHODS[name].__qualname__})")
    if not callable(when):
        raise ValueError(f"register({name!r}): 'when' must be callable (cfg, device_type) -> bool, got {when!r}")
    if not isinstance(order, int) or isinstance(order, bool):
        raise ValueError(f"register({name!r}): 'order' must be an int, got {order!r}")

    def add(cls: Type[GradientMethod]) -> Type[GradientMethod]:
        if not (isinstance(cls, type) and issubclass(cls, GradientMethod)):
            raise ValueError(f"register({name!r}) decorates {cls!r}, not a GradientMethod subclass")
        cls.name = name
        METHODS[name] = cls
        _WHEN[name] = (when, order)
        return cls

    return add


def _wants(name: str, when: Callable, cfg, device_type: str) -> bool:
    try:
        return bool(when(cfg, device_type))
    except Exception as e:
        raise RuntimeError(f"the condition ('when') of gradient method {name!r} raised on this 'dgc' config: "
                           f"{type(e).__name__}: {e}") from e


def method_name(cfg, device_type: str) -> str:
    """The registered name of the method the ``"dgc"`` config asks for on gradients of ``device_type``.

    Raises:
        ValueError: no registered method takes this config, or two of the highest order do.
        RuntimeError: a method's condition raised (named).
    """
    wanted = [(order, name) for name, (when, order) in _WHEN.items() if _wants(name, when, cfg, device_type)]
    if not wanted:
        raise ValueError(f"no gradient method takes this 'dgc' config on {device_type!r}")
    top = max(order for order, _ in wanted)
    names = sorted(name for order, name in wanted if order == top)
    if len(names) > 1:
        raise ValueError(f"gradient methods {names} (order {top}) all take this 'dgc' config on {device_type!r}: "
                         "register one with a higher order, or narrow their conditions")
    return names[0]


def build(reducer, device_type: str, wrap: Optional[Callable] = None) -> GradientMethod:
    """The method for ``reducer``'s config on ``device_type`` (from :data:`METHODS`, which :mod:`deepspeed_dgc.methods`
    fills), wrapped by ``wrap`` (the hierarchical topology) where given.

    Raises:
        ValueError: as :func:`method_name`; or ``wrap`` is given and the method has no :meth:`GradientMethod.layout`.
    """
    method = METHODS[method_name(reducer.cfg, device_type)](reducer)
    if wrap is None:
        return method
    if type(method).layout is GradientMethod.layout:
        raise ValueError(f"gradient method {method.name!r} says no owner matrix (GradientMethod.layout), which the "
                         "hierarchical topology needs to hand it the node-level sums: use the flat topology with it")
    return wrap(reducer, method)
