"""benchmarks.study_jobs: the config edits of each job feature, the probe's checks and the refusal's message (no
training, no launch)."""

import json

import pytest

from benchmarks import study_jobs as sj


def _bases():
    return (json.loads(sj.STOCK_CONFIG.read_text()), json.loads(sj.METHOD_CONFIG.read_text()))


def test_apply_edit_sets_dotted_keys_in_a_copy():
    config = {"zero_optimization": {"stage": 3}, "optimizer": {"params": {"lr": 1.0}}}
    out = sj.apply_edit(config, {"zero_optimization.offload_optimizer": {"device": "cpu"}, "bf16": {"enabled": True},
                                 "optimizer.params.lr": 0.5, "a.b.c": 1})
    assert out == {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                   "optimizer": {"params": {"lr": 0.5}}, "bf16": {"enabled": True}, "a": {"b": {"c": 1}}}
    assert config == {"zero_optimization": {"stage": 3}, "optimizer": {"params": {"lr": 1.0}}}
    with pytest.raises(ValueError, match="not a section"):
        sj.apply_edit({"a": 1}, {"a.b": 2})


@pytest.mark.parametrize("feature", sj.FEATURES, ids=lambda f: f.name)
def test_both_runs_get_the_same_edit(feature):
    stock_base, method_base = _bases()
    stock, method = sj.feature_configs(feature, stock_base, method_base)
    assert "dgc" not in stock and method["dgc"]["decoupled_momentum"]["storage"] == "int8"
    # the method's run is stock's plus its "dgc" section (and the feature's method-only keys: under "dgc", or its lr)
    own_lr = {k: v for k, v in feature.method_edit.items() if not k.startswith("dgc.")}
    assert own_lr in ({}, sj.lr_edit(own_lr.get("optimizer.params.lr")))
    assert {k: v for k, v in method.items() if k != "dgc"} == sj.apply_edit(stock, own_lr)
    for key, value in feature.method_edit.items():
        assert sj.fact(method, key) == value
    for key, value in feature.edit.items():
        assert sj.fact(stock, key) == value
    # the same global batch per step in every job
    assert stock["train_micro_batch_size_per_gpu"] * stock["gradient_accumulation_steps"] == 16


def test_the_features_edits():
    stock_base, method_base = _bases()
    stock, _ = sj.feature_configs(sj.BY_NAME["offload_optimizer"], stock_base, method_base)
    assert stock["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 500000,
                                          "offload_optimizer": {"device": "cpu"}}
    assert stock["optimizer"]["params"]["torch_adam"] is False  # DeepSpeed's CPU Adam, not torch's
    stock, method = sj.feature_configs(sj.BY_NAME["fp16"], stock_base, method_base)
    assert stock["fp16"] == {"enabled": True, "initial_scale_power": 16} and "loss_scale" not in stock["fp16"]
    stock, method = sj.feature_configs(sj.BY_NAME["grad_accum"], stock_base, method_base)
    assert (stock["gradient_accumulation_steps"], stock["train_micro_batch_size_per_gpu"]) == (2, 8)
    stock, method = sj.feature_configs(sj.BY_NAME["policy_auto"], stock_base, method_base)
    assert stock == stock_base and method["dgc"]["policy"] == "auto"
    assert method["dgc"]["decoupled_momentum"] == method_base["dgc"]["decoupled_momentum"]
    # the row that measured Lion on u is the shipped Lion config, at the lr docs/methods.md reports
    _, method = sj.feature_configs(sj.with_lr(sj.BY_NAME["lion_offload_optimizer"], 0.001), stock_base, method_base)
    assert method == json.loads((sj.ROOT / "configs" / "zero3_dgc_lion.json").read_text())


def test_with_lr_sets_the_optimizer_and_the_warmup_peak_only():
    feature = sj.BY_NAME["sgd"]
    stock_base, method_base = _bases()
    stock, method = sj.feature_configs(sj.with_lr(feature, 0.05), stock_base, method_base)
    assert stock["optimizer"] == {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    assert stock["scheduler"]["params"]["warmup_max_lr"] == 0.05
    assert stock["scheduler"]["params"]["warmup_num_steps"] == 30 and stock["zero_allow_untested_optimizer"] is True
    assert method["dgc"]["decoupled_momentum"]["update"] == "optimizer"
    assert feature.edit["optimizer"]["params"]["lr"] == 0.3  # the feature itself unchanged
    stock, method = sj.feature_configs(sj.with_lr(sj.BY_NAME["sgd_sign"], 0.05), stock_base, method_base)
    assert stock["optimizer"]["params"]["lr"] == 0.05 and "update" not in method["dgc"]["decoupled_momentum"]
    assert method["optimizer"]["params"]["lr"] == method["scheduler"]["params"]["warmup_max_lr"] == 0.003


def test_check_facts_names_what_is_missing():
    facts = {"optimizer": "DeepSpeedCPUAdam", "offload_optimizer": True, "weight_decay": 0.1, "dgc_on": True,
             "dgc": {"policy": "auto"}}
    assert sj.check_facts(facts, {"optimizer": "DeepSpeedCPUAdam", "weight_decay": 0.1000000000001,
                                  "dgc.policy": "auto"}, dgc_on=True) == []
    assert sj.check_facts(facts, {"offload_optimizer": False}, dgc_on=False) == [
        "offload_optimizer: want false, got true", "dgc_on: want false, got true"]
    assert sj.check_facts({"dgc_on": False}, {"dgc.policy": "auto"}, dgc_on=False) == [
        'dgc.policy: want "auto", got null']


def test_error_message_is_the_last_exception_line():
    log = "\n".join(["[rank0]: Traceback (most recent call last):", "[rank0]:   File \"x.py\", line 1, in <module>",
                     "[rank0]: ValueError: first", "During handling of the above exception, another exception occurred:",
                     "[rank0]: deepspeed_dgc.config.DGCConfigError: dgc.policy: 'auto' is not offered with x",
                     "[rank1]: RuntimeError: peer gone", "exits with return code = 1"])
    assert sj.error_message(log) == "RuntimeError: peer gone"
    assert sj.error_message(log.rsplit("\n", 2)[0]) == ("deepspeed_dgc.config.DGCConfigError: dgc.policy: 'auto' is "
                                                        "not offered with x")
    assert sj.error_message("all good\nstep 3 | train 4.3") is None


def test_edit_text_and_the_arguments():
    assert sj.edit_text({}) == "none"
    assert sj.edit_text({"bf16": {"enabled": True}, "a.b": 2}) == '`bf16 = {"enabled": true}`; `a.b = 2`'
    args = sj.parse_args(["--lr", "sgd=0.1", "--extra-lr", "lion_offload=1e-3", "--extra-lr", "sgd=0.3"])
    assert args.lr == {"sgd": 0.1} and args.extra_lr == [("lion_offload", 0.001), ("sgd", 0.3)]
    for bad in (["--lr", "fp16=0.1"], ["--extra-lr", "sgd"], ["--extra-lr", "sgd=x"]):
        with pytest.raises(SystemExit):
            sj.parse_args(bad)
