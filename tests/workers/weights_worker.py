"""Worker: ZeRO-3 with the quantized parameter all-gather; record the weights forward actually saw.

Usage: weights_worker.py --format FMT --out DIR [--hpz N] [--sequential] [--node-size L] [--scale-l1-weight X]
(--scale-l1-weight: l1.weight X times larger than l1.bias, gathered together; --sequential: one
gather per parameter; --node-size L > 0: hierarchical gradient topology with L ranks per node, which also
labels parameter bytes as intra- or inter-node). Parameters are not persistent and neither prefetched
nor reused, so every step gathers each weight in forward and again in backward. Per step it saves
the exact full fp32 parameters before the step, the gathered weights each module saw in forward,
whether the stored shards changed during forward/backward, whether they equal the fp32 master
partition after the step, and the telemetry of the step.
"""

import argparse
import copy
import sys

import torch
import deepspeed
from deepspeed.utils import safe_get_full_fp32_param, safe_get_local_fp32_param

import deepspeed_dgc
from common import finish, init
from scenarios.model import BASE, Net, batches

STEPS = 3


def real_numel(p, rank):
    """Elements of this rank's shard that are real (the rest is padding)."""
    size = p.ds_tensor.numel()
    return max(0, min(p.ds_numel - rank * size, size))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hpz", type=int, default=1)
    ap.add_argument("--sequential", action="store_true")
    ap.add_argument("--node-size", type=int, default=0)
    ap.add_argument("--scale-l1-weight", type=float, default=1.0, help="l1.weight times this at init (l1.bias as is)")
    args = ap.parse_args(argv)
    fmt, out_dir, hpz, sequential, node_size = args.format, args.out, args.hpz, args.sequential, args.node_size
    rank = init()
    cfg = copy.deepcopy(BASE)
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0,
                                    stage3_max_reuse_distance=0, zero_hpz_partition_size=hpz,
                                    stage3_allgather_sequential=bool(sequential))
    cfg["dgc"] = {"enabled": True, "density": 1.0, "quantization": "int4", "weights": {"quantization": fmt}}
    if node_size:
        cfg["dgc"].update(topology="hierarchical", ranks_per_node=node_size)
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.l1.weight.mul_(args.scale_l1_weight)
    seen = {}

    def capture(module, _inputs):
        seen[module._name] = [p.data.detach().clone().reshape(-1) for p in module.parameters(recurse=False)]

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for name, module in engine.module.named_children():  # after DeepSpeed's own gather hooks
        module._name = name
        module.register_forward_pre_hook(capture)
    params = list(engine.module.parameters())
    record = []
    for (x, y), in batches(rank, STEPS, 1, torch.float32):
        exact = [safe_get_full_fp32_param(p).reshape(-1).clone() for p in params]
        shards_before = [p.ds_tensor.clone() for p in params]
        seen.clear()
        loss = engine(x, y)
        engine.backward(loss)
        # bit for bit, padding included: the padding is uninitialized memory, which may hold NaN (never torch.equal)
        shards_unchanged = all(torch.equal(a.view(torch.uint8), p.ds_tensor.view(torch.uint8))
                               for a, p in zip(shards_before, params))
        engine.step()
        master_equal = all(torch.equal(p.ds_tensor[:real_numel(p, rank)],
                                        safe_get_local_fp32_param(p).reshape(-1)[:real_numel(p, rank)]) for p in params)
        stats = deepspeed_dgc.get_stats(engine).last
        record.append(dict(exact=exact, seen=dict(seen), shards_unchanged=shards_unchanged, master_equal=master_equal,
                           param_wire=stats.param_wire_bytes, param_dense=stats.param_dense_fp32_bytes,
                           param_inter_wire=stats.param_inter_node_wire_bytes,
                           param_inter_dense=stats.param_inter_node_dense_fp32_bytes,
                           grad_inter_wire=stats.inter_node_wire_bytes,
                           loss=float(loss)))
    # an exact path must stay exact (checked after the last step: with hpZ, leaving GatheredParameters
    # makes secondary shards that the next forward would use, changing the traffic measured above)
    final = [safe_get_full_fp32_param(p).reshape(-1).clone() for p in params]
    with deepspeed.zero.GatheredParameters(params):
        record[-1]["gathered_exact"] = all(torch.equal(p.data.reshape(-1), e) for p, e in zip(params, final))
    torch.save(record, f"{out_dir}/rank{rank}.pt")
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
