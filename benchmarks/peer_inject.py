"""A ``"dgc"`` section in every ZeRO-3 config of DeepSpeed's own unit tests (``make peer-tests``, issue 51 item 4).

Two halves, both switched on by environment variables that ``benchmarks.peer_tests`` sets for each pytest run of the
vendored tests (``peer/deepspeed_tests``):

- :func:`install` wraps ``deepspeed.initialize`` in the process that calls it (the vendored ``unit/common.py`` calls
  it on import, so in pytest's process and in every rank the tests spawn). ``DGC_PEER_SECTION`` names the section:
  ``stock`` (nothing injected, only recorded), ``enabled`` (``{"enabled": true}``), ``recommended`` (the ``"dgc"``
  section of ``configs/zero3_dgc_adam.json``, read when the wrapper is installed) or ``discover`` (stock, and the
  test is skipped at its first ZeRO-3 ``initialize``: finding which tests build one takes seconds per test). Every
  config that reaches ``initialize`` (a dict, a path, ``config``/``config_params`` or ``args.deepspeed_config``) and
  has ``zero_optimization.stage`` 3 gets the section, and one JSON line goes to ``DGC_PEER_LOG`` (with the error, if
  ``initialize`` raised one: a test that turns an initialize error into a skip still shows the refusal). With
  ``enabled`` or ``recommended``, ``deepspeed_dgc`` is imported first. Without ``DGC_PEER_SECTION`` nothing happens.
- the pytest hooks (``-p benchmarks.peer_inject``) write one JSON line per test to ``DGC_PEER_RESULTS``: a ``start``
  line when it starts (the runner's per-test timeout watches those) and its record when it ends: outcome, duration,
  the exception's type and message, and the injection lines the test's processes wrote meanwhile.
"""

import copy
import functools
import inspect
import json
import os
import re
import socket
import time
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECOMMENDED_CONFIG = ROOT / "configs" / "zero3_dgc_adam.json"
SECTION_ENV = "DGC_PEER_SECTION"
LOG_ENV = "DGC_PEER_LOG"
RESULTS_ENV = "DGC_PEER_RESULTS"
PORTS_ENV = "DGC_PEER_PORTS"
PRELOAD_ENV = "DGC_PEER_PRELOAD"
SECTIONS = ("stock", "enabled", "recommended")  # what the runner compares; "discover" selects the tests
DISCOVER = "discover"
MESSAGE_CHARS = 2000
STAGE_PARAMS = ("zero_stage", "stage")  # the ZeRO stage a test is parametrized with, by DeepSpeed's names


def dgc_section(name: str):
    """The ``"dgc"`` section a section name stands for (None: inject nothing)."""
    if name in ("stock", DISCOVER):
        return None
    if name == "enabled":
        return {"enabled": True}
    if name == "recommended":
        return json.loads(RECOMMENDED_CONFIG.read_text())["dgc"]
    raise ValueError(f"{SECTION_ENV}={name!r}: expected one of {SECTIONS + (DISCOVER,)}")


def zero_stage(config) -> object:
    """``zero_optimization.stage`` of a config dict (None where it has none)."""
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    return zero.get("stage") if isinstance(zero, dict) else None


def with_section(config: dict, section) -> dict:
    """``config`` with ``"dgc": section`` where it is a ZeRO-3 config (a copy; the caller's dict is left alone)."""
    if section is None or zero_stage(config) != 3:
        return config
    config = copy.deepcopy(config)
    config["dgc"] = copy.deepcopy(section)
    return config


def _load(config):
    if isinstance(config, dict) or config is None:
        return config
    if os.path.exists(config):
        with open(config) as f:
            return json.load(f)
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config  # a JSON or base64 string
    return load_ds_config(config)


def _append(env: str, line: str) -> None:
    """One line to the file the environment variable ``env`` names (none: nothing). One short ``O_APPEND`` write:
    the lines of the ranks and of pytest's process do not interleave."""
    path = os.environ.get(env)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _log(record: dict) -> None:
    _append(LOG_ENV, json.dumps(record))


