"""Local momentum states that ride along the gradient exchange, behind one interface (:class:`MomentumState`).

- :class:`CompressedMomentum` (``dgc.compressed_momentum``, for Adam): 1-bit Adam's recipe (Tang et al.,
  ICML 2021, sections 3.1-3.3, Algorithm 1) on ZeRO-3's partitions. Every rank keeps the momentum of its own
  gradient, ``m_r = b1 m_r + (1 - b1) g_r / W``; after ``freeze_step`` steps Adam's second moment is frozen
  and the ranks send ``m_r`` (divided by the frozen ``sqrt(v_hat) + eps`` with ``precondition``) instead of
  the gradient, so the owners' update is linear in what was sent and error feedback corrects the compression.
- :class:`DecoupledMomentum` (``dgc.decoupled_momentum``, for any optimizer): DeMo's decoupled momentum (Peng et
  al., arXiv 2411.19870, section 3, Algorithm 1). Every rank keeps ``delta_r = decay delta_r + g_r / W``, sends a
  chunked top-k of its DCT (:mod:`deepspeed_dgc.codec.dct`) and keeps what it did not send.
- :class:`MomentumCorrection` (``dgc.momentum_correction``, for momentum SGD): DGC's momentum correction,
  momentum factor masking and local gradient clipping (Lin et al., ICLR 2018, sections 3.1-3.3). Every rank
  keeps its velocity ``u_r = m u_r + clip(g_r) / W`` and error feedback accumulates and sends ``u_r``.

What the owners do with the sum (the frozen-variance Adam step, SGD without momentum) is in
:mod:`deepspeed_dgc.zero3.optimizer`. Every state here is in unscaled gradient units divided by W, fp32,
full parameter shape (4 bytes per parameter), staged during an accumulation window and committed or rolled
back with the residuals.
"""

from typing import Dict, Hashable, List, Optional, Protocol, Sequence, Tuple

import torch

from ..config import CompressedMomentumConfig, DecoupledMomentumConfig, DGCConfig
from .error_feedback import ErrorFeedback

Codec = Tuple[float, str, int]  # (density, quantization, group_size)


class MomentumState(Protocol):
    """A local momentum kept by every rank beside its error-feedback residuals.

    The compressed reduce-scatter uses it in three places of a bucket's path:

    1. :meth:`sources` before compressing: updates (stages) the momentum of each gradient and returns what is
       compressed instead of the gradients, or None while the gradients themselves are sent;
    2. :meth:`codec` chooses the bucket's ``(density, quantization, group_size)`` when the state has its own;
    3. :meth:`after_exchange` after a finite exchange: sees what was sent (momentum factor masking).

    The step wrapper calls :meth:`commit` after an applied step and :meth:`rollback` after a skipped one.

    Attributes:
        steps_done: optimizer steps applied since the state began (checkpointed).
    """

    steps_done: int

    @property
    def sending(self) -> bool:
        """Whether this step compresses the momentum (True) or the gradient (False)."""

    def codec(self) -> Optional[Codec]:
        """The state's own ``(density, quantization, group_size)``, or None: the top-level keys apply."""

    def sources(self, keys: Sequence[Hashable], grads: Sequence[torch.Tensor],
                divisor: float) -> Optional[List[torch.Tensor]]:
        """Stage ``m <- update(m, grad / divisor)`` per key; return what is compressed (fp32 ``(n_i,)``, already
        divided), or None when the gradients are sent."""

    def after_exchange(self, keys: Sequence[Hashable], sources: Sequence[torch.Tensor],
                       residuals_before: Sequence[Optional[torch.Tensor]],
                       residuals_after: Sequence[Optional[torch.Tensor]], sparse: Sequence[bool]) -> None:
        """Called after a finite exchange of ``sources`` with the residuals before and after it."""

    def commit(self) -> None:
        """The step was applied: keep this window's momenta; one more step done."""

    def rollback(self) -> None:
        """The step was skipped: forget this window's momenta."""

    def clear(self) -> None:
        """Forget every momentum and restart the count (state that cannot be loaded)."""

    def drop(self, keys: Sequence[Hashable]) -> None:
        """Forget the momenta of these keys (parameters that no longer train)."""

    def state_bytes(self) -> int:
        """Bytes held between steps."""

    def peak_bytes(self) -> int:
        """The most this state held in this process (committed and staged), bytes."""

    def export(self) -> dict:
        """``{"momenta": {key: cpu fp32 tensor, or the storage form}, "steps_done": int}`` (and ``"storage"`` when the
        momenta are in a storage form) for a checkpoint."""

    def restore(self, saved: dict, device, scale: float = 1.0) -> None:
        """Put exported momenta back (multiplied by ``scale``: re-sharded ones are split evenly)."""


