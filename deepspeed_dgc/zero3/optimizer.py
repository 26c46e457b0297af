"""The owners' side of the momentum methods: optimizer checks, Adam's frozen preconditioner, the owners' steps.

Under ZeRO-3 each rank owns a partition of every parameter and runs the basic optimizer on it
(``zero_optimizer.optimizer``, over the flat fp32 partitions of its sub-groups). The momentum states of
:mod:`deepspeed_dgc.memory.momentum` change what the ranks send; these functions change what the owners do
with the sum:

- ``compressed_momentum`` (1-bit Adam, Tang et al., ICML 2021, sections 3.1-3.3): at the freeze, the owners'
  ``1 / (sqrt(v_hat) + eps)`` (:func:`frozen_preconditioner`), then :func:`frozen_variance_step`
  ``p <- p (1 - lr wd) - lr u`` with ``u`` the sum of what the ranks sent;
- ``decoupled_momentum`` (DeMo, Peng et al., arXiv 2411.19870, section 3): :func:`sign_step`,
  ``p <- p (1 - lr wd) - lr sign(u)`` with ``u`` the sum of the ranks' chunked DCT top-k, or the job's Adam on ``u``;
- ``momentum_correction`` (DGC, Lin et al., ICLR 2018, section 3.1): :func:`dgc_sgd_step`, SGD without momentum
  on the velocities the ranks sent, plus the momentum of the weight-decay term alone.

:mod:`deepspeed_dgc.zero3.patches` installs the steps on the optimizer.
"""

import math
from typing import Callable, Dict, Hashable, List, Tuple

import torch
from deepspeed import comm as dist

from ..comm.communicators import backend_of, bounded_group, wait_torch_work
from ..config import DGCConfigError

# optimizers whose state holds Adam's "exp_avg_sq" and whose param groups hold lr, betas, eps, weight_decay
ADAM_TYPES = ("Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam")
V_FLOOR = 0.01  # frozen v_hat is at least this times its parameter's mean (see frozen_preconditioner)


DECOUPLED_DECAY = ("AdamW", "Lion", "FusedLion", "DeepSpeedCPULion")  # weight decay applied to p, not added to g


def decoupled_weight_decay(optimizer) -> bool:
    """Whether ``optimizer``'s ``weight_decay`` is decoupled (``p <- p (1 - lr wd)``: AdamW, Lion, Adam with
    ``decoupled_weight_decay``, DeepSpeed's FusedAdam and CPU Adam in AdamW mode) or L2 (``wd p`` added to the
    gradient: SGD, Adam, and any other optimizer)."""
    name = type(optimizer).__name__
    if name in DECOUPLED_DECAY:
        return True
    if name == "Adam":
        return bool(optimizer.defaults.get("decoupled_weight_decay", False))
    if name in ("FusedAdam", "DeepSpeedCPUAdam"):
        return bool(getattr(optimizer, "adam_w_mode", getattr(optimizer, "adamw_mode", True)))
    return False


def _one_send_per_step(method: str, sends_per_step: int) -> None:
    """Raises DGCConfigError naming ``method`` and the keys that give one send per optimizer step."""
    if sends_per_step != 1:
        raise DGCConfigError(f"'dgc.{method}' needs one send per optimizer step: 'dgc.accumulate_locally' true (the "
                             "default) with DeepSpeed's managed gradient accumulation (not "
                             "'managed_gradient_accumulation': false, under which every micro-step is sent), or "
                             f"'gradient_accumulation_steps' = 1 (got {sends_per_step} sends per step)")


