"""Compressed momentum for Adam: 1-bit Adam's recipe (Tang et al., ICML 2021) on ZeRO-3's partitions.

Why: sparse or coarse gradients with error feedback work for momentum SGD, but Adam divides every
coordinate by ``sqrt(v)``: residuals that arrive late and in bursts inflate ``v`` and the step is not
linear in what was sent. 1-bit Adam observes that ``v`` changes slowly after a warm-up, freezes it,
and communicates the momentum instead, so the optimizer step becomes linear in the compressed
quantity and error feedback can correct the compression error (sections 3.1-3.3, Algorithm 1).

Where the state lives (ZeRO-3):

- the *local momentum* ``m_r`` of each rank's own gradient, full parameter shape, on every rank
  (4 bytes per parameter): the mean of what the ranks send must be the momentum of the mean
  gradient, and momentum is linear, so each rank keeps its own and the owner sums them;
- after the freeze, with ``precondition``, ``1 / (sqrt(v_hat) + eps)`` of every parameter in bf16 on
  every rank (2 bytes per parameter), gathered once from the owners' Adam state, so that ranks
  compress the update ``m / (sqrt(v_hat) + eps)`` itself (group scales then see values of one scale);
- Adam's own ``exp_avg``/``exp_avg_sq`` stay partitioned on the owners and stop changing at the freeze;
- the error-feedback residual (:mod:`deepspeed_dgc.memory`) of the momentum phase, full shape.

The owner's update after the freeze: ``p <- p (1 - lr wd) - lr u`` with ``u`` the sum over ranks of
what they sent (``m_r / (sqrt(v_hat) + eps)`` with ``precondition``, else ``m_r`` divided by the
owner's ``sqrt(v_hat) + eps``); ``v_hat = v_T / (1 - b2^T)`` at the freeze step T; no bias
correction of ``m`` (1 - b1^T is 1 to within b1^T).
"""

import types
from typing import Dict, List

import torch
from deepspeed import comm as dist

from .config import CompressedMomentumConfig, DGCConfig, DGCConfigError
from .memory import ErrorFeedback

# optimizers whose state holds Adam's "exp_avg_sq" and whose param groups hold lr, betas, eps, weight_decay
ADAM_TYPES = ("Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam")
V_FLOOR = 0.01  # frozen v_hat is at least this times its parameter's mean (see _owner_inv_denominator)


def _decoupled_weight_decay(optimizer) -> bool:
    name = type(optimizer).__name__
    if name == "AdamW":
        return True
    if name == "Adam":
        return bool(optimizer.defaults.get("decoupled_weight_decay", False))
    return bool(getattr(optimizer, "adam_w_mode", getattr(optimizer, "adamw_mode", True)))


def check_optimizer(optimizer, gradient_accumulation_steps: int, fp16: bool = False, offload: bool = False) -> float:
    """Check that the owners' optimizer is Adam-like and the job fits; returns Adam's beta1.

    Raises:
        DGCConfigError: another optimizer, L2 (not decoupled) weight decay, gradient accumulation,
            param groups with different beta1, fp16 (the update, about 1 per element, times the loss
            scale would overflow ZeRO-3's fp16 gradient partitions) or optimizer offload.
    """
    name = type(optimizer).__name__
    if fp16:
        raise DGCConfigError("'dgc.compressed_momentum' does not support 'fp16' engines (after the freeze the "
                             "partitions carry the update times the loss scale, which overflows fp16); use bf16 or fp32")
    if offload:
        raise DGCConfigError("'dgc.compressed_momentum' does not support 'zero_optimization.offload_optimizer' "
                             "(the frozen preconditioner lives with the gradients)")
    if name not in ADAM_TYPES:
        raise DGCConfigError(f"'dgc.compressed_momentum' needs an Adam optimizer ({', '.join(ADAM_TYPES)}), got {name}")
    if gradient_accumulation_steps != 1:
        raise DGCConfigError("'dgc.compressed_momentum' needs 'gradient_accumulation_steps' = 1 (got "
                             f"{gradient_accumulation_steps})")
    if not _decoupled_weight_decay(optimizer) and any(g.get("weight_decay", 0.0) for g in optimizer.param_groups):
        raise DGCConfigError("'dgc.compressed_momentum' needs decoupled weight decay (AdamW) or 'weight_decay' = 0: "
                             "with L2 decay the frozen-variance update is not linear in the momentum")
    betas = {tuple(g["betas"]) for g in optimizer.param_groups}
    if len({b[0] for b in betas}) != 1:
        raise DGCConfigError(f"'dgc.compressed_momentum' needs one beta1 for all param groups, got {sorted(betas)}")
    return float(next(iter(betas))[0])