class _LocalMomentum:
    """What the states share: momenta per key in an :class:`~deepspeed_dgc.memory.error_feedback.ErrorFeedback`
    store (fp32, staged and committed like residuals) and the count of applied steps."""

    def __init__(self, storage: str = "fp32", offload: bool = False):
        self.store = ErrorFeedback(storage, offload=offload)
        self.steps_done = 0

    @staticmethod
    def codec() -> Optional[Codec]:
        """None: the top-level keys apply (momentum correction), or the state has its own codec outside them
        (decoupled momentum: :mod:`deepspeed_dgc.codec.dct`)."""
        return None

    @staticmethod
    def freeze_due() -> bool:
        """Never, unless a state freezes something (compressed momentum)."""
        return False

    def state_bytes(self) -> int:
        """Bytes held between steps: the committed momenta, in the store's storage."""
        return self.store.state_bytes()

    def peak_bytes(self) -> int:
        """The most held in this process: the momenta's peak (committed + staged, :attr:`ErrorFeedback.peak_bytes`)
        plus what else :meth:`state_bytes` counts (a frozen preconditioner)."""
        return self.state_bytes() - self.store.state_bytes() + self.store.peak_bytes

    def committed(self, key: Hashable) -> Optional[torch.Tensor]:
        """This key's momentum as of the last applied step (None before the first)."""
        return self.store.committed_value(key)

    def momenta(self) -> Dict[Hashable, torch.Tensor]:
        """Every committed momentum, by key."""
        return self.store.residuals()

    def commit(self) -> None:
        self.store.commit()
        self.steps_done += 1

    def rollback(self) -> None:
        self.store.rollback()

    def clear(self) -> None:
        self.store.clear()
        self.steps_done = 0

    def drop(self, keys) -> None:
        self.store.drop(keys)

    def export(self) -> dict:
        """fp32 momenta (fp32 and bf16 storage: exact), or for int8 storage the store's own form (:meth:`ErrorFeedback.
        export`, with ``"storage"``), which :meth:`restore` puts back bit for bit."""
        if self.store.storage == "int8":
            return {"momenta": self.store.export(), "storage": "int8", "steps_done": self.steps_done}
        return {"momenta": {k: v.detach().cpu() for k, v in self.store.residuals().items()}, "steps_done": self.steps_done}

    def restore(self, saved: dict, device, scale: float = 1.0) -> None:
        storage = saved.get("storage", "fp32")
        if storage == self.store.storage and scale == 1.0:
            self.store.restore(saved["momenta"], storage, device)
        else:
            self.store.load({k: (ErrorFeedback.decode(v).double() * scale).float().to(device)
                             for k, v in saved["momenta"].items()})
        self.steps_done = int(saved["steps_done"])


