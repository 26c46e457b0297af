"""DGC's momentum correction for momentum SGD (Lin et al., ICLR 2018, sections 3.1-3.3): every rank sends its velocity
through the top-k codec with error feedback (:class:`~deepspeed_dgc.memory.momentum.MomentumCorrection`: local
gradient clipping, momentum factor masking), and the owners step without momentum
(:func:`~deepspeed_dgc.zero3.optimizer.dgc_sgd_step`)."""

import types

from deepspeed.utils import logger

from ..zero3 import optimizer as owners
from ..zero3.swap import replace
from .base import register
from .momentum_sources import MomentumSourced


@register("momentum_correction", lambda cfg, device: cfg.momentum_correction, order=5)
class MomentumCorrectionMethod(MomentumSourced):
    """See the module docstring."""

    def partitions_hold(self, state) -> str:
        return ("the sum over ranks of their momentum-corrected velocities as sent (DGC's update, the momentum "
                "applied by the senders), not the averaged gradient")

    def install(self, engine, opt, state) -> None:
        """The owners' SGD step without momentum (a bound method, as torch's own: LR schedulers wrap
        ``optimizer.step.__func__``); DeepSpeed's gradient clipping off (it would clip the summed velocity)."""
        replace(opt.optimizer, "step", types.MethodType(owners.dgc_sgd_step, opt.optimizer))
        if opt.clip_grad and engine.global_rank == 0:
            logger.warning("deepspeed_dgc: 'gradient_clipping' = %s is switched off under 'dgc.momentum_correction' "
                           "(it would clip the summed velocity); DGC clips each rank's gradient instead: "
                           "'dgc.local_clip_norm' (now %s)", opt.clip_grad, self.cfg.local_clip_norm)
        replace(opt, "clip_grad", 0.0)
