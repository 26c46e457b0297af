"""DeMo's decoupled momentum: each rank's own momentum, sent as a chunked DCT top-k (:mod:`~deepspeed_dgc.codec.dct`).

Peng, Quesnelle and Kingma, "DeMo: Decoupled Momentum Optimization", arXiv 2411.19870, section 3, Algorithm 1. Every
rank keeps ``delta = decay delta + g / W`` (one block per bucket, :class:`~deepspeed_dgc.memory.momentum.
DecoupledMomentum`'s store), sends the top-k DCT coefficients of each chunk of it and keeps what it did not send (the
subtraction is the error feedback); the owners step with the sum (sign or Adam, :func:`~deepspeed_dgc.zero3.optimizer.
sign_step`). A bucket is one owner matrix: one transform, one selection, one all-to-all, nothing read back.
"""

import types
from typing import Optional

import torch

from ..codec import dct, fixed, wire
from ..codec.layout import layout_for
from ..zero3 import optimizer as owners
from ..zero3.swap import replace
from .base import Bucket, Exchange, GradientMethod, Reduced, register


@register("decoupled_momentum", lambda cfg, device: cfg.decoupled_momentum is not None, order=10)
class DecoupledMomentumMethod(GradientMethod):
    """See the module docstring; ``reducer.momentum`` is its :class:`~deepspeed_dgc.memory.momentum.
    DecoupledMomentum` state."""

    whole_on_one_node = False  # DeMo's step is the extraction's, also where nothing crosses a node

    def plan(self, bucket: Bucket) -> dct.ChunkPlan:
        cfg = self.reducer.momentum.cfg
        return dct.ChunkPlan(tuple(bucket.chunks), cfg.chunk, cfg.topk, cfg.transform, cfg.quantization, cfg.group_size)

    def layout(self, bucket, owners_):
        return layout_for(bucket.numels, bucket.world, owners_, self.reducer.momentum.cfg.chunk)

    def _momentum_matrix(self, bucket: Bucket, L, rows: int, A: Optional[torch.Tensor] = None):
        """``delta = decay delta + g / W`` as the owner matrix ``(rows, C)`` of ``L`` (from ``bucket.grads`` where
        ``A`` is None, else from the node-level sums ``A``), and the momenta's lengths."""
        if A is None:
            A = fixed.owner_matrix(rows, L.columns, bucket.device)
            L.gather(bucket.grads, A)  # the gradients as given (not rounded to the communication dtype)
            res_numels = list(bucket.numels)
        else:
            res_numels = [rows * c for c in bucket.chunks]
        if bucket.divisor != 1:
            A.div_(bucket.divisor)
        state = self.reducer.momentum
        state.store.add_block(bucket.keys, res_numels, L, A, bucket.workspace, scale=state.cfg.decay)
        return A, res_numels

    def reduce(self, bucket: Bucket, exchange: Exchange, A: Optional[torch.Tensor] = None) -> Reduced:
        r, state = self.reducer, self.reducer.momentum
        plan, L = self.plan(bucket), self.layout(bucket, exchange.owners)
        ws = bucket.workspace
        A, res_numels = self._momentum_matrix(bucket, L, exchange.rows, A)
        fingerprint = wire.fingerprint([bucket.fingerprint, "decoupled", plan.chunk, plan.topk, plan.transform,
                                        plan.value_format, plan.group_size])
        payloads, kept = dct.encode(A, L, plan, fingerprint, ws)
        if not state.store.stage_block(bucket.keys, res_numels, L, A, ws):
            ws.add(A.view(-1).view(torch.uint8))
        if exchange.comm is None:  # one row: decoded here, nothing sent
            received = payloads
        else:
            r.check_first_bucket(exchange.comm, fingerprint)
            received = exchange.comm.all_to_all_fixed(payloads)
        out, bad = dct.decode_sum(received, L, plan, fingerprint, ws)
        if exchange.comm is not None:
            r.note_bad_senders(exchange.comm, bad)
        return Reduced(out, L.row_slices(out, exchange.row), True, kept)

    def send_by_stock(self, grads, keys, comms, comm_dtype, loss_scale) -> None:
        """``policy: "auto"``, a bucket stock's reduce-scatter sends: this rank's DeMo extraction of it, densely.

        The same steps as :meth:`reduce` on the flat topology up to the exchange (``delta = decay delta + g / W``, each
        chunk's top-k DCT coefficients quantized as they would be sent, what was not sent staged as the momentum), then
        the extraction ``q = IDCT(deq(top-k))`` itself is written over ``grads`` times ``W * loss_scale`` (stock's
        reduce-scatter divides by W and the optimizer by the loss scale), in the gradients' dtype. The owners then
        receive ``u = sum_r q_r``, the sum the compressed exchange would have decoded (to the rounding of stock's
        dtype), and take the same step. (The hierarchical topology is refused with ``policy: "auto"`` at initialize:
        its momentum is of node-level sums, which stock never forms.)
        """
        bucket = self.reducer.enter(grads, keys, comms, comm_dtype, loss_scale, consume=False)
        plan, L = self.plan(bucket), self.layout(bucket, tuple(range(bucket.world)))
        A, numels = self._momentum_matrix(bucket, L, bucket.world)
        extraction = A.clone()
        dct.encode(A, L, plan, bucket.fingerprint, bucket.workspace)  # A: what is not sent
        extraction.sub_(A).mul_(bucket.divisor)
        self.reducer.momentum.store.stage_block(bucket.keys, numels, L, A, bucket.workspace)
        L.scatter(extraction, bucket.grads)

    def after_step(self, opt, state, applied: bool) -> None:
        """``update: "optimizer"``: SGD's momentum or Adam's ``betas[0]`` may have been turned on since initialize (a
        momentum-cycling schedule): refused as at initialize (:func:`~deepspeed_dgc.zero3.optimizer.
        refuse_double_momentum`), after the first step that had it."""
        owners.refuse_double_momentum(self.reducer.momentum.cfg, opt.optimizer, owners.AFTER_INIT)

    def partitions_hold(self, state) -> str:
        return ("u, the sum over ranks of their decoded DCT top-k momenta (DeMo's update; the ranks never send "
                "gradients, so no averaged gradient is formed)")

    def install(self, engine, opt, state) -> None:
        """``update: "sign"``: the owners step with DeMo's sign update at the optimizer's learning rate (times
        ``lr_scale``);
        ``update: "optimizer"``: the optimizer's own step on ``u`` (an optimizer whose momentum would integrate ``u``
        again was refused before: :func:`~deepspeed_dgc.zero3.optimizer.refuse_double_momentum`)."""
        cfg = self.reducer.momentum.cfg
        if cfg.update == "sign":
            decoupled = owners.decoupled_weight_decay(opt.optimizer)
            replace(opt.optimizer, "step", types.MethodType(lambda basic, closure=None: owners.sign_step(
                basic, decoupled, closure, cfg.lr_scale), opt.optimizer))
