"""Which ranks share a node, and the communicators of one partition group (flat or two hops).

A node is a set of ranks joined by a fast link (NVLink, shared memory); nodes are joined by
the slow network. Node k holds global ranks ``k*L ... (k+1)*L - 1`` for ``L`` ranks per node,
the layout the deepspeed launcher and ``mpirun``'s default by-slot mapping give.
"""

import os
import socket
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
from deepspeed import comm as dist

from .communicators import (MPICommunicator, Communicator, bounded_group, group_global_ranks, group_timeout_s,
                             make_communicator)
from ..config import DGCConfig, DGCConfigError

# launcher variables holding the number of ranks on this node, in the order they are trusted
LOCAL_SIZE_VARS = ("LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")


def node_of(global_rank: int, ranks_per_node: int) -> int:
    """The node of a global rank: ranks ``k*L ... (k+1)*L - 1`` form node k (L ranks per node)."""
    return global_rank // ranks_per_node


def resolve_ranks_per_node(cfg: DGCConfig) -> Tuple[int, str]:
    """Ranks per node and where that number came from.

    ``dgc.ranks_per_node`` when set; else the first launcher variable of :data:`LOCAL_SIZE_VARS`
    that is set (the deepspeed launcher sets ``LOCAL_SIZE``, Open MPI's ``mpirun``
    ``OMPI_COMM_WORLD_LOCAL_SIZE``); else the number of ranks whose host name is this rank's
    (an all-gather over the world, so every rank must call this).

    Returns:
        ``(ranks_per_node, source)``, e.g. ``(2, "LOCAL_SIZE")``.
    """
    if cfg.ranks_per_node is not None:
        return cfg.ranks_per_node, "dgc.ranks_per_node"
    for var in LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value), var
    hosts = [None] * dist.get_world_size()
    torch.distributed.all_gather_object(hosts, socket.gethostname())
    return hosts.count(socket.gethostname()), "host names"


@dataclass
class ReduceComms:
    """The communicators one reduce-scatter over a partition group uses.

    Attributes:
        world_size: ranks W in the group; rank: this rank's index in it.
        ranks_per_node: L; n_nodes: N = W / L (hierarchical) or the number of distinct nodes.
        dest_nodes: node of each group rank (classifies flat bytes as intra- or inter-node).
        flat: communicator over the whole group (flat topology), else None.
        intra: communicator over this rank's node (L ranks, index = local rank), hierarchical only.
        inter: communicator over the ranks with this local rank on every node (N ranks, index =
            node), hierarchical only.
    """
    world_size: int
    rank: int
    ranks_per_node: int
    dest_nodes: List[int]
    flat: Optional[Communicator] = None
    intra: Optional[Communicator] = None
    inter: Optional[Communicator] = None
    n_nodes: int = field(init=False)

    def __post_init__(self):
        self.n_nodes = len(set(self.dest_nodes))

    @property
    def hierarchical(self) -> bool:
        return self.intra is not None

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    def split_by_node(self, sent: Sequence[int]) -> Tuple[int, int]:
        """``(intra-node, inter-node)`` bytes of a flat exchange that sent ``sent[d]`` bytes to group rank ``d``."""
        intra = sum(b for d, b in enumerate(sent) if self.dest_nodes[d] == self.dest_nodes[self.rank])
        return intra, sum(sent) - intra


def check_whole_nodes(world_size: int, ranks_per_node: int) -> None:
    """The hierarchical topology's rule on the world: whole nodes of ``ranks_per_node`` ranks.

    Raises:
        DGCConfigError: ``world_size`` is not a multiple of ``ranks_per_node``.
    """
    if world_size % ranks_per_node:
        raise DGCConfigError(f"'dgc.topology' = \"hierarchical\": the world size {world_size} is not a multiple of "
                             f"{ranks_per_node} ranks per node ('dgc.ranks_per_node' or the launcher's LOCAL_SIZE); "
                             "set 'dgc.ranks_per_node' to a divisor of the world size")


def check_hpz_node(hpz_partition_size: int, ranks_per_node: int, source: str) -> None:
    """The hierarchical topology's node against hpZ's (ZeRO++'s secondary partition, one per node): the same size.

    Args:
        hpz_partition_size: ``zero_optimization.zero_hpz_partition_size`` (1: hpZ off); ranks_per_node: the
        topology's node; source: where ``ranks_per_node`` came from, as the message names it.

    Raises:
        DGCConfigError: hpZ is on with another node size.
    """
    if hpz_partition_size > 1 and hpz_partition_size != ranks_per_node:
        raise DGCConfigError(f"'zero_optimization.zero_hpz_partition_size' = {hpz_partition_size} but 'dgc.topology' = "
                             f"\"hierarchical\" uses {ranks_per_node} ranks per node (from {source}): both must "
                             f"describe the same node; set 'dgc.ranks_per_node' = {hpz_partition_size} or the hpZ size "
                             f"to {ranks_per_node}")


def build_reduce_comms(cfg: DGCConfig, group, ranks_per_node: int) -> ReduceComms:
    """Create the communicators of ``group`` for ``cfg.topology`` and ``cfg.comm_backend``.

    Collective: every rank of the world must call it with the same arguments in the same order
    (torch's ``new_group`` is collective over the world).

    Raises:
        DGCConfigError: ``"hierarchical"`` with a group that is not the whole world, or a world size
            that is not a multiple of ``ranks_per_node``.
    """
    world_size = dist.get_world_size(group=group)
    rank = dist.get_rank(group=group)
    global_ranks = group_global_ranks(group)
    L = ranks_per_node
    dest_nodes = [node_of(g, L) for g in global_ranks]
    timeout_s = cfg.timeout_s if cfg.timeout_s is not None else group_timeout_s()
    if cfg.topology == "flat":
        return ReduceComms(world_size, rank, L, dest_nodes, flat=make_communicator(cfg.comm_backend, group, timeout_s))
    full_world = dist.get_world_size()
    if global_ranks != list(range(full_world)):
        raise DGCConfigError(f"'dgc.topology' = \"hierarchical\" needs data parallelism over the whole world; the gradient "
                             f"partition group holds {world_size} of {full_world} ranks (model, sequence or expert "
                             "parallelism): use \"flat\"")
    check_whole_nodes(full_world, L)
    N = full_world // L
    node, local = rank // L, rank % L
    node_ranks = [[k * L + j for j in range(L)] for k in range(N)]
    peer_ranks = [[k * L + j for k in range(N)] for j in range(L)]
    if cfg.comm_backend == "torch":
        # new_group is collective over the whole world: every rank creates every group, in order
        node_groups = [bounded_group(ranks, timeout_s) for ranks in node_ranks]
        peer_groups = [bounded_group(ranks, timeout_s) for ranks in peer_ranks]
        intra = make_communicator("torch", node_groups[node], timeout_s)
        inter = make_communicator("torch", peer_groups[local], timeout_s)
    else:
        intra = MPICommunicator(node_ranks[node], local, timeout_s)
        inter = MPICommunicator(peer_ranks[local], node, timeout_s)
    return ReduceComms(world_size, rank, L, dest_nodes, intra=intra, inter=inter)
