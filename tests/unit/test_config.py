"""The "dgc" config model: defaults, every error naming its key, strict types, the derived properties."""

import copy
import json
from pathlib import Path

import pydantic
import pytest

from deepspeed_dgc.config import DGCConfig, DGCConfigError, misspelled_section, parse_dgc_config, switched_off_by_default

CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # the shipped ds_configs


def test_config_defaults_and_lossless():
    cfg = parse_dgc_config({"dgc": {"enabled": True}})
    assert (cfg.density, cfg.quantization, cfg.group_size, cfg.error_feedback) == (1.0, "int4", 128, True)
    assert not cfg.lossless
    assert parse_dgc_config({"dgc": {"density": 1.0, "quantization": "none"}}).lossless
    assert parse_dgc_config({"train_batch_size": 8}) is None
    # residual storage "auto": fp8 (the study's cheapest at parity) where supported, fp32 where needed
    assert (cfg.residual_dtype, cfg.residual_storage) == ("auto", "fp8")
    assert DGCConfig(enabled=True, topology="hierarchical").residual_storage == "fp8"
    assert DGCConfig(enabled=True, momentum_correction=True).residual_storage == "fp32"
    assert DGCConfig(enabled=True, residual_dtype="bf16").residual_storage == "bf16"


@pytest.mark.parametrize("section,needle", [
    ({"densty": 0.1}, "unknown key 'dgc.densty'"),
    ({"density": 0}, "'dgc.density'"),
    ({"density": 1.01}, "'dgc.density'"),
    ({"quantization": "fp8"}, "'dgc.quantization'"),
    ({"group_size": 7}, "'dgc.group_size': Input should be even \\(got 7\\)$"),
    ({"decoupled_momentum": {"group_size": 3}},
     "'dgc.decoupled_momentum.group_size': Input should be even \\(got 3\\)$"),
    ({"group_size": 0}, "'dgc.group_size'"),
    ({"min_numel": -1}, "'dgc.min_numel'"),
    ({"stats_interval": 0}, "'dgc.stats_interval'"),
    ({"enabled": "maybe"}, "'dgc.enabled': Input should be a valid boolean \\(got \"maybe\"\\)$"),
    ({"accumulate_locally": None}, "'dgc.accumulate_locally': Input should be a valid boolean \\(got null\\)$"),
    ({"density": True}, "'dgc.density': Input should be a valid number or Input should be 'auto' \\(got true\\)$"),
    ({"enabled": 1}, "'dgc.enabled'"),
    ({"density": "0.5"}, "'dgc.density'"),
    ({"group_size": 4.0}, "'dgc.group_size'"),
    ({"weights": {"quantization": "int2"}}, "'dgc.weights.quantization'"),
    ({"weights": {"group_sise": 64}},
     "unknown key 'dgc.weights.group_sise' \\(allowed keys: quantization, group_size\\); did you mean "
     "'dgc.weights.group_size'\\?$"),
    ({"decoupled_momentm": {}}, "unknown key 'dgc.decoupled_momentm' [^;]*; did you mean 'dgc.decoupled_momentum'\\?$"),
    ({"decoupled_momentum": {"topK": 2}}, "unknown key 'dgc.decoupled_momentum.topK' \\(allowed keys: chunk, [^)]*\\); "
     "did you mean 'dgc.decoupled_momentum.topk'\\?$"),
    ({"colour": "red"}, "unknown key 'dgc.colour' \\(allowed keys: enabled, [a-z_, ]*\\)$"),  # nothing near: no guess
    ({"comm_backend": "nccl"}, "'dgc.comm_backend': Input should be 'torch' or 'mpi'"),
    ({"topology": "ring"}, "'dgc.topology': Input should be 'flat' or 'hierarchical'"),
    ({"ranks_per_node": 0}, "'dgc.ranks_per_node'"),
    ({"ranks_per_node": 2.0}, "'dgc.ranks_per_node'"),
    ({"timeout_s": 0}, "'dgc.timeout_s'"),
    ({"timeout_s": -5.0}, "'dgc.timeout_s'"),
    ({"timeout_s": 0.05}, "'dgc.timeout_s': Input should be greater than or equal to 1"),
    ({"local_clip_norm": 0.0}, "'dgc.local_clip_norm'"),
    ({"local_clip_norm": 1.0}, "'dgc.local_clip_norm' is part of DGC's momentum correction"),
    ({"momentum_factor_masking": False}, "'dgc.momentum_factor_masking' is part of DGC's momentum correction"),
    ({"momentum_correction": True, "residual_dtype": "bf16"}, "'dgc.momentum_correction' needs"),
    ({"momentum_correction": True, "topology": "hierarchical", "local_clip_norm": 1.0},
     "'dgc.local_clip_norm' needs 'dgc.topology' = \"flat\""),
    ({"momentum_correction": True, "error_feedback": False}, "'dgc.momentum_correction' needs"),
    ({"momentum_correction": "yes"}, "'dgc.momentum_correction'"),
    ({"threshold_reuse_steps": 0}, "'dgc.threshold_reuse_steps'"),
    ({"threshold_reuse_steps": 2.0}, "'dgc.threshold_reuse_steps'"),
    ({"threshold_reuse_steps": 4, "threshold": 0.1}, "'dgc.threshold_reuse_steps' reuses estimated top-k"),
    ({"threshold": 0.1, "density": 0.5}, "'dgc.threshold' keeps what reaches it and 'dgc.density' keeps a fraction"),
    ({"density": 0.1, "density_min": 0.2}, "'dgc.density_min' is a setting of density \"auto\""),
    ({"energy_budget": 0.2}, "'dgc.energy_budget' is a setting of density \"auto\""),
    ({1: 2}, "'dgc' keys must be strings, got 1"),
    ({"kernels": "fused", "quantization": "none"}, "'dgc.kernels' = \"fused\" cannot code 'dgc.quantization' = \"none\""),
    ({"kernels": "fused", "stochastic_rounding": True}, "cannot code 'dgc.stochastic_rounding' = true"),
    ({"kernels": "fused", "index_coding": "bitmap"}, "cannot code 'dgc.index_coding' = \"bitmap\""),
    ({"decoupled_momentum": {"chunk": 48}}, "^invalid ds_config section 'dgc': 'dgc.decoupled_momentum.chunk' must be a "
     "power of two, got 48$"),
    ({"decoupled_momentum": {"chunk": 8192}}, "'dgc.decoupled_momentum.chunk'"),
    ({"decoupled_momentum": {"topk": 9, "chunk": 8}}, "'dgc.decoupled_momentum.topk' \\(9\\) is above"),
    ({"decoupled_momentum": {"topk": 0}}, "'dgc.decoupled_momentum.topk'"),
    ({"decoupled_momentum": {"decay": 1.0}}, "'dgc.decoupled_momentum.decay'"),
    ({"decoupled_momentum": {"update": "lion"}}, "'dgc.decoupled_momentum.update'"),
    ({"decoupled_momentum": {"transform": "fft"}}, "'dgc.decoupled_momentum.transform'"),
    ({"decoupled_momentum": {"lr_scale": 0}}, "'dgc.decoupled_momentum.lr_scale': Input should be greater than 0"),
    ({"decoupled_momentum": {"lr_scale": "1.5x"}}, "'dgc.decoupled_momentum.lr_scale'"),
    ({"decoupled_momentum": {"update": "optimizer", "lr_scale": 1.5}}, "'dgc.decoupled_momentum.lr_scale' scales "
     "the sign step's learning rate; with 'update' = \"optimizer\" the optimizer steps at its own: remove 'lr_scale'$"),
    ({"decoupled_momentum": {"topk": 2, "sparsity": 0.9}}, "unknown key 'dgc.decoupled_momentum.sparsity'"),
    ({"decoupled_momentum": {}, "density": 0.01}, "'dgc.density' is a setting of the gradient codec, which "
     "'dgc.decoupled_momentum' replaces"),
    ({"decoupled_momentum": {}, "quantization": "int2"}, "'dgc.quantization' is a setting of the gradient codec"),
    ({"decoupled_momentum": {}, "layout": "fixed", "density": 0.1, "error_feedback": True},
     "^invalid ds_config section 'dgc': 'dgc.density', 'dgc.error_feedback', 'dgc.layout' are settings of the "
     "gradient codec, which 'dgc.decoupled_momentum' replaces by its own"),
    ({"policy": "auto", "compressed_momentum": {"freeze_step": 10}}, "'dgc.policy' = \"auto\" switches buckets between stock and "
     "compressed, which 'dgc.compressed_momentum' cannot"),
    ({"policy": "auto", "shared_mask": {}}, "which 'dgc.shared_mask' cannot"),
    ({"policy": "auto", "momentum_correction": True}, "which 'dgc.momentum_correction' cannot"),
    ({"policy": "auto", "decoupled_momentum": {}, "topology": "hierarchical"},
     "'dgc.policy' = \"auto\" with 'dgc.decoupled_momentum' needs 'dgc.topology' = \"flat\""),
    ({"policy_interval": 5}, "'dgc.policy_interval' is a setting of 'dgc.policy' = \"auto\""),
    ({"policy": "fast"}, "'dgc.policy': Input should be 'fixed' or 'auto'"),
    ({"policy": "auto", "policy_interval": 0}, "'dgc.policy_interval'"),
    ({"decoupled_momentum": {}, "compressed_momentum": {"freeze_step": 3}},
     "'dgc.compressed_momentum' and 'dgc.decoupled_momentum' both change what is sent"),
    ({"decoupled_momentum": {}, "momentum_correction": True},
     "'dgc.momentum_correction' and 'dgc.decoupled_momentum' both change what is sent"),
])
def test_config_errors_name_the_key(section, needle):
    with pytest.raises(DGCConfigError, match=needle.replace(".", r"\.")):
        parse_dgc_config({"dgc": section})