def check_optimizer(optimizer, sends_per_step: int, fp16: bool = False, offload: bool = False) -> float:
    """Check that the owners' optimizer is Adam-like and the job fits; returns Adam's beta1.

    Args:
        sends_per_step: reduce-scatters per optimizer step: 1, or with ``accumulate_locally: false`` the engine's
            ``gradient_accumulation_steps``.

    Raises:
        DGCConfigError: another optimizer, L2 (not decoupled) weight decay, more than one send per step,
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
    _one_send_per_step("compressed_momentum", sends_per_step)
    if not decoupled_weight_decay(optimizer) and any(g.get("weight_decay", 0.0) for g in optimizer.param_groups):
        raise DGCConfigError("'dgc.compressed_momentum' needs decoupled weight decay (AdamW) or 'weight_decay' = 0: "
                             "with L2 decay the frozen-variance update is not linear in the momentum")
    betas = {tuple(g["betas"]) for g in optimizer.param_groups}
    if len({b[0] for b in betas}) != 1:
        raise DGCConfigError(f"'dgc.compressed_momentum' needs one beta1 for all param groups, got {sorted(betas)}")
    return float(next(iter(betas))[0])



def frozen_preconditioner(opt, precondition: bool, group, key_of: Callable[[torch.nn.Parameter], Hashable],
                          timeout_s: float = 600.0) -> Tuple[Dict[Hashable, torch.Tensor], List[torch.Tensor]]:
    """Freeze Adam's second moment: this owner's ``1 / (sqrt(max(v_hat, floor)) + eps)``, and with
    ``precondition`` every parameter's, gathered from all owners.

    ``v_hat = v_T / (1 - b2^T)`` at the freeze step T. ``floor`` is ``V_FLOOR`` times the parameter's mean
    ``v_hat`` over its partition on this owner: Adam's ``v`` is of the compressed gradients of the warm-up, so a
    coordinate whose gradient was always rounded to zero has ``v = 0`` while its local momentum is not; without
    the floor its frozen step would be ``m / eps``.

    Args:
        opt: the ZeRO-3 optimizer (``DeepSpeedZeroOptimizer_Stage3``) whose basic optimizer is Adam.
        precondition: gather every parameter's preconditioner (collective over ``group``: an all-gather).
        group: the data-parallel process group.
        key_of: the stable key of a parameter.
        timeout_s: bound on the all-gather (``dgc.timeout_s``).

    Returns:
        ``(by_key, owner_inv)``: with ``precondition``, key -> bf16 ``(ds_numel,)`` of every parameter (else
        empty); and this owner's fp32 preconditioner per sub-group, shaped as its flat fp32 partition.

    Raises:
        DGCConfigError: a sub-group has no ``exp_avg_sq`` (optimizer state not loaded, or not Adam).
    """
    basic = opt.optimizer
    missing = [i for i, flat in enumerate(opt.fp32_partitioned_groups_flat) if "exp_avg_sq" not in basic.state.get(flat, {})]
    if missing:
        raise DGCConfigError(f"'dgc.compressed_momentum': cannot freeze Adam's second moment, sub-group(s) {missing} "
                             "have no 'exp_avg_sq' (optimizer state not loaded or not Adam)")
    params: List[torch.nn.Parameter] = []
    parts: List[torch.Tensor] = []
    owner_inv: List[torch.Tensor] = []
    for i, sub_group in enumerate(opt.fp16_groups):
        flat = opt.fp32_partitioned_groups_flat[i]
        st = basic.state[flat]
        param_group = basic.param_groups[opt.sub_group_to_group_id[i]]
        step = st["step"]  # a host number, or a tensor (torch Adam's): read once per sub-group, at the freeze only
        v_hat = st["exp_avg_sq"].float() / (1.0 - param_group["betas"][1]**(step.item() if torch.is_tensor(step) else
                                                                             float(step)))
        inv = torch.empty_like(v_hat)
        for p in sub_group:
            _, offset, count = opt.grad_position[opt.get_param_id(p)]
            v = v_hat.narrow(0, offset, count)
            floor = V_FLOOR * v.mean() if count else v.new_zeros(())  # on the device: nothing read back
            inv.narrow(0, offset, count).copy_(1.0 / (torch.maximum(v, floor).sqrt() + param_group["eps"]))
            params.append(p)
            parts.append(inv.narrow(0, offset, count))
        owner_inv.append(inv)
    if not precondition:
        return {}, owner_inv
    return _gather(params, parts, group, key_of, timeout_s), []


def node_rows(full: torch.Tensor, world: int, ranks_per_node: int, local_rank: int) -> torch.Tensor:
    """The rows of the owners ``k L + local_rank`` (k = 0..N-1) of a full parameter-shaped tensor: what a rank of the
    hierarchical topology compresses.

    Args:
        full: ``(n,)`` any dtype. world: W; ranks_per_node: L (W = N L); local_rank: 0 <= j < L.

    Returns:
        ``(N * ceil(n / W),)``, same dtype: owner ``kL + j``'s slice ``[(kL+j)c, (kL+j+1)c)`` of ``full`` zero-padded
        to ``W c``, for k in order (a new tensor).
    """
    c = -(-full.numel() // world)
    padded = torch.nn.functional.pad(full.reshape(-1), (0, world * c - full.numel()))
    return padded.view(world, c)[local_rank::ranks_per_node].reshape(-1).clone()


def _gather(params, parts, group, key_of, timeout_s: float) -> Dict[Hashable, torch.Tensor]:
    """Every owner's partitions of each parameter's preconditioner, concatenated, in bf16 (2 bytes per parameter)."""
    world = dist.get_world_size(group=group)
    local = torch.cat(parts) if parts else torch.empty(0)
    gathered = [torch.empty_like(local) for _ in range(world)]
    bounded = bounded_group(group, timeout_s)
    work = torch.distributed.all_gather(gathered, local, group=bounded, async_op=True)
    wait_torch_work(work, "the all-gather of the frozen preconditioner", dist.get_rank(group=group), timeout_s,
                    local.is_cuda and backend_of(bounded, "cuda") == "nccl")
    out, col = {}, 0
    for p, part in zip(params, parts):
        c = part.numel()
        out[key_of(p)] = torch.cat([g[col:col + c] for g in gathered])[:p.ds_numel].to(torch.bfloat16)
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
    if owner_inv:
        return _owners_step(optimizer, closure, decoupled, lambda p, u, l2: u * owner_inv[id(p)])
    return _owners_step(optimizer, closure, decoupled, lambda p, u, l2: u)


def _owners_step(optimizer, closure, decoupled: bool, direction: Callable, lr_scale: float = 1.0):
    """What the owners' steps share: ``p <- p (1 - lr wd) - lr_scale lr direction(p, u, l2)`` for every param with a
    gradient ``u`` (decoupled weight decay; ``l2`` is the weight decay when it is not decoupled, else 0). Returns the
    closure's loss, or None."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    for group in optimizer.param_groups:
        lr, wd = group["lr"], group.get("weight_decay", 0.0)
        for p in group["params"]:
            if p.grad is None:
                continue
            if wd and decoupled:
                p.mul_(1.0 - lr * wd)
            p.add_(direction(p, p.grad, 0.0 if decoupled else wd), alpha=-lr * lr_scale)
    return loss


