"""The agreement check's pieces: the settings every rank must share, their digest, and the mismatch message."""

import hashlib
import json
import os
import subprocess
import sys

from deepspeed_dgc.comm.agreement import describe_mismatch, effective_settings, settings_digest
from deepspeed_dgc.config import DGCConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_settings_hold_every_key_and_the_versions():
    a = effective_settings(DGCConfig(enabled=True, topology="hierarchical"), 2)
    flat = effective_settings(DGCConfig(enabled=True), 4)
    assert a["dgc.weights.quantization"] == "none" and a["dgc.compressed_momentum"] is None
    assert {"deepspeed version", "torch version", "deepspeed_dgc version"} <= set(a)
    assert a["ranks per node (resolved)"] == 2
    assert "ranks per node (resolved)" not in flat  # flat only labels bytes with it
    assert len([k for k in flat if k.startswith("dgc.")]) == len(DGCConfig.model_fields) + 1  # weights: 2 keys


def test_digest_is_sha256_of_sorted_json_and_the_same_in_every_process():
    """The digest is the first 63 bits of SHA-256 of the settings as JSON with sorted keys (computed here
    independently), so processes with different hash seeds agree; a changed key changes it."""
    settings = effective_settings(DGCConfig(enabled=True, density=0.1), None)
    text = json.dumps(settings, sort_keys=True, default=str)
    expected = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
    assert settings_digest(settings) == expected
    code = ("from deepspeed_dgc.comm.agreement import effective_settings, settings_digest;"
            "from deepspeed_dgc.config import DGCConfig;"
            "print(settings_digest(effective_settings(DGCConfig(enabled=True, density=0.1), None)))")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=ROOT, PYTHONHASHSEED=seed))
        assert out.returncode == 0, out.stderr[-2000:]
        assert int(out.stdout.strip().splitlines()[-1]) == expected
    for key, value in (("density", 0.2), ("group_size", 64), ("weights", {"quantization": "int8"})):
        other = effective_settings(DGCConfig(enabled=True, **{"density": 0.1, key: value}), None)
        assert settings_digest(other) != expected, key


def test_mismatch_names_each_differing_key_and_the_ranks():
    a = effective_settings(DGCConfig(enabled=True, topology="hierarchical"), 2)
    b = effective_settings(DGCConfig(enabled=True, topology="hierarchical", weights={"quantization": "int8"}), 4)
    msg = describe_mismatch([a, a, b])
    assert "'dgc.weights.quantization' is 'none' on rank 0 but 'int8' on rank(s) [2]" in msg
    assert "'ranks per node (resolved)' is 2 on rank 0 but 4 on rank(s) [2]" in msg
    assert "dgc.density" not in msg
