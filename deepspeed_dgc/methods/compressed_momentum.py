"""1-bit Adam's compressed momentum (Tang et al., ICML 2021, sections 3.1-3.3) on ZeRO-3's partitions.

Before ``freeze_step`` the gradients are sent (top-level codec) and Adam runs as stock while every rank keeps its local
momentum; at the freeze Adam's second moment is frozen on the owners, which then step with the frozen-variance update
(:func:`~deepspeed_dgc.zero3.optimizer.frozen_variance_step`) on the sum of the ranks' momenta, sent with this
section's codec (:class:`~deepspeed_dgc.memory.momentum.CompressedMomentum`).
"""

import types

from deepspeed.utils import logger

from ..zero3 import optimizer as owners
from ..zero3.swap import replace, restore
from .base import register
from .momentum_sources import MomentumSourced


@register("compressed_momentum", lambda cfg, device: cfg.compressed_momentum is not None, order=10)
class CompressedMomentumMethod(MomentumSourced):
    """See the module docstring."""

    def partitions_hold(self, state):
        """The averaged gradient until the freeze; after it, the sum of the ranks' momenta."""
        if not state.momentum.frozen:
            return None
        return ("the sum over ranks of their local Adam momenta (sent since Adam's second moment was frozen), not "
                "the averaged gradient")

    def after_step(self, opt, state, applied: bool) -> None:
        """The freeze, once ``freeze_step`` steps are done (collective with ``precondition``)."""
        momentum = state.momentum
        if momentum.freeze_due():
            state.start_momentum_phase()
            freeze(opt, state)
            if state.global_rank == 0:
                logger.info("deepspeed_dgc: Adam's second moment frozen after step %d; compressing the momentum (%s) "
                            "from now on", momentum.steps_done, momentum.cfg.quantization)

    def after_load(self, opt, state) -> None:
        """The freeze again where the loaded state is past ``freeze_step`` (its residuals as loaded)."""
        if state.momentum.freeze_due():
            freeze(opt, state)

    def before_load(self, opt, state) -> None:
        """Before a checkpoint is loaded: Adam's own step back (the loaded state decides afresh whether it is frozen)."""
        if state.momentum.frozen:
            unfreeze(opt, state)


def freeze(opt, state) -> None:
    """Freeze Adam's second moment on the owners and switch their step to the frozen-variance update
    (:func:`~deepspeed_dgc.zero3.optimizer.frozen_variance_step`); gradient clipping goes off (after the freeze the
    "gradient" is the update). Collective over the data-parallel group with ``precondition``."""
    momentum = state.momentum
    by_key, owner_inv = owners.frozen_preconditioner(opt, momentum.cfg.precondition, opt.dp_process_group,
                                                        state.key_of, state.cfg.timeout_s)
    comms = state.reducer.comms_for(opt.dp_process_group)
    if comms.hierarchical:  # the momenta are of the node-level rows this rank compresses: keep those rows only
        by_key = {k: owners.node_rows(v, comms.world_size, comms.ranks_per_node, comms.local_rank)
                  for k, v in by_key.items()}
    momentum.set_frozen(by_key, owner_inv)
    inv_by_flat = {id(opt.fp32_partitioned_groups_flat[i]): inv for i, inv in enumerate(owner_inv)}
    decoupled = owners.decoupled_weight_decay(opt.optimizer)

    def step(basic, closure=None):
        return owners.frozen_variance_step(basic, inv_by_flat, decoupled, closure)

    replace(opt.optimizer, "step", types.MethodType(step, opt.optimizer))  # bound, as torch's
    replace(opt, "clip_grad", 0.0)


def unfreeze(opt, state) -> None:
    """Undo :func:`freeze` (before a checkpoint is loaded): Adam's own step and the gradient clipping come back."""
    restore(opt.optimizer, "step")
    restore(opt, "clip_grad")
    state.momentum.unfreeze()