def check_step_optimizer(optimizer, method: str) -> None:
    """Check that every param group of the owners' optimizer has a learning rate, which ``method``'s step takes
    (``decoupled_momentum``'s sign update, with any optimizer: its learning rate, schedule and weight decay).

    Raises:
        DGCConfigError: a param group whose ``lr`` is missing or not a number (naming the optimizer and the value).
    """
    bad = [g.get("lr") for g in optimizer.param_groups
           if isinstance(g.get("lr"), bool) or not isinstance(g.get("lr"), (int, float, torch.Tensor))]
    if bad:
        raise DGCConfigError(f"'dgc.{method}' steps with the optimizer's learning rate, but a param group of "
                             f"{type(optimizer).__name__} has no 'lr' (got {bad[0]!r})")


def check_adam_method(optimizer, method: str, fp16: bool = False, offload: bool = False) -> None:
    """Check that the owners' optimizer fits ``shared_mask`` (``method``): an Adam whose state chooses the masks.

    Raises:
        DGCConfigError: not an Adam-family optimizer (naming it), a param group without ``lr``, fp16 or optimizer
            offload (the owners' state is read beside the gradients).
    """
    name = type(optimizer).__name__
    if name not in ADAM_TYPES:
        raise DGCConfigError(f"'dgc.{method}' needs an Adam optimizer ({', '.join(ADAM_TYPES)}): its learning rate, "
                             f"weight decay and state are used; got {name}")
    check_step_optimizer(optimizer, method)
    if fp16:
        raise DGCConfigError(f"'dgc.{method}' does not support 'fp16' engines; use bf16 or fp32")
    if offload:
        raise DGCConfigError(f"'dgc.{method}' does not support 'zero_optimization.offload_optimizer' (the owners' "
                             "state is read beside the gradients)")


