"""The quantized parameter all-gather's view of a shard: one segment per parameter, padding counted per rank, read
from DeepSpeed's calling function (the full gather in real processes: tests/distributed/test_allgather.py)."""

import types

import torch
from deepspeed.runtime.zero import partition_parameters

from deepspeed_dgc.zero3.allgather import check_layout_seam, shard_layout


def _param(numel, shard, secondary=None):
    ds_tensor = types.SimpleNamespace(ds_numel=shard)
    p = types.SimpleNamespace(ds_numel=numel, ds_tensor=ds_tensor, ds_secondary_tensor=secondary)
    return p


def test_deepspeed_callers_have_the_locals_read():
    assert check_layout_seam(partition_parameters.Init._convert_to_deepspeed_param) is None

    def other():
        def _all_gather_dtype(x):
            return x
        return _all_gather_dtype

    assert check_layout_seam(other) == "the locals ['params', 'use_secondary_tensor', 'rank_in_group'] of _all_gather_dtype"


def test_coalesced_and_sequential_layouts():
    """A coalesced bucket of a 101-element and a 2424-element parameter on 2 ranks: shards of 51 and 1212, rank 1
    holds 50 and 1212 real elements. The sequential caller gathers its loop's parameter, not the whole list."""
    a, b = _param(101, 51), _param(2424, 1212)
    coalesced = shard_layout({"params": [a, b], "use_secondary_tensor": False, "rank_in_group": 1}, 1263, 0)
    assert coalesced.segments == [51, 1212] and coalesced.real == [50, 1212]
    assert shard_layout({"params": [a, b], "param": a, "use_secondary_tensor": False}, 51, 1).real == [50]
    assert shard_layout({"params": [a, b], "use_secondary_tensor": False, "rank_in_group": 0}, 1000, 0) is None
    assert shard_layout({"x": 1}, 51, 0) is None
    sec = _param(101, 51, secondary=torch.zeros(26))  # hpZ secondary shards are zero-padded by DeepSpeed itself
    assert shard_layout({"params": [sec], "use_secondary_tensor": True, "rank_in_group": 1}, 26, 1).real == [26]