class CompressedMomentum:
    """This rank's local momentum (staged and committed like residuals) and the frozen preconditioner.

    The reducer's interface (shared with :class:`MomentumCorrection`): ``sending`` (whether this
    step sends the momentum instead of the gradient), :meth:`update`, :meth:`to_send`,
    :meth:`after_exchange` and ``store`` (committed with the residuals, rolled back with them).

    Args:
        cfg: the ``compressed_momentum`` section.
        beta1: Adam's beta1.
    """

    def __init__(self, cfg: CompressedMomentumConfig, beta1: float):
        self.cfg = cfg
        self.beta1 = beta1
        self.store = ErrorFeedback()  # momentum per ds_id, fp32, full shape, unscaled, units of g / W
        self.inv_denominator: Dict[int, torch.Tensor] = {}  # ds_id -> bf16 1 / (sqrt(v_hat) + eps), full shape
        self.owner_inv: Dict[int, torch.Tensor] = {}  # id(fp32 flat partition) -> fp32 1 / (sqrt(v_hat) + eps)
        self.steps_done = 0  # optimizer steps applied
        self.frozen = False
        self._clip_grad = 0.0
        self._flats: List[torch.Tensor] = []

    def update(self, key: int, grad: torch.Tensor, world: int, loss_scale: float) -> torch.Tensor:
        """Stage ``m = b1 m + (1 - b1) g / (W * loss_scale)`` for ``key``; returns it (fp32, shape ``(n,)``)."""
        g = grad.reshape(-1).float() / (world * loss_scale)  # a new tensor: the gradient itself is still to be sent
        m = self.store.committed.get(key)
        m_new = g.mul_(1.0 - self.beta1) if m is None else m.mul(self.beta1).add_(g, alpha=1.0 - self.beta1)
        self.store.stage(key, m_new)
        return m_new

    @property
    def sending(self) -> bool:
        """After the freeze the momentum is sent instead of the gradient."""
        return self.frozen

    def freeze_due(self) -> bool:
        """True when ``freeze_step`` steps are done and Adam is not frozen yet (the freeze comes next)."""
        return self.steps_done >= self.cfg.freeze_step and not self.frozen

    def after_exchange(self, keys, sent_from, sparse, residuals_before, memory) -> None:
        """Nothing to do after an exchange (momentum is never masked here)."""

    def to_send(self, key: int, m: torch.Tensor) -> torch.Tensor:
        """What is compressed after the freeze: ``m / (sqrt(v_hat) + eps)`` with ``precondition``, else ``m``."""
        if not self.cfg.precondition:
            return m
        return m * self.inv_denominator[key].float()

    def state_bytes(self) -> int:
        """Bytes held between steps: committed momentum plus the frozen preconditioner."""
        pre = list(self.inv_denominator.values()) + list(self.owner_inv.values())
        return self.store.state_bytes() + sum(t.numel() * t.element_size() for t in pre)

    def freeze(self, opt, group) -> None:
        """Freeze Adam's second moment on the owners and switch ``opt`` to the frozen-variance update.

        Collective over ``group`` (the data-parallel group) when ``precondition`` is on: gathers every
        owner's ``1 / (sqrt(v_hat) + eps)`` so that every rank holds it for all parameters.

        Args:
            opt: the ZeRO-3 optimizer (``DeepSpeedZeroOptimizer_Stage3``); its ``optimizer`` (the
                owners' Adam) gets a new ``step`` and its gradient clipping is switched off.
            group: data-parallel process group.
        """
        basic = opt.optimizer
        missing = [i for i, flat in enumerate(opt.fp32_partitioned_groups_flat)
                   if "exp_avg_sq" not in basic.state.get(flat, {})]
        if missing:
            raise DGCConfigError(f"'dgc.compressed_momentum': cannot freeze Adam's second moment, sub-group(s) {missing} "
                                 "have no 'exp_avg_sq' (optimizer state not loaded or not Adam)")
        params, parts = self._owner_inv_denominator(opt)
        if self.cfg.precondition:
            self.inv_denominator = self._gather(params, parts, group)
        else:
            self.owner_inv = {id(opt.fp32_partitioned_groups_flat[i]): inv for i, inv in enumerate(self._flats)}
        self._flats = []
        self._clip_grad = opt.clip_grad
        opt.clip_grad = 0.0  # after the freeze the "gradient" is the update; clipping it would rescale steps
        owner_inv, decoupled = self.owner_inv, _decoupled_weight_decay(basic)

        def step(optimizer, closure=None):
            return frozen_variance_step(optimizer, owner_inv, decoupled, closure)

        basic.step = types.MethodType(step, basic)  # a bound method, as torch's (LR schedulers wrap step.__func__)
        self.frozen = True

    def unfreeze(self, opt) -> None:
        """Undo :meth:`freeze` (before a checkpoint is loaded): Adam's own step and the gradient clipping come
        back, the preconditioners are dropped."""
        if not self.frozen:
            return
        opt.optimizer.__dict__.pop("step", None)  # the instance attribute set by freeze; the class's step again
        opt.clip_grad = self._clip_grad
        self.inv_denominator, self.owner_inv, self.frozen = {}, {}, False

    def _owner_inv_denominator(self, opt):
        """This owner's ``1 / (sqrt(max(v_hat, floor)) + eps)`` per parameter partition, from Adam's state.

        ``floor`` is ``V_FLOOR`` times the parameter's mean ``v_hat`` (over its partition on this owner):
        Adam's ``v`` is of the compressed gradients of the warm-up, so a coordinate whose gradient was
        always rounded to zero has ``v = 0`` while its local momentum is not; without the floor its
        frozen step would be ``m / eps``.
        """
        params: List[torch.nn.Parameter] = []
        parts: List[torch.Tensor] = []
        self._flats = []
        for i, sub_group in enumerate(opt.fp16_groups):
            flat = opt.fp32_partitioned_groups_flat[i]
            st = opt.optimizer.state[flat]
            param_group = opt.optimizer.param_groups[opt.sub_group_to_group_id[i]]
            v_hat = st["exp_avg_sq"].float() / (1.0 - param_group["betas"][1]**float(st["step"]))
            inv = torch.empty_like(v_hat)
            for p in sub_group:
                _, offset, count = opt.grad_position[opt.get_param_id(p)]
                v = v_hat.narrow(0, offset, count)
                floor = V_FLOOR * float(v.mean()) if count else 0.0
                inv.narrow(0, offset, count).copy_(1.0 / (v.clamp(min=floor).sqrt() + param_group["eps"]))
                params.append(p)
                parts.append(inv.narrow(0, offset, count))
            self._flats.append(inv)
        return params, parts

    @staticmethod
    def _gather(params, parts, group) -> Dict[int, torch.Tensor]:
        world = dist.get_world_size(group=group)
        local = torch.cat(parts) if parts else torch.empty(0)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=group)
        out, col = {}, 0
        for p, part in zip(params, parts):
            c = part.numel()
            out[p.ds_id] = torch.cat([g[col:col + c] for g in gathered])[:p.ds_numel].to(torch.bfloat16)
            col += c
        return out


