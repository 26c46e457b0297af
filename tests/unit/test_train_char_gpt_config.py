"""examples/train_char_gpt.py's ``--dgc-set``: a key, a key of a section (dotted), a section given whole."""

import json
import os
import sys

import pytest

from examples.train_char_gpt import load_ds_config


def test_dgc_set_keys_sections_and_errors(tmp_path):
    path = tmp_path / "ds.json"
    base = {"optimizer": {"params": {"lr": 0.1}},
            "dgc": {"enabled": True, "decoupled_momentum": {"chunk": 64, "topk": 2, "quantization": "int2"}}}
    path.write_text(json.dumps(base))
    cfg = load_ds_config(str(path), None, ['decoupled_momentum.storage="int8"', "stats_interval=5"])
    assert cfg["dgc"]["decoupled_momentum"] == {"chunk": 64, "topk": 2, "quantization": "int2", "storage": "int8"}
    assert cfg["dgc"]["stats_interval"] == 5
    whole = load_ds_config(str(path), None, ['decoupled_momentum={"storage": "int8"}'])
    assert whole["dgc"]["decoupled_momentum"] == {"storage": "int8"}  # a section given whole replaces it
    new = load_ds_config(str(path), None, ['weights.quantization="int8"'])
    assert new["dgc"]["weights"] == {"quantization": "int8"}
    with pytest.raises(SystemExit, match="'dgc.enabled' is True, not a section"):
        load_ds_config(str(path), None, ["enabled.x=1"])
    with pytest.raises(SystemExit, match="an object's strings need quotes"):
        load_ds_config(str(path), None, ['decoupled_momentum={"storage": int8}'])
    with pytest.raises(SystemExit, match="strings need quotes: storage='\"int8\"'"):
        load_ds_config(str(path), None, ["storage=int8"])


def test_a_config_file_is_read_as_deepspeed_reads_it_and_a_bad_one_named(tmp_path):
    """The main job reads --deepspeed_config with read_ds_config (a key given twice refused as DeepSpeed refuses it; a
    file with a comment and a trailing comma, not JSON, read as hjson as DeepSpeed reads a path) and ends on one that
    cannot be read naming the file and what is wrong."""
    path = tmp_path / "ds.json"
    path.write_text('{\n  // a comment\n  "optimizer": {"params": {"lr": 0.1}},\n  "dgc": {"enabled": true,},\n}\n')
    assert load_ds_config(str(path), 0.5)["optimizer"]["params"]["lr"] == 0.5
    path.write_text('{"dgc": {"enabled": true}, "dgc": {"enabled": false}}')
    with pytest.raises(SystemExit, match=f"--deepspeed_config {path}: Duplicate keys in DeepSpeed config: \\['dgc'\\]"):
        load_ds_config(str(path), None)
    path.write_text("")
    with pytest.raises(SystemExit, match=f"--deepspeed_config {path}: the file is empty"):
        load_ds_config(str(path), None)
    with pytest.raises(SystemExit, match="No such file"):
        load_ds_config(str(tmp_path / "missing.json"), None)


def test_a_refused_dgc_setting_ends_the_job_with_one_line(monkeypatch, capfd):
    """A "dgc" value the extension refuses (here from --dgc-set) ends the main job before any launch work with exit
    status 1 and ``DGCConfigError: <the message, naming the key>`` on one line, not a traceback."""
    import examples.train_char_gpt as job
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                          "zero3_dgc_adam.json")
    monkeypatch.setattr(sys, "argv", ["train_char_gpt.py", "--deepspeed_config", config,
                                      "--dgc-set", "decoupled_momentum.lr_scale=-2"])
    with pytest.raises(SystemExit) as exit_:
        job.main()
    assert exit_.value.code == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("DGCConfigError: ") and "dgc.decoupled_momentum.lr_scale" in err[0], err