# torch's optimizers whose betas[0] is a first moment of the gradient; other classes count where "adam" is in their
# name (DeepSpeed's FusedAdam and DeepSpeedCPUAdam, bitsandbytes' AdamW8bit, ...)
ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax)
AFTER_INIT = (", set after initialize, e.g. by a schedule that cycles momentum: turn that off, e.g. OneCycle's "
              "'cycle_momentum': false")


def averages_gradients(basic) -> bool:
    """Whether ``basic`` keeps a first moment of its gradient by ``betas[0]``: torch's Adam family
    (:data:`ADAM_FAMILY`, subclasses too) or a class with "adam" in its name."""
    return isinstance(basic, ADAM_FAMILY) or "adam" in type(basic).__name__.lower()


def refuse_double_momentum(cfg, basic, when: str) -> None:
    """Refuse ``decoupled_momentum``'s ``update: "optimizer"`` where the optimizer's own momentum would integrate ``u``
    again: ``u`` carries DeMo's momentum (up to ``1 / (1 - decay)`` times the gradient), and SGD's momentum would make
    it about ``1 / ((1 - decay) (1 - momentum))`` times the gradient per step (10,000 at the defaults and 0.9: no
    learning rate of the stock job survives that, results/study_jobs.md); Adam's first moment (``betas[0]`` above 0,
    :func:`averages_gradients`) is scale-free but lags the momentum sum again (+12% to +26% on the Hugging Face job,
    docs/huggingface.md); with ``betas[0]`` 0 Adam steps on ``u / sqrt(v)`` (docs/methods.md, "AdamW on u").
    Nothing under ``update: "sign"`` or ``decay`` 0.

    Args:
        cfg: the ``"decoupled_momentum"`` section (:class:`~deepspeed_dgc.config.DecoupledMomentumConfig`).
        basic: the owners' basic optimizer, or a stand-in with its class name and ``param_groups``.
        when: said after the value: ``""`` at initialize, :data:`AFTER_INIT` after a step.

    Raises:
        DGCConfigError: naming the optimizer, the value and the fixes.
    """
    if cfg.update == "sign" or cfg.decay == 0:
        return
    name = type(basic).__name__
    if isinstance(basic, torch.optim.SGD):
        momenta = [g.get("momentum", 0) or 0 for g in basic.param_groups]
        if any(m > 0 for m in momenta):
            raise DGCConfigError(
                f"'dgc.decoupled_momentum.update' = \"{cfg.update}\" hands SGD the sum of the ranks' decoupled "
                f"momenta (decay {cfg.decay}: up to {1 / (1 - cfg.decay):.0f} times the gradient), and SGD's own "
                f"momentum ({max(momenta)}{when}) would integrate it again: set 'dgc.decoupled_momentum.update' to "
                "\"sign\" (DeMo's step at SGD's learning rate, schedule and weight decay), or SGD's 'momentum' to "
                "0, or 'dgc.decoupled_momentum.decay' to 0")
    elif averages_gradients(basic):
        beta1 = max(float(g.get("betas", (0.0, 0.0))[0]) for g in basic.param_groups)
        if beta1 > 0:
            raise DGCConfigError(
                f"'dgc.decoupled_momentum.update' = \"{cfg.update}\" hands {name} the sum of the ranks' decoupled "
                f"momenta (decay {cfg.decay}), and {name}'s first moment (betas[0] = {beta1}{when}) would "
                "average it again, a momentum of a momentum that trails stock's loss by 12% to 26% on the Hugging "
                "Face job (docs/huggingface.md): set the optimizer's betas[0] to 0, so that the decoupled momentum "
                "is its first moment and it keeps only its second ('optimizer.params.betas' [0.0, 0.99], or the "
                "betas of the optimizer passed to deepspeed.initialize; with the Trainer, "
                "TrainingArguments(adam_beta1=0.0, adam_beta2=0.99)), or "
                f"'dgc.decoupled_momentum.update' to \"sign\" (DeMo's step at {name}'s learning rate, schedule "
                "and weight decay), or 'dgc.decoupled_momentum.decay' to 0")