@torch.no_grad()
def frozen_variance_step(optimizer, owner_inv: Dict[int, torch.Tensor], decoupled: bool, closure=None):
    """The owners' step after the freeze: ``p <- p (1 - lr wd) - lr u`` for every param with a gradient.

    ``p.grad`` holds ``u``, the sum over ranks of their compressed momenta: already preconditioned
    when ``owner_inv`` is empty, else multiplied here by this owner's frozen ``1 / (sqrt(v_hat) + eps)``
    (``owner_inv[id(p)]``). Adam's state (``exp_avg``, ``exp_avg_sq``, ``step``) stays as at the freeze.
    Returns the closure's loss, or None.
    """
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    for group in optimizer.param_groups:
        lr, wd = group["lr"], group.get("weight_decay", 0.0)
        for p in group["params"]:
            if p.grad is None:
                continue
            u = p.grad
            if owner_inv:
                u = u * owner_inv[id(p)]
            if wd and decoupled:
                p.mul_(1.0 - lr * wd)
            p.add_(u, alpha=-lr)
    return loss


def check_sgd_optimizer(optimizer, gradient_accumulation_steps: int, fp16: bool = False, offload: bool = False) -> float:
    """Check that the owners' optimizer is momentum SGD and the job fits ``momentum_correction``; returns the momentum.

    Args:
        optimizer: the owners' basic optimizer (``zero_optimizer.optimizer``).
        gradient_accumulation_steps: the engine's.
        fp16: whether the engine runs fp16 with loss scaling.
        offload: whether the optimizer is offloaded.

    Raises:
        DGCConfigError: another optimizer (naming it), momentum 0, Nesterov, dampening, ``maximize``,
            param groups with different momenta, gradient accumulation, fp16 or optimizer offload; the
            message names the ds_config key.
    """
    name = type(optimizer).__name__
    if name != "SGD":
        raise DGCConfigError(f"'dgc.momentum_correction' is DGC's correction for momentum SGD and needs the SGD "
                             f"optimizer (torch.optim.SGD, ds_config \"SGD\") with momentum > 0, got {name}; for Adam use "
                             "'dgc.compressed_momentum'")
    momenta = {float(g.get("momentum", 0.0)) for g in optimizer.param_groups}
    if len(momenta) != 1 or next(iter(momenta)) <= 0.0:
        raise DGCConfigError(f"'dgc.momentum_correction' needs 'optimizer.params.momentum' > 0, the same for all param "
                             f"groups, got {sorted(momenta)}")
    for key in ("nesterov", "dampening", "maximize"):
        bad = sorted({g.get(key) for g in optimizer.param_groups if g.get(key)})
        if bad:
            raise DGCConfigError(f"'dgc.momentum_correction' supports SGD without 'optimizer.params.{key}' "
                                 f"(got {bad[0]!r}): plain momentum only")
    if gradient_accumulation_steps != 1:
        raise DGCConfigError("'dgc.momentum_correction' needs 'gradient_accumulation_steps' = 1 (got "
                             f"{gradient_accumulation_steps})")
    if fp16:
        raise DGCConfigError("'dgc.momentum_correction' does not support 'fp16' engines; use bf16 or fp32")
    if offload:
        raise DGCConfigError("'dgc.momentum_correction' does not support 'zero_optimization.offload_optimizer'")
    return next(iter(momenta))


