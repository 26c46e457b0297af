"""``make peer-tests`` (benchmarks.peer_inject, benchmarks.peer_tests): the injection into DeepSpeed's test configs, the
per-test records with their timeout, and the classification against the stock run (no DeepSpeed rank started)."""

import argparse
import json
import textwrap

from benchmarks import peer_inject, peer_tests
from benchmarks.peer_inject import dgc_section, with_section, wrap_initialize
from benchmarks.peer_tests import build_report, classify, markdown

ZERO3 = {"train_batch_size": 2, "zero_optimization": {"stage": 3}}


def fake_initialize(args=None, model=None, optimizer=None, config=None, config_params=None):
    return args, config, config_params


def test_sections():
    assert dgc_section("stock") is None and dgc_section("discover") is None
    assert dgc_section("enabled") == {"enabled": True}
    recommended = json.loads((peer_inject.ROOT / "configs" / "zero3_dgc_adam.json").read_text())["dgc"]
    assert dgc_section("recommended") == recommended and recommended["enabled"]
    stage2 = {"zero_optimization": {"stage": 2}}
    assert with_section(stage2, {"enabled": True}) is stage2 and with_section({}, {"enabled": True}) == {}
    injected = with_section(ZERO3, {"enabled": True})
    assert injected["dgc"] == {"enabled": True} and "dgc" not in ZERO3


def test_every_way_a_config_reaches_initialize(tmp_path, monkeypatch):
    log = tmp_path / "initialize.jsonl"
    monkeypatch.setenv(peer_inject.LOG_ENV, str(log))
    init = wrap_initialize(fake_initialize, "enabled")
    assert init(config=ZERO3)[1]["dgc"] == {"enabled": True}
    assert init(None, None, None, ZERO3)[1]["dgc"] == {"enabled": True}  # positionally
    assert init(config_params=ZERO3)[2]["dgc"] == {"enabled": True}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO3))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    got_args, config, _ = init(args=args)
    assert got_args.deepspeed_config["dgc"] == {"enabled": True} and config is None
    assert args.deepspeed_config == str(path)  # the test's own args are left alone
    stage1 = {"zero_optimization": {"stage": 1}}
    assert init(config=stage1)[1] is stage1
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(c["source"], c["stage"], c["injected"]) for c in calls] == [
        ("config", 3, True), ("config", 3, True), ("config_params", 3, True), ("args.deepspeed_config", 3, True),
        ("config", 1, False)]
    assert wrap_initialize(fake_initialize, "stock")(config=ZERO3)[1] is ZERO3


def test_an_initialize_error_is_logged(tmp_path, monkeypatch):
    log = tmp_path / "initialize.jsonl"
    monkeypatch.setenv(peer_inject.LOG_ENV, str(log))

    def refusing(config=None):
        raise ValueError("no")

    try:
        wrap_initialize(refusing, "recommended")(config=ZERO3)
    except ValueError:
        pass
    call = json.loads(log.read_text())
    where = f'test_peer_tests.py:{refusing.__code__.co_firstlineno + 1}: raise ValueError("no")'
    assert call["error"] == {"type": "builtins.ValueError", "message": "no", "where": where} and call["injected"]


FAKE_TESTS = '''
    import time


    class DGCConfigError(ValueError):
        pass


    DGCConfigError.__module__ = "deepspeed_dgc.config"  # as deepspeed_dgc's, without importing DeepSpeed here


    def test_pass():
        pass


    def test_refused():
        raise DGCConfigError("'dgc.decoupled_momentum' with 'zero_optimization.offload_optimizer': refused")


    def test_key_error():
        raise KeyError("exp_avg")


    def test_hangs():
        time.sleep(60)


    def test_after():
        pass
'''