def free_port() -> int:
    """A port of 127.0.0.1 the OS picks (the vendored ``get_master_port``), appended to ``DGC_PEER_PORTS``: the
    runner deletes DeepSpeed's shared-memory files named after it (``/dev/shm/deepspeed_allreduce_buffer_*``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _append(PORTS_ENV, str(port))
    return port


def _where(exc: BaseException) -> str:
    """Where ``exc`` was raised: the last frame of a rank's traceback (multiprocessing hands it over as the text of
    the ``__cause__``), else of its own; ``file:line: source``."""
    remote = getattr(exc.__cause__, "tb", None)
    if isinstance(remote, str):
        frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', remote)
        if frames:
            path, line, source = frames[-1]
            return f"{os.path.basename(path)}:{line}: {source.strip()}"
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}: {frames[-1].line}" if frames else ""


def _error(exc: BaseException) -> dict:
    cls = type(exc)
    return {"type": f"{cls.__module__}.{cls.__qualname__}", "message": str(exc)[:MESSAGE_CHARS], "where": _where(exc)}


def wrap_initialize(initialize, section_name: str):
    """``deepspeed.initialize`` that injects the named section into a ZeRO-3 config and logs each call."""
    section = dgc_section(section_name)
    signature = inspect.signature(initialize)

    @functools.wraps(initialize)
    def peer_initialize(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments
        ds_args = given.get("args")
        from_args = getattr(ds_args, "deepspeed_config", None) is not None
        source = "args.deepspeed_config" if from_args else "config" if given.get("config") is not None else (
            "config_params" if given.get("config_params") is not None else None)
        config = _load(getattr(ds_args, "deepspeed_config") if from_args else given.get(source) if source else None)
        stage3 = zero_stage(config) == 3
        if stage3 and section is not None:
            config = with_section(config, section)
            if from_args:
                given["args"] = copy.copy(ds_args)  # the test's args keep their path
                given["args"].deepspeed_config = config
            else:
                given[source] = config
        record = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "section": section_name, "source": source,
                  "stage": zero_stage(config), "injected": stage3 and section is not None}
        if stage3 and section_name == DISCOVER:
            _log(record)
            pytest.skip("peer-tests discover: builds a ZeRO-3 config")
        try:
            result = initialize(*bound.args, **bound.kwargs)
        except BaseException as exc:
            _log({**record, "error": _error(exc)})
            raise
        _log(record)
        return result

    peer_initialize._dgc_peer = section_name
    return peer_initialize


def install() -> None:
    """Wrap ``deepspeed.initialize`` as ``DGC_PEER_SECTION`` says (once per process; unset: nothing)."""
    name = os.environ.get(SECTION_ENV)
    if not name:
        return
    import deepspeed
    if getattr(deepspeed.initialize, "_dgc_peer", None) is not None:
        return
    if dgc_section(name) is not None:
        import deepspeed_dgc  # noqa: F401 -- patches DeepSpeed, in every rank
    deepspeed.initialize = wrap_initialize(deepspeed.initialize, name)


# ---- pytest hooks (the runner passes -p benchmarks.peer_inject) ------------------------------------------------------

_tests = {}


def _results(record: dict) -> None:
    _append(RESULTS_ENV, json.dumps(record))


def _log_size() -> int:
    path = os.environ.get(LOG_ENV)
    return os.path.getsize(path) if path and os.path.exists(path) else 0


def _log_since(offset: int) -> list:
    path = os.environ.get(LOG_ENV)
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        f.seek(offset)
        return [json.loads(line) for line in f if line.strip()]


def pytest_configure(config):
    install()  # tests that run in pytest's own process (not DistributedTest) call initialize here
    if os.environ.get(PRELOAD_ENV, "1") != "0":
        # DistributedTest forks its ranks from multiprocessing's fork server: with DeepSpeed imported there once, a
        # rank does not import it again (seconds of CPU per rank and test on 2 cores); nothing of deepspeed_dgc
        import multiprocessing
        multiprocessing.set_forkserver_preload(["deepspeed"])


def pytest_collection_finish(session):
    if session.config.option.collectonly:  # the runner's --discover lists the tests this way
        for item in session.items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            stage = next((v for k, v in params.items() if k in STAGE_PARAMS and isinstance(v, int)), None)
            _results({"event": "collected", "nodeid": item.nodeid, "stage_param": stage})


def pytest_runtest_logstart(nodeid, location):
    _tests[nodeid] = {"nodeid": nodeid, "outcome": "passed", "start": time.time(), "log_offset": _log_size()}
    _results({"event": "start", "nodeid": nodeid, "time": _tests[nodeid]["start"]})


def _first_error(report) -> dict:
    excinfo = getattr(report, "_peer_excinfo", None)
    if excinfo is None:
        return {"type": None, "message": str(report.longrepr)[-MESSAGE_CHARS:]}
    return _error(excinfo.value)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None:
        report._peer_excinfo = call.excinfo


def pytest_runtest_logreport(report):
    test = _tests.get(report.nodeid)
    if test is None:
        return
    if report.skipped and test["outcome"] == "passed":
        test["outcome"] = "skipped"
        longrepr = report.longrepr
        test["skip_reason"] = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    elif report.failed and test["outcome"] != "failed":
        test["outcome"] = "failed"
        test["when"] = report.when
        test["error"] = _first_error(report)
    if report.when == "teardown":
        test["duration"] = round(time.time() - test.pop("start"), 2)
        test["injections"] = _log_since(test.pop("log_offset"))
        _results({"event": "end", **test})