def check_method_fits(cfg, optimizer, sends_per_step: int, fp16: bool, offload: bool, autocast: bool):
    """Check that the job fits the momentum method ``cfg`` asks for, at ``deepspeed.initialize`` and in
    ``python -m deepspeed_dgc check`` (one set of rules for both).

    Args:
        cfg: the enabled ``"dgc"`` config (:class:`~deepspeed_dgc.config.DGCConfig`).
        optimizer: the owners' basic optimizer (``zero_optimizer.optimizer``), or a stand-in with its class name,
            ``param_groups`` and ``defaults`` (:mod:`deepspeed_dgc.zero3.job`).
        sends_per_step: reduce-scatters per optimizer step (1 where the window is held and sent at its end).
        fp16, offload, autocast: the engine's ``fp16``, ``zero_optimization.offload_optimizer`` and
            ``torch_autocast``.

    Returns:
        ``compressed_momentum``'s beta1 or ``momentum_correction``'s momentum (float), else None.

    Raises:
        DGCConfigError: the combination is refused (the message names the keys and the reason).
    """
    if (cfg.compressed_momentum is not None or cfg.momentum_correction) and autocast:
        raise DGCConfigError("'dgc.compressed_momentum' and 'dgc.momentum_correction' do not support "
                             "'torch_autocast' (untested with them); use 'bf16' or fp32, or 'dgc.decoupled_momentum'")
    if cfg.compressed_momentum is not None:
        return check_optimizer(optimizer, sends_per_step, fp16, offload)
    if cfg.decoupled_momentum is not None:  # any optimizer, fp16, offload
        check_step_optimizer(optimizer, "decoupled_momentum")
        refuse_double_momentum(cfg.decoupled_momentum, optimizer, "")
        return None
    if cfg.shared_mask is not None:  # no local momentum: the owners' Adam state chooses (share_masks)
        check_adam_method(optimizer, "shared_mask", fp16, offload)
    if cfg.momentum_correction:
        return check_sgd_optimizer(optimizer, sends_per_step, fp16, offload)
    return None