def test_records_timeout_and_classes(tmp_path, monkeypatch):
    """A fake test file through the runner (pytest with the recording plugin, a 3 s timeout), then the classes."""
    root = tmp_path / "tests"
    root.mkdir()
    (root / "test_fake.py").write_text(textwrap.dedent(FAKE_TESTS))
    env = peer_tests.pytest_env

    def without_deepspeed(*args):  # no DGC_PEER_SECTION: the plugin records, installs nothing, imports no DeepSpeed
        out = env(*args)
        out.pop(peer_inject.SECTION_ENV)
        return out

    monkeypatch.setattr(peer_tests, "pytest_env", without_deepspeed)
    names = ["test_pass", "test_refused", "test_key_error", "test_hangs", "test_after"]
    ids = [f"test_fake.py::{name}" for name in names]
    with open(tmp_path / "log", "w") as log:
        setup = peer_tests.Setup(tests_root=root, out_dir=tmp_path, timeout=3)
        records = peer_tests.run_pytest(ids, "recommended", setup, log)
    outcome = {nodeid.split("::")[1]: (r["outcome"], (r.get("error") or {}).get("type")) for nodeid, r in
               records.items()}
    assert outcome == {"test_pass": ("passed", None), "test_refused": ("failed", "deepspeed_dgc.config.DGCConfigError"),
                       "test_key_error": ("failed", "builtins.KeyError"), "test_hangs": ("failed", "timeout"),
                       "test_after": ("passed", None)}

    stock = {nodeid: {"nodeid": nodeid, "outcome": "passed"} for nodeid in ids}
    skipped_on_refusal = {"nodeid": "x", "outcome": "skipped", "skip_reason": "Could not initialize deepspeed",
                          "injections": [{"error": {"type": "deepspeed_dgc.config.DGCConfigError", "message": "m"}}]}
    assert classify({"outcome": "passed"}, skipped_on_refusal) == {
        "class": "refused", "type": "deepspeed_dgc.config.DGCConfigError", "message": "m"}
    assert classify({"outcome": "skipped"}, {"outcome": "skipped"}) == {"class": "unchanged"}
    both_fail = classify({"outcome": "failed", "error": {"type": "builtins.AssertionError", "message": "m"}},
                         {"outcome": "failed", "error": {"type": "builtins.KeyError", "message": "'step'"}})
    assert both_fail["class"] == "unchanged" and both_fail["type"] == "builtins.KeyError" and both_fail["note"]
    assert classify({"outcome": "passed"}, {"outcome": "skipped", "skip_reason": "r"})["class"] == "failed"
    results = {"stock": stock, "recommended": records}
    whole = build_report(results, ids)
    report = whole["sections"]["recommended"]
    meta = {"ids": ids, "runs": {}, "deepspeed_commit": "edaa72212", "deepspeed": "0.19.8", "torch": "2.13.0",
            "local_size": 4, "machine": "2 CPU cores", "timeout": "3"}
    text = markdown(whole, results, meta)
    assert "| recommended | 5 | 2 | 1 | 2 |" in text and "## recommended: refused (1)" in text
    assert f"| `{ids[2]}` | passed | `builtins.KeyError` | 'exp_avg' |" in text
    classes = {nodeid.split("::")[1]: t["class"] for nodeid, t in report["tests"].items()}
    assert classes == {"test_pass": "unchanged", "test_refused": "refused", "test_key_error": "failed",
                       "test_hangs": "failed", "test_after": "unchanged"}
    assert report["counts"] == {"unchanged": 2, "refused": 1, "failed": 2}
    assert "Why the" not in text  # no known cause among the fake failures
    monkeypatch.setitem(peer_tests.WHY_FAILED, "test_fake.py::test_key", "a known cause")
    assert "Why the 1 of `test_fake.py::test_key` fail: a known cause." in markdown(whole, results, meta)
    assert report["tests"][ids[1]]["message"].startswith("'dgc.decoupled_momentum'")
    assert report["tests"][ids[2]]["message"] == "'exp_avg'"
    line = textwrap.dedent(FAKE_TESTS).splitlines().index('    raise KeyError("exp_avg")') + 1
    assert report["tests"][ids[2]]["where"] == f'test_fake.py:{line}: raise KeyError("exp_avg")'
