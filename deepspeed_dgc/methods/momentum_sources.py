"""Methods whose ranks send a local momentum in place of the gradient, through the top-k codec of their layout.

The momentum states (:mod:`deepspeed_dgc.memory.momentum`) update per tensor what is sent (1-bit Adam's momentum, DGC's
velocity); this class hands it to :class:`~deepspeed_dgc.methods.topk.TopKExact` or :class:`~deepspeed_dgc.methods.
topk.TopKFixed` (error feedback on the momentum) and lets the state see the exchange (momentum factor masking).
"""

from typing import List, Optional

import torch

from .base import Bucket, Exchange, GradientMethod, Reduced
from .topk import TopKExact, TopKFixed


class MomentumSourced(GradientMethod):
    """A momentum state's values through the top-k codec (see the module docstring)."""

    resolves_density = True

    def __init__(self, reducer):
        super().__init__(reducer)
        self._codec = None

    def codec(self, device_type: str):
        cls = TopKFixed if self.reducer.layout(device_type) == "fixed" else TopKExact
        if type(self._codec) is not cls:
            self._codec = cls(self.reducer)
        return self._codec

    def fixed_payloads(self, bucket):
        return self.codec(bucket.device.type).fixed_payloads(bucket)

    def layout(self, bucket, owners):
        return self.codec(bucket.device.type).layout(bucket, owners)

    def _values(self, bucket: Bucket, A: Optional[torch.Tensor], R: int) -> List[torch.Tensor]:
        """What the momentum is updated with: the gradients as given, or the node-level rows of each tensor (R c_i,
        flat) of ``A``."""
        if A is None:
            return bucket.grads
        L = self.layout(bucket, tuple(range(R)))
        return [L.flat_of(A, i, R * c) for i, c in enumerate(bucket.chunks)]

    def reduce(self, bucket: Bucket, exchange: Exchange, A: Optional[torch.Tensor] = None) -> Reduced:
        state, R = self.reducer.momentum, exchange.rows
        momenta = state.sources(bucket.keys, self._values(bucket, A, R), bucket.divisor)
        codec = self.codec(bucket.device.type)
        if momenta is None:  # the gradients are sent (compressed momentum before the freeze)
            if bucket.density_pending:
                self.reducer.resolve_density(bucket, self._values(bucket, A, R), bucket.divisor, exchange.comm)
            return codec.reduce(bucket, exchange, A=A)
        if bucket.density_pending:  # density "auto" on the momenta
            self.reducer.resolve_density(bucket, momenta, 1.0, exchange.comm)

        def exchanged(before, after):
            state.after_exchange(bucket.keys, momenta, before, after, bucket.sparse)

        return codec.reduce(bucket, exchange, sources=momenta,
                            residual_numels=None if A is None else [R * c for c in bucket.chunks],
                            on_exchanged=exchanged)

    def whole(self, bucket: Bucket, A: torch.Tensor, L) -> Reduced:
        momenta = self.reducer.momentum.sources(bucket.keys, self._values(bucket, A.clone(), 1), bucket.divisor)
        if momenta is None:
            return super().whole(bucket, A, L)
        out = torch.zeros(L.columns, device=A.device)
        L.gather(momenta, out.view(1, -1), by_row=True)
        return Reduced(out, L.row_slices(out, 0), True, sum(L.real[0]))