class CompressedMomentum(_LocalMomentum):
    """This rank's local momentum of Adam and, after the freeze, the frozen preconditioner.

    Before the freeze the gradients are sent (compressed by the top-level keys) and Adam runs as stock;
    the local momentum is kept all along so that it is ready at the freeze. After it, the momentum
    ``m_r / (sqrt(v_hat) + eps)`` (``precondition``) or ``m_r`` is sent, compressed by this section's keys.

    Args:
        cfg: the ``compressed_momentum`` section.
        beta1: Adam's beta1.
    """

    def __init__(self, cfg: CompressedMomentumConfig, beta1: float):
        super().__init__()
        self.cfg = cfg
        self.beta1 = beta1
        self.frozen = False
        self.inv_denominator: Dict[Hashable, torch.Tensor] = {}  # key -> bf16 1 / (sqrt(v_hat) + eps), full shape
        self.owner_inv: List[torch.Tensor] = []  # this owner's fp32 1 / (sqrt(v_hat) + eps) per sub-group

    @property
    def sending(self) -> bool:
        """After the freeze the momentum is sent instead of the gradient."""
        return self.frozen

    def codec(self) -> Optional[Codec]:
        return (self.cfg.density, self.cfg.quantization, self.cfg.group_size) if self.frozen else None

    def freeze_due(self) -> bool:
        """True when ``freeze_step`` steps are done and Adam is not frozen yet (the freeze comes next)."""
        return self.steps_done >= self.cfg.freeze_step and not self.frozen

    def set_frozen(self, inv_denominator: Dict[Hashable, torch.Tensor], owner_inv: List[torch.Tensor]) -> None:
        """Enter the momentum phase with the frozen preconditioner: every key's bf16 ``1 / (sqrt(v_hat) + eps)``
        (``precondition``), or this owner's fp32 one per sub-group (without)."""
        self.inv_denominator, self.owner_inv, self.frozen = inv_denominator, owner_inv, True

    def unfreeze(self) -> None:
        """Back to the gradient phase (before a checkpoint decides afresh); the preconditioners are dropped."""
        self.inv_denominator, self.owner_inv, self.frozen = {}, [], False

    def sources(self, keys, grads, divisor):
        """Stage ``m = b1 m + (1 - b1) g / divisor`` per key; after the freeze return what is sent."""
        momenta = []
        for key, grad in zip(keys, grads):
            g = grad.reshape(-1).float() / divisor  # a new tensor: the gradient itself may still be sent
            m = self.committed(key)
            m_new = g.mul_(1.0 - self.beta1) if m is None else m.mul(self.beta1).add_(g, alpha=1.0 - self.beta1)
            self.store.stage(key, m_new)
            momenta.append(m_new)
        if not self.frozen:
            return None
        if not self.cfg.precondition:
            return momenta
        return [m * self.inv_denominator[k].float() for k, m in zip(keys, momenta)]

    def after_exchange(self, keys, sources, residuals_before, residuals_after, sparse) -> None:
        """Nothing: the momentum is never masked here (1-bit Adam keeps it whole)."""

    def state_bytes(self) -> int:
        """Bytes held between steps: committed momentum plus the frozen preconditioner."""
        pre = list(self.inv_denominator.values()) + list(self.owner_inv)
        return self.store.state_bytes() + sum(t.numel() * t.element_size() for t in pre)


class DecoupledMomentum(_LocalMomentum):
    """DeMo's decoupled momentum on ZeRO-3's partitions: each rank's own momentum, sent as a chunked DCT top-k.

    Peng, Quesnelle and Kingma, "DeMo: Decoupled Momentum Optimization", arXiv 2411.19870, section 3,
    Algorithm 1 (bloc97/DeMo ``demo.py``). Every rank r keeps, per parameter, ``delta_r`` (full parameter shape,
    in unscaled gradient units divided by W, stored in ``storage``)::

        delta_r <- decay delta_r + g_r / W              (every send; :meth:`sources`)
        q_r     = top-k per chunk of DCT(delta_r)       (codec.dct: chunks inside each owner's partition)
        delta_r <- delta_r - IDCT(deq(q_r))             (what was sent, quantization error included, leaves;
                                                         the rest stays: DeMo's subtraction is the error feedback)

    and the owners step with ``u = sum_r IDCT(deq(q_r))``: DeMo's ``p <- p (1 - lr wd) - lr sign(u)``
    (``update: "sign"``, :func:`deepspeed_dgc.zero3.optimizer.sign_step`) or the job's own Adam on ``u``
    (``update: "adam"``). With gradient accumulation, ``g_r`` is the window's sum, sent once at its end
    (``accumulate_locally``, :mod:`deepspeed_dgc.zero3.accumulation`); with ``accumulate_locally: false`` each
    micro-step sends its top-k, the owners' step sees the window's sum and the decay applies per micro-step.

    Args:
        cfg: the ``decoupled_momentum`` section.
        offload: keep the momentum in host memory between steps (``cfg.offload``, resolved).
    """

    sending = True

    def __init__(self, cfg: DecoupledMomentumConfig, offload: bool = False):
        super().__init__(cfg.storage, offload)
        self.cfg = cfg

    def sources(self, keys, grads, divisor):
        """``delta = decay delta + grad / divisor`` per key (from the latest, so micro-steps of a window add up), new
        fp32 tensors; what the exchange leaves of them is staged by :meth:`keep_rest`."""
        out = []
        for key, grad in zip(keys, grads):
            g = grad.reshape(-1).float() / divisor
            d = self.store.get(key)
            out.append(g if d is None else d.mul(self.cfg.decay).add_(g))
        return out

    def after_exchange(self, keys, sources, residuals_before, residuals_after, sparse) -> None:
        """Nothing: the reducer stages what was not sent itself (:meth:`keep_rest`)."""

    def keep_rest(self, keys: Sequence[Hashable], rests: Sequence[torch.Tensor]) -> None:
        """Stage what each key's momentum keeps after the exchange (``delta - sent``)."""
        for key, rest in zip(keys, rests):
            self.store.stage(key, rest)