@pytest.mark.parametrize("section", [True, None, [], "on"])
def test_config_section_must_be_object(section):
    with pytest.raises(DGCConfigError, match="JSON object"):
        parse_dgc_config({"dgc": section})


def test_config_is_frozen():
    cfg = DGCConfig(enabled=True)
    with pytest.raises(pydantic.ValidationError, match="Instance is frozen"):
        cfg.density = 0.5
    assert cfg.density == 1.0


def test_a_section_without_enabled_warns_that_compression_is_off():
    """A "dgc" section that leaves out "enabled" (false by default) gets a warning naming its settings; an explicit
    "enabled" either way, or no section, gets none."""
    msg = switched_off_by_default(parse_dgc_config({"dgc": {"quantization": "int2", "density": 0.1}}))
    assert "sets 'density', 'quantization' but not 'dgc.enabled'" in msg and "compression is OFF" in msg
    assert "is empty" in switched_off_by_default(parse_dgc_config({"dgc": {}}))
    assert switched_off_by_default(parse_dgc_config({"dgc": {"enabled": False, "density": 0.1}})) is None
    assert switched_off_by_default(parse_dgc_config({"dgc": {"enabled": True, "density": 0.1}})) is None
    assert switched_off_by_default(parse_dgc_config({"train_batch_size": 8})) is None