def choose_masks(opt, density: float, score: str, explore: float, step: int, world: int,
                 key_of: Callable[[torch.nn.Parameter], Hashable]) -> Tuple[List[Hashable], List[int], List[torch.Tensor]]:
    """This owner's shared mask of every parameter: SCAPE's owner-side choice (arXiv 2607.01678, section 3).

    In this owner's partition of each parameter (``c = ceil(n / W)`` columns, real ones first) the
    ``k = ceil(density c)`` coordinates of largest score are chosen: Adam's step size ``|exp_avg| / (sqrt(exp_avg_sq)
    + eps)`` (``score`` "update") or ``|exp_avg|``; ``floor(explore k)`` of them are instead a window of consecutive
    columns starting at ``(step floor(explore k)) mod c``, so that every column is chosen at least every
    ``ceil(c / floor(explore k))`` steps. Everything stays on the device; the sizes are host numbers.

    Args:
        opt: the ZeRO-3 optimizer, its basic optimizer an Adam with state.
        step: the applied steps so far (moves the window); world: W; key_of: a parameter's stable key.

    Returns:
        ``(keys, chunks, masks)``: per parameter in the optimizer's order (the same on every rank), its key, ``c``
        and int64 ``(k,)`` columns inside this owner's partition.

    Raises:
        DGCConfigError: a sub-group has no Adam state (``exp_avg``) yet.
    """
    basic = opt.optimizer
    keys, chunks, masks = [], [], []
    for i, sub_group in enumerate(opt.fp16_groups):
        st = basic.state.get(opt.fp32_partitioned_groups_flat[i], {})
        if "exp_avg" not in st:
            raise DGCConfigError(f"'dgc.shared_mask': sub-group {i} has no Adam state ('exp_avg') to choose masks from")
        mag = st["exp_avg"].abs()
        if score == "update":
            eps = basic.param_groups[opt.sub_group_to_group_id[i]]["eps"]
            mag = mag / (st["exp_avg_sq"].sqrt() + eps)
        for p in sub_group:
            _, offset, count = opt.grad_position[opt.get_param_id(p)]
            c = -(-p.ds_numel // world)
            k = min(c, math.ceil(density * c))
            s = mag.new_full((c, ), -1.0)  # padding columns last
            s[:count] = mag.narrow(0, offset, count)
            k_window = int(explore * k)
            if k_window:
                s[(step * k_window + torch.arange(k_window, device=s.device)) % c] = float("inf")
            keys.append(key_of(p))
            chunks.append(c)
            masks.append(torch.topk(s, k).indices)
    return keys, chunks, masks


@torch.no_grad()
def sign_step(optimizer, decoupled: bool, closure=None, lr_scale: float = 1.0):
    """DeMo's owners' step: ``p <- p (1 - lr wd) - lr_scale lr sign(u)`` for every param with a gradient (``lr`` and
    ``wd`` each param group's; ``lr_scale`` is ``decoupled_momentum.lr_scale``, 1 in DeMo).

    Peng et al., arXiv 2411.19870, Algorithm 1 (bloc97/DeMo ``DeMo.step``: sign-SGD on the decoded sum, decoupled
    weight decay). ``p.grad`` holds ``u``, the sum over ranks of their decoded chunked DCT top-k (any scale: only
    its sign is used, so DeepSpeed's gradient clipping does not change the step). With L2 weight decay (Adam
    without ``decoupled_weight_decay``) ``wd p`` is added to ``u`` before the sign. The optimizer's state holds only
    the count of these steps, ``state[p]["step"]`` (a float32 scalar tensor, as torch's Adam keeps it), so DeepSpeed's
    step count answers; Adam's moments are never written. ``p.grad`` is overwritten with the direction.
    Returns the closure's loss, or None.
    """
    # in place: the gradient is dead after the step (ZeRO-3 frees it)
    loss = _owners_step(optimizer, closure, decoupled, lambda p, u, l2: (u.add_(p, alpha=l2) if l2 else u).sign_(),
                        lr_scale)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                st = optimizer.state[p]
                st["step"] = st.get("step", torch.tensor(0.0)) + 1
    return loss


def check_sgd_optimizer(optimizer, sends_per_step: int, fp16: bool = False, offload: bool = False) -> float:
    """Check that the owners' optimizer is momentum SGD and the job fits ``momentum_correction``; returns the momentum.

    Args:
        optimizer: the owners' basic optimizer (``zero_optimizer.optimizer``).
        sends_per_step: reduce-scatters per optimizer step: 1, or with ``accumulate_locally: false`` the engine's
            ``gradient_accumulation_steps``.
        fp16: whether the engine runs fp16 with loss scaling.
        offload: whether the optimizer is offloaded.

    Raises:
        DGCConfigError: another optimizer (naming it), momentum 0, Nesterov, dampening, ``maximize``,
            param groups with different momenta, more than one send per step, fp16 or optimizer offload; the
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
    _one_send_per_step("momentum_correction", sends_per_step)
    if fp16:
        raise DGCConfigError("'dgc.momentum_correction' does not support 'fp16' engines; use bf16 or fp32")
    if offload:
        raise DGCConfigError("'dgc.momentum_correction' does not support 'zero_optimization.offload_optimizer'")
    return next(iter(momenta))


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