class MomentumCorrection(_LocalMomentum):
    """DGC's momentum correction, momentum factor masking and local gradient clipping for momentum SGD.

    Lin et al., "Deep Gradient Compression", ICLR 2018, sections 3.1-3.3. Every rank r keeps its own
    velocity (full parameter shape, fp32, in gradient units divided by W)::

        u_r <- m u_r + clip(g_r) / W          (clip: local_clip_norm per tensor, section 3.2)
        v_r <- v_r + u_r                      (the error-feedback residual accumulates the velocity)
        send top-k of v_r; v_r keeps the rest (and the quantization error)
        u_r[kept] <- 0                        (momentum factor masking, section 3.3; sparse tensors only)

    and the owners apply ``p <- p - lr (sum_r sent_r + b)`` with ``b`` the momentum of the weight-decay term
    (:func:`deepspeed_dgc.zero3.optimizer.dgc_sgd_step`). At density 1 without quantization this is exactly
    momentum SGD. Tensors sent whole are not masked: every element is sent each step.

    Args:
        cfg: the ``"dgc"`` config (``momentum_factor_masking``, ``local_clip_norm``).
        momentum: SGD's momentum m.
        world: W, ranks of the data-parallel group.
    """

    sending = True

    def __init__(self, cfg: DGCConfig, momentum: float, world: int):
        super().__init__()
        self.masking = cfg.momentum_factor_masking
        self.clip_norm = cfg.local_clip_norm
        self.momentum = momentum
        self.world = world


    def sources(self, keys, grads, divisor):
        """Stage ``u = m u + clip(g / divisor)`` per key (the divisor holds W: the clipping bound is
        ``local_clip_norm / W``, the same as clipping the local gradient to ``local_clip_norm``); return them."""
        velocities = []
        for key, grad in zip(keys, grads):
            g = grad.reshape(-1).float() / divisor
            if self.clip_norm is not None:
                bound = self.clip_norm / self.world
                norm = torch.linalg.vector_norm(g).double()  # on the device: no read-back
                # factor 1 where the norm is within the bound (or NaN: a non-finite gradient stays non-finite)
                g.mul_(torch.where(norm > bound, bound / norm, 1.0))
            u = self.committed(key)
            u_new = g if u is None else u.mul(self.momentum).add_(g)
            self.store.stage(key, u_new)
            velocities.append(u_new)
        return velocities

    def after_exchange(self, keys, sources, residuals_before, residuals_after, sparse) -> None:
        """Momentum factor masking: zero the staged velocity where top-k sent an element.

        A sent element is one whose new residual differs from the accumulator ``u + v`` (an unsent element
        keeps it exactly: the job's accumulator and residual are exact at divisor 1); an element whose
        quantized value is 0 counts as not sent.
        """
        if not self.masking:
            return
        for key, u, is_sparse, before, after in zip(keys, sources, sparse, residuals_before, residuals_after):
            if not is_sparse or after is None:
                continue
            acc = u if before is None else u + before
            self.store.stage(key, self.store.get(key).masked_fill(after.ne(acc), 0.0))