def test_a_misspelled_section_name_is_named():
    """Top-level keys that look like "dgc" ("DGC", "dcg", "dgc_config") are named, and the warning says compression
    is off where no "dgc" section exists; DeepSpeed's own keys are not taken for one."""
    msg = misspelled_section({"DGC": {"enabled": True}, "train_batch_size": 8})
    assert "'DGC' at its top level" in msg and "compression is OFF" in msg
    assert "'dcg'" in misspelled_section({"dcg": {}}) and "'dgc_config'" in misspelled_section({"dgc_config": {}})
    both = misspelled_section({"dgc": {"enabled": True}, "Dgc": {}})
    assert "'Dgc'" in both and "OFF" not in both
    stock = {k: {} for k in ("amp", "aio", "fp16", "bf16", "zero_optimization", "optimizer", "scheduler", "dgc",
                             "checkpoint", "compile", "timers", "pipeline", "comms_logger", "csv_monitor", "wandb")}
    assert misspelled_section(stock) is None and misspelled_section(None) is None


def _adam_config_and(name: str):
    """A copy of configs/zero3_dgc_adam.json to edit into what ``configs/<name>`` should be, and that file."""
    adam = json.loads((CONFIGS / "zero3_dgc_adam.json").read_text())
    return copy.deepcopy(adam), json.loads((CONFIGS / name).read_text())


