"""examples/train_char_gpt.py's ``--dgc-set``: a key, a key of a section (dotted), a section given whole."""

import json

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
