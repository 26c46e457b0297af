"""The hierarchical topology around any method: dense inside a node, the method between nodes.

N nodes of L ranks (ZeRO++ qgZ's two hops, Wang et al., arXiv 2306.10209, section 4.2): every rank first sends each
node mate, in the communication dtype, the rows of the bucket's owner matrix (of ``g / W``) that the mate's owners
``k L + l`` hold; the mate sums the L rows it receives (one reduction over them: the same bits run to run on a GPU,
where an ``index_add_`` adds in any order) into the node-level sums of its N owners.
The wrapped method then reduces those N rows between the ranks of the same local rank on every node. Its residuals or
momenta are of the node-level sums: 1/L of the flat topology's size.
"""

import copy

import torch

from ..codec import fixed
from .base import Bucket, Exchange, GradientMethod, Reduced


class Hierarchical(GradientMethod):
    """Wraps a method (see the module docstring); the reducer dispatches to it as to any method."""

    def __init__(self, reducer, inner: GradientMethod):
        super().__init__(reducer)
        self.inner = inner
        self.name = f"hierarchical({inner.name})"

    def fixed_payloads(self, bucket):
        return self.inner.fixed_payloads(bucket)

    def layout(self, bucket, owners):
        return self.inner.layout(bucket, owners)

    def partitions_hold(self, state):
        return self.inner.partitions_hold(state)

    def install(self, engine, opt, state) -> None:
        self.inner.install(engine, opt, state)

    def after_step(self, opt, state, applied: bool) -> None:
        self.inner.after_step(opt, state, applied)

    def before_load(self, opt, state) -> None:
        self.inner.before_load(opt, state)

    def after_load(self, opt, state) -> None:
        self.inner.after_load(opt, state)

    def reduce_all(self, bucket: Bucket, comms) -> Reduced:
        r = self.reducer
        L, N, W = comms.ranks_per_node, comms.n_nodes, comms.world_size
        owners = tuple(k * L + comms.local_rank for k in range(N))
        full = self.inner.layout(bucket, tuple(range(W)))
        C = full.columns
        A = fixed.owner_matrix(W, C, bucket.device)
        full.gather(bucket.srcs, A)
        A.div_(W)  # in fp32, then rounded to the communication dtype as stock's pre-divided reduce-scatter
        send = A.view(N, L, C).transpose(0, 1).to(bucket.comm_dtype).contiguous().view(L, -1).view(torch.uint8)
        del A
        if self.inner.fixed_payloads(bucket):
            r.check_first_bucket(comms.intra, bucket.fingerprint)
            received = comms.intra.all_to_all_fixed(send)
        else:
            received = torch.stack(comms.intra.all_to_all(list(send)))
        del send
        node = self.inner.layout(bucket, owners)
        node_sum = fixed.owner_matrix(N, C, bucket.device)
        torch.sum(received.view(bucket.comm_dtype).view(L, N * C).float(), dim=0, out=node_sum.view(-1))
        inner = copy.copy(bucket)  # the node-level sums are divided by the loss scale only
        inner.divisor = bucket.loss_scale
        if bucket.density_pending and not self.inner.resolves_density:
            rows = [node_sum[:, node.cols[i]:node.cols[i] + c].reshape(-1) for i, c in enumerate(bucket.chunks)]
            r.resolve_density(inner, rows, inner.divisor, comms.inter)
        if N == 1 and self.inner.whole_on_one_node:  # nothing crosses a node: the node's sum sent whole
            return self.inner.whole(inner, node_sum, node)
        return self.inner.reduce(inner, Exchange(comms.inter if N > 1 else None, comms.node, owners), A=node_sum)