def test_the_shipped_lion_config_is_the_adam_config_with_lion_stepping_on_u():
    """configs/zero3_dgc_lion.json is configs/zero3_dgc_adam.json with DeepSpeed's Lion at lr 0.001 (the schedule's
    peak too) under ZeRO-Offload, and decoupled momentum handing u to Lion with decay 0.9 and top-4: the setting
    docs/methods.md ("Lion") measured within 1% of stock Lion; the section parses."""
    want, lion = _adam_config_and("zero3_dgc_lion.json")
    want["optimizer"] = {"type": "Lion", "params": {"lr": 0.001, "betas": [0.9, 0.99], "weight_decay": 0.0}}
    want["scheduler"]["params"]["warmup_max_lr"] = 0.001
    want["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    want["dgc"]["decoupled_momentum"].update(update="optimizer", decay=0.9, topk=4)
    assert lion == want
    dm = parse_dgc_config(lion).decoupled_momentum
    assert (dm.update, dm.decay, dm.topk, dm.chunk) == ("optimizer", 0.9, 4, 64)


def test_the_shipped_adam_on_u_config_is_the_adam_config_with_adamw_stepping_on_u():
    """configs/zero3_dgc_adam_on_u.json is configs/zero3_dgc_adam.json with Adam's betas (0, 0.99) and decoupled
    momentum handing u to it with decay 0.99: the setting docs/methods.md ("AdamW on u") measured on the main job;
    the section parses."""
    want, on_u = _adam_config_and("zero3_dgc_adam_on_u.json")
    want["optimizer"]["params"]["betas"] = [0.0, 0.99]
    want["dgc"]["decoupled_momentum"].update(update="optimizer", decay=0.99)
    assert on_u == want
    dm = parse_dgc_config(on_u).decoupled_momentum
    assert (dm.update, dm.decay, dm.topk, dm.quantization) == ("optimizer", 0.99, 2, "int2")


def test_check_command_reads_each_file_as_initialize_does(tmp_path, capsys):
    """``python -m deepspeed_dgc check``: per file, the section's keys (a method's subsection with its defaults) or the
    error naming the key; the warnings initialize gives; exit 1 when any file fails."""
    from deepspeed_dgc.__main__ import main
    files = {"typo": {"dgc": {"enabled": True, "decoupled_momentum": {"topK": 2}}}, "list": [1],
             "unswitched": {"dgc": {"density": 0.1}}, "misspelled": {"DGC": {"enabled": True}}}
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    (tmp_path / "broken.json").write_text('{"dgc": {"enabled": true')
    assert main(["check", str(CONFIGS / "zero3_dgc_lion.json"), str(CONFIGS / "zero3_baseline.json")]) == 0
    ok = capsys.readouterr().out.splitlines()
    assert ok[0].endswith("zero3_dgc_lion.json: ok, 'dgc' = {\"enabled\": true, \"decoupled_momentum\": {"
                          "\"chunk\": 64, \"topk\": 4, \"decay\": 0.9, \"transform\": \"dct\", \"quantization\": "
                          "\"int2\", \"group_size\": 128, \"update\": \"optimizer\", \"lr_scale\": 1.0, \"storage\": "
                          "\"int8\", \"offload\": null}} (keys not shown take their defaults, docs/config.md)"), ok[0]
    assert ok[1].endswith("zero3_dgc_lion.json: job fits: DeepSpeedCPULion (what DeepSpeed builds from the "
                          "'optimizer' section), fp16 off, optimizer offload on; the batch sizes and the world size are "
                          "checked at initialize"), ok[1]
    assert ok[2].endswith("zero3_baseline.json: ok, compression off (no 'dgc' section)") and len(ok) == 3
    assert main(["check"] + [str(tmp_path / f"{name}.json") for name in (*files, "broken")]) == 1
    out = capsys.readouterr().out
    assert "typo.json: refused: invalid ds_config section 'dgc': unknown key 'dgc.decoupled_momentum.topK'" in out
    assert "did you mean 'dgc.decoupled_momentum.topk'?" in out
    assert "list.json: refused: the top level is an array, not an object" in out
    assert "unswitched.json: warning: deepspeed_dgc: the ds_config's 'dgc' section sets 'density' but not" in out
    assert "unswitched.json: ok, compression off (dgc.enabled false in the 'dgc' section)" in out
    assert "misspelled.json: warning: deepspeed_dgc: the ds_config has 'DGC' at its top level" in out
    assert "broken.json: refused: not JSON: Expecting ',' delimiter: line 1 column 25 (char 24) (nor hjson" in out


FILES = {  # name -> (the file's bytes, what check prints after "PATH: " on its first line)
    "empty": (b"", "refused: the file is empty"),
    "blank": (b"  \n\t\n", "refused: the file is empty"),
    "binary": (b"{\"dgc\": \xc1\xff}", "refused: not UTF-8 text (invalid start byte at byte 8)"),
    "truncated": (b'{"dgc": ', "refused: not JSON: Expecting value: line 1 column 9 (char 8) (nor hjson, which "
                                "DeepSpeed also reads)"),
    "string": (b"hello", "refused: the top level is a string, not an object"),
    "number": (b"3", "refused: the top level is a number, not an object"),
    "dgc_twice": (b'{"dgc": {"enabled": true}, "dgc": {}}', "refused: Duplicate keys in DeepSpeed config: ['dgc']"),
    "key_twice": (b'{"dgc": {"enabled": true, "quantization": "int4", "quantization": "int8"}}',
                  "refused: Duplicate keys in DeepSpeed config: ['quantization']"),
    "overflow": (b'{"dgc": {"enabled": true, "density": 1e400}}', "refused: invalid ds_config section 'dgc': "
                 "invalid value for 'dgc.density': Input should be a finite number or Input should be 'auto' (got inf)"),
    "deep": (b'{"dgc": ' + b"[" * 100000 + b"]" * 100000 + b"}", "refused: arrays or objects nested too deeply to read"),
    "deep_hjson": (b'{dgc: ' + b"[" * 100000 + b"]" * 100000 + b"}", "refused: arrays or objects nested too deeply to read"),
    "float_zero": (b'{"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.0, 0.99], "torch_adam": true}}, '
                   b'"zero_optimization": {"stage": 3}, "dgc": {"enabled": true}}', "ok, 'dgc' = {\"enabled\": true}"),
    "dgc_null": (b'{"dgc": null}', "refused: 'dgc' must be a JSON object, got null"),
    "dgc_text": (b'{"dgc": "on"}', "refused: 'dgc' must be a JSON object, got a string"),
    "hjson": (b'{\n  // DeepSpeed reads hjson\n  zero_optimization: {"stage": 3},\n'
              b'  dgc: {"enabled": true, "density": 0.1,},\n}\n',
              "ok, 'dgc' = {\"enabled\": true, \"density\": 0.1}"),
}


@pytest.mark.parametrize("name", list(FILES))
def test_check_reads_a_file_as_deepspeed_reads_a_config_path(name, tmp_path, capsys):
    """``check`` reads a file as JSON, with a key given twice in an object refused with DeepSpeed's message (as
    DeepSpeed refuses it given the path), a file that is not JSON as hjson (comments, trailing commas and unquoted keys
    pass, as DeepSpeed reads a path), a float as JSON's float (hjson's 0 would fail AdamW's betas), and says what is
    wrong with one that is empty, not text, neither JSON nor hjson, or not an object."""
    import hjson
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed_dgc.__main__ import main
    path = tmp_path / f"{name}.json"
    content, want = FILES[name]
    path.write_bytes(content)
    status = main(["check", str(path)])
    out = capsys.readouterr().out.splitlines()
    assert status == (1 if want.startswith("refused") else 0)
    assert out[0].startswith(f"{path}: {want}"), out
    if name in ("dgc_twice", "key_twice", "hjson"):  # DeepSpeed's own reading of the path agrees
        try:
            DeepSpeedConfig(str(path))
        except (ValueError, AssertionError, hjson.HjsonDecodeError) as err:
            assert ("Duplicate keys" in str(err)) == (name != "hjson"), err


WORLD_CASES = [  # (batch keys, "dgc" section's extra keys, check's options, what check prints after "PATH: ")
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4}, {}, ["--world-size", "4"],
     "job fits: FusedAdam (what DeepSpeed builds from the 'optimizer' section), fp16 off, optimizer offload off; the "
     "batch sizes fit 4 ranks"),
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4}, {}, ["--world-size", "5"],
     "refused: DeepSpeed refuses the file's settings for 5 ranks: AssertionError: Check batch related parameters. "
     "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 48 != 4 * 2 * 5"),
    ({"train_batch_size": 8}, {}, ["--world-size", "16"],
     "refused: DeepSpeed refuses the file's settings for 16 ranks: AssertionError: Micro batch size per gpu: 0 has to "
     "be greater than 0"),
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4}, {}, [],
     "job fits: FusedAdam (what DeepSpeed builds from the 'optimizer' section), fp16 off, optimizer offload off; the "
     "batch sizes and the world size are checked at initialize"),
    ({"train_micro_batch_size_per_gpu": 4}, {"topology": "hierarchical"}, ["--world-size", "6"],
     "job fits: FusedAdam (what DeepSpeed builds from the 'optimizer' section), fp16 off, optimizer offload off; the "
     "batch sizes fit 6 ranks, the nodes are not checked: 'dgc.ranks_per_node' is null (the launcher's LOCAL_SIZE; "
     "give --ranks-per-node)"),
    ({"train_micro_batch_size_per_gpu": 4}, {"topology": "hierarchical"}, ["--world-size", "6", "--ranks-per-node", "4"],
     "refused: 'dgc.topology' = \"hierarchical\": the world size 6 is not a multiple of 4 ranks per node "
     "('dgc.ranks_per_node' or the launcher's LOCAL_SIZE); set 'dgc.ranks_per_node' to a divisor of the world size"),
    ({"train_micro_batch_size_per_gpu": 4}, {"topology": "hierarchical", "ranks_per_node": 3},
     ["--world-size", "6", "--ranks-per-node", "4"],
     "job fits: FusedAdam (what DeepSpeed builds from the 'optimizer' section), fp16 off, optimizer offload off; the "
     "batch sizes fit 6 ranks, 2 nodes of 3 ranks"),
    ({"train_micro_batch_size_per_gpu": 4}, {"topology": "hierarchical", "ranks_per_node": 4}, ["--world-size", "4"],
     "job fits: FusedAdam (what DeepSpeed builds from the 'optimizer' section), fp16 off, optimizer offload off; the "
     "batch sizes fit 4 ranks, 1 node of 4 ranks"),
    ({"train_micro_batch_size_per_gpu": 4}, {"topology": "hierarchical"}, ["--ranks-per-node", "4"],
     "job fits: FusedAdam (what DeepSpeed builds from the 'optimizer' section), fp16 off, optimizer offload off; the "
     "batch sizes and the world size are checked at initialize"),
    ({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
     {"topology": "hierarchical"}, ["--ranks-per-node", "4"],
     "refused: 'zero_optimization.zero_hpz_partition_size' = 2 but 'dgc.topology' = \"hierarchical\" uses 4 ranks "
     "per node (from --ranks-per-node): both must describe the same node; set 'dgc.ranks_per_node' = 2 or the hpZ "
     "size to 4"),
    ({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
     {"topology": "hierarchical", "ranks_per_node": 2}, ["--world-size", "8", "--ranks-per-node", "4"],
     "job fits: FusedAdam (what DeepSpeed builds from the 'optimizer' section), fp16 off, optimizer offload off; the "
     "batch sizes fit 8 ranks, 4 nodes of 2 ranks"),
    ({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}, {"topology": "hierarchical"},
     ["--world-size", "3", "--ranks-per-node", "2"],
     "refused: 'dgc.topology' = \"hierarchical\": the world size 3 is not a multiple of 2 ranks per node "
     "('dgc.ranks_per_node' or the launcher's LOCAL_SIZE); set 'dgc.ranks_per_node' to a divisor of the world size"),
    ({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}, {}, ["--world-size", "3"],
     "job fits: FusedAdam (what DeepSpeed builds from the 'optimizer' section), fp16 off, optimizer offload off; "
     "batch sizes not checked: 'train_micro_batch_size_per_gpu', 'gradient_accumulation_steps' hold \"auto\""),
]


@pytest.mark.parametrize("batch, section, options, want", WORLD_CASES)
def test_check_given_the_world_size_makes_deepspeeds_batch_arithmetic_and_counts_the_nodes(batch, section, options,
                                                                                        want, tmp_path, capsys):
    """``check --world-size N [--ranks-per-node L]``: DeepSpeed's own batch arithmetic for N ranks (its messages), and
    under the hierarchical topology hpZ's node against 'dgc.ranks_per_node', or L where that is null, and with N whole
    nodes (the messages initialize gives, from the same functions; tests/distributed/test_engine.py compares them)."""
    from deepspeed_dgc.__main__ import main
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3},
                                **batch, "dgc": {"enabled": True, "decoupled_momentum": {}, **section}}))
    status = main(["check", str(path), *options])
    out = capsys.readouterr().out.splitlines()
    assert status == (1 if want.startswith("refused") else 0)
    assert out[-1] == f"{path}: {want}", out