class MomentumCorrection:
    """DGC's momentum correction, momentum factor masking and local gradient clipping for momentum SGD.

    Lin et al., "Deep Gradient Compression", ICLR 2018, sections 3.1-3.3. Sparse updates with
    plain error feedback accumulate gradients, and the owners' momentum then acts on a different
    sequence than dense SGD's. Instead every rank r keeps its own velocity (full parameter shape,
    fp32, 4 bytes per parameter, in gradient units divided by W)::

        u_r <- m u_r + clip(g_r) / W          (clip: local_clip_norm per tensor, section 3.2)
        v_r <- v_r + u_r                      (the error-feedback residual accumulates the velocity)
        send top-k of v_r; v_r keeps the rest (and the quantization error)
        u_r[kept] <- 0                        (momentum factor masking, section 3.3; sparse tensors only)

    and the owners apply ``p <- p - lr (sum_r sent_r + b)`` with ``b <- m b + wd p`` the momentum of
    the weight-decay term alone (:func:`dgc_sgd_step`). At density 1 without quantization this is
    exactly momentum SGD. Tensors sent whole (dense steps, tensors under ``min_numel``) are not
    masked: every element is sent each step and masking would erase the momentum.

    Args:
        cfg: the ``"dgc"`` config (``momentum_factor_masking``, ``local_clip_norm``).
        momentum: SGD's momentum m.
    """

    frozen = False  # the top-level codec throughout (no freeze, unlike CompressedMomentum)
    sending = True

    def __init__(self, cfg: DGCConfig, momentum: float):
        self.masking = cfg.momentum_factor_masking
        self.clip_norm = cfg.local_clip_norm
        self.momentum = momentum
        self.store = ErrorFeedback()  # velocity per ds_id, fp32, full shape, unscaled, units of g / W
        self.steps_done = 0  # optimizer steps applied

    @staticmethod
    def freeze_due() -> bool:
        """Never: nothing is frozen."""
        return False

    def unfreeze(self, opt) -> None:
        """Nothing is frozen (the owners' step stays :func:`dgc_sgd_step`)."""

    def update(self, key: int, grad: torch.Tensor, world: int, loss_scale: float) -> torch.Tensor:
        """Stage ``u = m u + clip(g / loss_scale) / W`` for ``key``; returns it (fp32, shape ``(n,)``).

        Args:
            key: the parameter's ``ds_id``.
            grad: this rank's full local gradient of it, any shape (n elements), any float dtype, scaled by
                ``loss_scale``.
            world: W, ranks of the data-parallel group.
            loss_scale: the engine's current loss scale (1 for bf16 and fp32).
        """
        g = grad.reshape(-1).float() / loss_scale
        if self.clip_norm is not None:
            norm = float(torch.linalg.vector_norm(g))
            if norm > self.clip_norm:  # also false for NaN: a non-finite gradient stays non-finite
                g.mul_(self.clip_norm / norm)
        g.div_(world)
        u = self.store.committed.get(key)
        u_new = g if u is None else u.mul(self.momentum).add_(g)
        self.store.stage(key, u_new)
        return u_new

    @staticmethod
    def to_send(key: int, u: torch.Tensor) -> torch.Tensor:
        """The velocity itself is sent (accumulated by error feedback)."""
        return u

    def after_exchange(self, keys, sent_from, sparse, residuals_before, memory) -> None:
        """Momentum factor masking: zero the staged velocity where top-k kept an element.

        Args:
            keys: ds_ids of the bucket.
            sent_from: the velocities the job accumulated (``to_send`` of each key), fp32 ``(n,)``.
            sparse: whether each tensor was top-k sparsified.
            residuals_before: each key's residual before the job (None: none yet).
            memory: the :class:`~deepspeed_dgc.memory.ErrorFeedback` holding the job's new residuals.

        A kept element is one whose new residual differs from the accumulator ``u + v`` (an unsent
        element keeps it exactly: the job's accumulator and residual are exact at divisor and loss
        scale 1); an element whose quantized value is 0 counts as not sent.
        """
        if not self.masking:
            return
        for key, u, is_sparse, before in zip(keys, sent_from, sparse, residuals_before):
            if not is_sparse:
                continue
            acc = u if before is None else u + before
            kept = memory.staged[key].ne(acc)
            self.store.staged[key] = self.store.staged[key].masked_fill(kept, 0.0)

    def state_bytes(self) -> int:
        """Bytes held between steps: the committed velocities."""
        return self.store.state_bytes()


