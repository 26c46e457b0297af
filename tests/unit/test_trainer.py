"""HybridTrainer: its names map onto the "dgc" keys, and bad values fail naming the argument."""

import pytest

from deepspeed_dgc import DGCConfigError, HybridTrainer


def test_names_map_onto_dgc_keys():
    t = HybridTrainer(precision_policy="int4", topology="hybrid_ring", sparse_threshold=0.05,
                      train_micro_batch_size_per_gpu=4, zero_optimization={"reduce_bucket_size": 1000},
                      dgc={"weights": {"quantization": "int8"}})
    assert t.config["dgc"] == {"enabled": True, "quantization": "int4", "topology": "hierarchical", "density": 0.05,
                               "weights": {"quantization": "int8"}}
    assert t.config["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 1000}  # merged, not replaced
    assert t.config["train_micro_batch_size_per_gpu"] == 4
    assert HybridTrainer(topology="flat").config["dgc"]["topology"] == "flat"
    assert HybridTrainer().config["dgc"]["density"] == 1.0  # the safe default: dense, quantized, error feedback
    fp8_auto = HybridTrainer(precision_policy="fp8", sparse_threshold="auto").config["dgc"]
    assert (fp8_auto["quantization"], fp8_auto["density"]) == ("fp8_e4m3", "auto")


@pytest.mark.parametrize("kwargs,match", [
    (dict(precision_policy="int2"), "precision_policy must be one of int4, fp8"),
    (dict(topology="ring"), "topology must be one of flat, hybrid_ring"),
    (dict(sparse_threshold="Auto"), r"float in \(0, 1\]"),
    (dict(sparse_threshold=0.0), r"float in \(0, 1\]"),
    (dict(sparse_threshold=1.5), r"float in \(0, 1\]"),
    (dict(sparse_threshold=True), r"float in \(0, 1\]"),
    (dict(dgc={"densty": 0.1}), "unknown key 'dgc.densty'"),
    (dict(dgc={"density": 0.5}), "clash with the named arguments"),
    (dict(dgc={"enabled": False}), "clash with the named arguments"),
    (dict(dgc=None), "dgc must be a dict"),
])
def test_bad_values_name_the_argument(kwargs, match):
    with pytest.raises(DGCConfigError, match=match):
        HybridTrainer(**kwargs)


def test_train_step_before_init_model_says_so():
    with pytest.raises(RuntimeError, match="call init_model"):
        HybridTrainer().train_step(None, lambda m, b: None)
