"""The network benchmark's configurations (stock ZeRO-3, ZeRO++-like, DGC, DDP + PowerSGD) and the ds_config of
each: ``CONFIGS`` on one node, ``NODE_CONFIGS`` with ``--nodes``, ``BY_NAME`` for both."""

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_CONFIG = ROOT / "configs" / "zero3_p0_baseline.json"
# stage3_prefetch_bucket_size of every ZeRO-3 configuration (--prefetch-bucket-size): about two of the model's
# 6 x 1.77M-parameter layers' matrices, so that each gather overlaps the forward of the layer before (DeepSpeed's
# default, 5e7, gathers all 10.7M parameters at once before the first layer; results/bench_time_to_target.md).
PREFETCH_BUCKET_SIZE = 1_000_000


@dataclass(frozen=True)
class BenchConfig:
    """One configuration: ``dgc`` is the ds_config "dgc" section (None: stock), ``ds_extra`` other
    top-level ds_config keys; ``ddp`` runs benchmarks/ddp_powersgd.py instead of ZeRO-3."""
    name: str
    label: str
    dgc: dict | None = None
    ds_extra: dict = field(default_factory=dict)
    ddp: bool = False
    grads_only: bool = False  # compresses gradients only (weights gathered as stock)
    # --nodes only: the hierarchical topology and hpZ over the node (dgc.ranks_per_node and
    # zero_hpz_partition_size = the node size, set at launch)
    node_level: bool = False
    # what it sends depends on the link (policy "auto"): its loss is trained at every rate, not once
    loss_per_rate: bool = False


def _dgc(density: float | str, error_feedback: bool = True, weights: str | None = None) -> dict:
    # fp32 residuals, as when results/bench_network*.md were measured (the default "auto" stores fp8 on the flat
    # topology since; on this CPU storing and reading back 10M residuals in fp8 costs about 0.15 s per step)
    section = {"enabled": True, "density": density, "quantization": "int4", "group_size": 128,
               "error_feedback": error_feedback, "residual_dtype": "fp32", "min_numel": 2048,
               "stats_interval": 1000000}
    if weights:
        section["weights"] = {"quantization": weights, "group_size": 256}
    return section


RECOMMENDED_ADAM = {"enabled": True, "stats_interval": 1000000,
                    "decoupled_momentum": {"chunk": 64, "topk": 2, "quantization": "int2"}}  # configs/zero3_dgc_adam.json
# in both pools (with --nodes, node_level adds hpZ over the node and the two hops)
ZEROPP_LIKE = BenchConfig("zeropp_like", "ZeRO++-like: INT8 weights + dense INT4 gradients, no error feedback "
                          "(with --nodes: hpZ over the node, two hops)",
                          dict(_dgc(1.0, error_feedback=False, weights="int8")), node_level=True)
DGC_ADAM_FLAT = BenchConfig("dgc_adam_flat", "DGC, recommended Adam setting (decoupled momentum INT2) + INT4 weights, "
                            "flat", dict(RECOMMENDED_ADAM, weights={"quantization": "int4", "group_size": 256}))
CONFIGS = [
    BenchConfig("stock_fp32", "stock ZeRO-3, fp32 communication"),
    BenchConfig("stock_bf16", "stock ZeRO-3, communication_data_type bf16", ds_extra={"communication_data_type": "bf16"}),
    BenchConfig("int4_grads", "dense INT4 gradients, no error feedback (qgZ stand-in)", _dgc(1.0, error_feedback=False),
                grads_only=True),
    BenchConfig("int4_ef_wint4", "dense INT4 gradients + error feedback, INT4 weights", _dgc(1.0, weights="int4")),
    BenchConfig("dgc_d001", "DGC gradients (top-k 0.01, INT4)", _dgc(0.01), grads_only=True),
    BenchConfig("dgc_auto", "DGC gradients (top-k auto, INT4)", _dgc("auto"), grads_only=True),
    BenchConfig("dgc_d001_wint8", "DGC gradients (0.01) + INT8 weights", _dgc(0.01, weights="int8")),
    BenchConfig("dgc_d001_wfp8", "DGC gradients (0.01) + FP8 e4m3 weights", _dgc(0.01, weights="fp8_e4m3")),
    BenchConfig("dgc_d001_wint4", "DGC gradients (0.01) + INT4 weights", _dgc(0.01, weights="int4")),
    BenchConfig("dgc_d01_wint4", "DGC gradients (top-k 0.1, INT4) + INT4 weights", _dgc(0.1, weights="int4")),
    BenchConfig("ddp_powersgd", "PyTorch DDP + PowerSGD hook (rank 4, one bucket)", ddp=True),
    ZEROPP_LIKE,
    DGC_ADAM_FLAT,
    BenchConfig("policy_auto", "policy auto: per bucket and gather, stock or dense INT4 + EF / INT4 weights, measured",
                dict(_dgc(1.0, weights="int4"), policy="auto"), loss_per_rate=True),
]
# the configurations of --nodes (two nodes, each of L ranks, a rate-limited path between them)
NODE_CONFIGS = [
    BenchConfig("stock_fp32", "stock ZeRO-3, fp32 communication"),
    BenchConfig("stock_bf16", "stock ZeRO-3, communication_data_type bf16", ds_extra={"communication_data_type": "bf16"}),
    ZEROPP_LIKE,
    BenchConfig("dgc_int4_hier", "DGC, the default (dense INT4 + error feedback) + INT4 weights, hierarchical + hpZ",
                dict(_dgc(1.0, weights="int4"), residual_dtype="fp8"), node_level=True),
    DGC_ADAM_FLAT,
    BenchConfig("dgc_adam_hier", "DGC, recommended Adam setting (bf16 momentum) + INT4 weights, hierarchical + hpZ",
                dict(RECOMMENDED_ADAM, decoupled_momentum=dict(RECOMMENDED_ADAM["decoupled_momentum"], storage="bf16"),
                     weights={"quantization": "int4", "group_size": 256}), node_level=True),
]
BY_NAME = {c.name: c for c in CONFIGS + NODE_CONFIGS}


def ds_config_for(config: BenchConfig, micro_batch: int, ranks_per_node: int | None = None,
                  prefetch_bucket_size: int = PREFETCH_BUCKET_SIZE) -> dict:
    """The ds_config of a ZeRO-3 configuration: configs/zero3_p0_baseline.json (persistence threshold 0)
    with this micro-batch and ``stage3_prefetch_bucket_size`` (elements; 0: DeepSpeed's default), plus the
    configuration's keys; a ``node_level`` one with ``ranks_per_node`` also gets the hierarchical topology and hpZ
    over the node."""
    ds = json.loads(BASE_CONFIG.read_text())
    ds["train_micro_batch_size_per_gpu"] = micro_batch
    if prefetch_bucket_size:
        ds["zero_optimization"]["stage3_prefetch_bucket_size"] = prefetch_bucket_size
    ds.update(copy.deepcopy(config.ds_extra))
    if config.dgc is not None:
        ds["dgc"] = copy.deepcopy(config.dgc)
    if config.node_level and ranks_per_node:
        ds["dgc"].update(topology="hierarchical", ranks_per_node=ranks_per_node)
        ds["zero_optimization"]["zero_hpz_partition_size"] = ranks_per_node
    return ds