@torch.no_grad()
def dgc_sgd_step(optimizer, closure=None):
    """The owners' SGD step under ``momentum_correction``: ``p <- p - lr (u + b)`` with ``b <- m b + wd p``.

    Installed as the bound ``step`` of the owners' ``torch.optim.SGD``. Each ``p`` is a flat fp32
    partition (ZeRO-3's sub-group); ``p.grad`` holds ``u``, the sum over ranks of what they sent for
    it, unscaled (the momentum already applied by the senders); the weight-decay term gets its own
    momentum buffer (``state[p]["momentum_buffer"]``), so with every element sent the update equals
    ``torch.optim.SGD``'s (DGC's reference optimizer, Lin et al. 2018, applies the same split).

    Args:
        optimizer: the SGD optimizer (its param groups give lr, momentum and weight_decay).
        closure: optional, re-evaluates the loss.

    Returns:
        The closure's loss, or None.
    """
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    for group in optimizer.param_groups:
        lr, wd, m = group["lr"], group.get("weight_decay", 0.0), group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            d_p = p.grad
            if wd:
                state = optimizer.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = p.detach().mul(wd)
                else:
                    buf.mul_(m).add_(p, alpha=wd)
                d_p = d_p.add(buf)
            p.add_(d_p, alpha=-lr)
    return loss
