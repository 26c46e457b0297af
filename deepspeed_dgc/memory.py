"""Memory: error-feedback residuals keyed by parameter, with staged commit and rollback.

GRACE's Memory role (Xu et al., ICDCS 2021). Error feedback (Seide et al., Interspeech 2014;
Lin et al., ICLR 2018, section 2) adds what a rank did not send last time to what it sends
now, so nothing is lost, only delayed. ZeRO-3 reduces on every micro-step and skips steps
whose gradients overflowed, so updates are staged for the whole accumulation window and
committed only after a step that was applied; a skipped step leaves the residuals as they were.
Residuals are kept unscaled (divided by the fp16 loss scale) so a loss-scale change between
steps does not rescale them by mistake.
"""

from typing import Dict, Optional

import torch


class ErrorFeedback:
    """Per-parameter residuals (fp32, the full unpartitioned gradient shape, flattened).

    Keys are ``param.ds_id`` (stable across steps and ranks). Memory: 4 bytes per element of
    every compressed parameter on every rank while committed, plus up to the same again for
    the staged copy during a backward pass.
    """

    def __init__(self):
        self.committed: Dict[int, torch.Tensor] = {}
        self.staged: Dict[int, torch.Tensor] = {}

    def get(self, key: int) -> Optional[torch.Tensor]:
        """The latest residual of ``key`` (staged in this window if any, else committed), unscaled.

        Returns:
            fp32 tensor of shape ``(numel,)`` or None when the parameter has no residual yet.
        """
        r = self.staged.get(key)
        return self.committed.get(key) if r is None else r

    def stage(self, key: int, residual: torch.Tensor) -> None:
        """Record ``residual`` (fp32, unscaled, shape ``(numel,)``) for commit after the step."""
        self.staged[key] = residual

    def commit(self) -> None:
        """The step was applied: staged residuals become the committed ones."""
        self.committed.update(self.staged)
        self.staged = {}

    def rollback(self) -> None:
        """The step was skipped (overflow): forget this window's residual updates."""
        self.staged = {}

    def residual_norm(self) -> float:
        """L2 norm over all committed residuals (unscaled gradient units); one pass over them."""
        if not self.committed:
            return 0.0
        sq = sum(float(torch.dot(r, r)) for r in self.committed.values())
        return sq**0.5

    def state_bytes(self) -> int:
        """Bytes held between steps by committed residuals."""
        return sum(r.numel() * r.element_size() for r in self.committed.values())