@pytest.mark.parametrize("option", ["--world-size", "--ranks-per-node"])
@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_check_refuses_a_world_size_or_ranks_per_node_below_one_or_not_an_integer(option, value, tmp_path, capsys):
    from deepspeed_dgc.__main__ import main
    with pytest.raises(SystemExit) as exit_:
        main(["check", str(CONFIGS / "zero3_dgc_adam.json"), option, value])
    assert exit_.value.code == 2
    assert f"argument {option}: " in capsys.readouterr().err


ADAM_OPT = {"type": "Adam", "params": {"lr": 1e-3}}
JOB_CASES = {  # case -> (ds_config without its "dgc" section, "dgc" section, what check prints after "PATH: ")
    "fused_adam": ({"optimizer": ADAM_OPT}, {"enabled": True, "decoupled_momentum": {}},
                   "job fits: FusedAdam (what DeepSpeed builds from the 'optimizer' section), fp16 off, optimizer "
                   "offload off"),
    "fused_adam_beta1_under_update_optimizer": (
        {"optimizer": ADAM_OPT}, {"enabled": True, "decoupled_momentum": {"update": "optimizer"}},
        "refused: 'dgc.decoupled_momentum.update' = \"optimizer\" hands FusedAdam the sum of the ranks' decoupled "
        "momenta (decay 0.999), and FusedAdam's first moment (betas[0] = 0.9) would average it again"),
    "cpu_adam_l2_under_compressed_momentum": (
        {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.1}},
         "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
        {"enabled": True, "compressed_momentum": {"freeze_step": 10}},
        "refused: 'dgc.compressed_momentum' does not support 'zero_optimization.offload_optimizer'"),
    "fused_adam_l2_under_compressed_momentum": (
        {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.1}}},
        {"enabled": True, "compressed_momentum": {"freeze_step": 10}}, "refused: 'dgc.compressed_momentum' needs decoupled weight decay"),
    "cpu_adam_offload": ({"optimizer": ADAM_OPT, "zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu"}}}, {"enabled": True, "decoupled_momentum": {}}, "job fits: DeepSpeedCPUAdam (what DeepSpeed "
                                                                        "builds from the 'optimizer' section), fp16 "
                                                                        "off, optimizer offload on"),
    "sgd_under_shared_mask": ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer":
                               True}, {"enabled": True, "shared_mask": {}},
                              "refused: 'dgc.shared_mask' needs an Adam optimizer"),
    "sgd_untested_under_zero": ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, {"enabled": True},
                                "refused: DeepSpeed refuses SGD under ZeRO at initialize unless the file says "
                                "\"zero_allow_untested_optimizer\": true"),
    "sgd_lower_case": ({"optimizer": {"type": "sgd", "params": {"lr": 0.1}}}, {"enabled": True},
                       "refused: 'optimizer.type' = 'sgd' is not a supported DeepSpeed optimizer"),
    "betas_of_one": ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "betas": [0.9], "torch_adam": True}}},
                     {"enabled": True, "decoupled_momentum": {}},
                     "refused: 'optimizer.params' are refused by AdamW: IndexError"),
    "lr_text": ({"optimizer": {"type": "AdamW", "params": {"lr": "fast", "torch_adam": True}}},
                {"enabled": True}, "refused: 'optimizer.params' are refused by AdamW: TypeError:"),
    "fp16_not_an_object": ({"optimizer": ADAM_OPT, "fp16": True}, {"enabled": True},
                           "refused: DeepSpeed cannot read the file's settings: TypeError:"),
    "gas_text": ({"optimizer": ADAM_OPT, "gradient_accumulation_steps": "4"}, {"enabled": True},
                 "refused: 'gradient_accumulation_steps' must be an integer >= 1 (or \"auto\"), got '4'"),
    "stage2_with_auto_lr": ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                             "zero_optimization": {"stage": 2}}, {"enabled": True},
                            "refused: 'dgc.enabled' requires 'zero_optimization.stage' = 3, got 2"),
    "sgd_bad_momentum": ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": -1}}}, {"enabled": True},
                         "refused: 'optimizer.params' are refused by SGD: ValueError: Invalid momentum value: -1"),
    "sent_every_micro_step": ({"optimizer": ADAM_OPT, "gradient_accumulation_steps": 4},
                                   {"enabled": True, "compressed_momentum": {"freeze_step": 10}, "accumulate_locally": False},
                                   "refused: 'dgc.compressed_momentum' needs one send per optimizer step"),
    "lamb": ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, {"enabled": True},
             "ZeRO settings fit; the optimizer is not checked: 'Lamb' is one of DeepSpeed's own optimizers, which this "
             "check does not build (deepspeed.initialize checks it)"),
    "no_optimizer": ({}, {"enabled": True}, "ZeRO settings fit; the optimizer is not checked: the file has no "
                                            "'optimizer' section (an optimizer passed in code is checked at initialize)"),
    "auto": ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "bf16": {"enabled": "auto"}},
             {"enabled": True}, "ZeRO settings fit; the method against the optimizer is not checked: "
                                "'optimizer.params.lr' holds \"auto\" (filled in by the Trainer or Accelerate; "
                                "deepspeed.initialize checks it)"),
}


@pytest.mark.parametrize("case", list(JOB_CASES))
def test_check_command_checks_the_job_the_file_describes(case, tmp_path, capsys):
    """``check`` makes initialize's checks of the method against the optimizer the ``"optimizer"`` section builds
    (DeepSpeed's FusedAdam, CPU Adam, torch's classes), offload and the sends per step, and says what it leaves to
    initialize. (Every refusal of tests/distributed/test_engine.py's BAD table is compared with initialize's own
    message there.)"""
    from deepspeed_dgc.__main__ import main
    job, section, want = JOB_CASES[case]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, **job,
                                "dgc": section}))
    status = main(["check", str(path)])
    out = capsys.readouterr().out.splitlines()
    assert status == (1 if want.startswith("refused") else 0)
    assert out[-1].startswith(f"{path}: {want}"), out

