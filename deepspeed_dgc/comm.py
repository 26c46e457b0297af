"""Communicator: moves opaque byte payloads between the ranks of a process group.

GRACE's Communicator role: it knows nothing of what the bytes mean. This one runs over
``deepspeed.comm`` (NCCL on GPU, gloo on CPU). Payloads are uint8, so dtypes gloo rejects
(float8) travel as byte views.
"""

from typing import List

import torch
from deepspeed import comm as dist

SIZE_BYTES = 8  # one int64 size per peer in the size exchange


class TorchCommunicator:
    """Uneven all-to-all of uint8 payloads over one ``deepspeed.comm`` process group.

    Every byte sent to another rank is counted in :attr:`wire_bytes` (payloads plus the
    size exchange); what a rank keeps for itself is not.

    Args:
        group: the process group (None: the world).
    """

    def __init__(self, group=None):
        self.group = group
        self.world_size = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.wire_bytes = 0

    def all_to_all(self, payloads: List[torch.Tensor]) -> List[torch.Tensor]:
        """Send ``payloads[d]`` to rank d of the group; return what each rank sent to this one.

        Sizes are exchanged first with a fixed-size all-to-all (one int64 per peer), then the
        payloads with one uneven ``all_to_all_single``. Every rank of the group must call this
        the same number of times in the same order.

        Args:
            payloads: ``world_size`` 1-D uint8 tensors on the communication device (may be empty).

        Returns:
            ``world_size`` 1-D uint8 tensors; entry s is what rank s sent here (views of one buffer).

        Raises:
            ValueError: wrong number of payloads or a payload that is not 1-D uint8.
        """
        if len(payloads) != self.world_size:
            raise ValueError(f"all_to_all: expected {self.world_size} payloads, got {len(payloads)}")
        for p in payloads:
            if p.dtype != torch.uint8 or p.dim() != 1:
                raise ValueError(f"all_to_all: payloads must be 1-D uint8, got {p.dtype} of shape {tuple(p.shape)}")
        device = payloads[0].device
        send_sizes = [p.numel() for p in payloads]
        send_sizes_t = torch.tensor(send_sizes, dtype=torch.int64, device=device)
        recv_sizes_t = torch.empty_like(send_sizes_t)
        dist.all_to_all_single(recv_sizes_t, send_sizes_t, group=self.group)
        recv_sizes = recv_sizes_t.tolist()
        send = torch.cat(payloads)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
        dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=self.group)
        self.wire_bytes += sum(s for d, s in enumerate(send_sizes) if d != self.rank)
        self.wire_bytes += SIZE_BYTES * (self.world_size - 1)
        return list(torch.split(recv, recv_sizes))
