"""benchmarks/profile_step.py: the breakdown of a profile into sections, on a profile of known functions."""
import cProfile
import importlib.util
import time
from pathlib import Path

import pytest

from benchmarks import profile_step as ps


def _module(path: Path, source: str):
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem + "_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sections_take_the_cumulative_time_of_the_named_functions(tmp_path):
    # stand-ins named as DeepSpeed's and the package's functions: a stock-path step spending known times
    stage3 = _module(tmp_path / "stage3.py", "import time\n"
                     "def __avg_scatter_grads():\n    time.sleep(0.05)\n"
                     "def step():\n    time.sleep(0.03)\n")
    comm = _module(tmp_path / "communicators.py", "import time\ndef _wait():\n    time.sleep(0.02)\n")
    params = _module(tmp_path / "partition_parameters.py", "import time\ndef wait():\n    time.sleep(0.01)\n")
    profiler = cProfile.Profile()
    profiler.enable()
    getattr(stage3, "__avg_scatter_grads")()
    comm._wait()
    params.wait()
    stage3.step()
    time.sleep(0.04)  # the rest
    profiler.disable()
    profiler.dump_stats(tmp_path / "p.prof")
    b = ps.breakdown(tmp_path / "p.prof")
    s = b["sections_s"]
    assert s["gradient reduce-scatter"] == pytest.approx(0.05, abs=0.01)
    assert s["  of which waiting on the exchange"] == pytest.approx(0.02, abs=0.01)
    assert s["weight all-gather: wait"] == pytest.approx(0.01, abs=0.005)
    assert s["optimizer step"] == pytest.approx(0.03, abs=0.01)
    assert s["  of which codec: encode"] == 0.0
    # the rest: the total less the top-level sections (the nested "of which" lines are not subtracted again)
    assert b["rest_s"] == pytest.approx(b["profiled_step_s"] - 0.05 - 0.01 - 0.03, abs=0.01)
    assert b["rest_s"] > 0.03
    table = ps.markdown({"x": dict(b, step_s=0.2)}, {"command": "c", "date": "d", "machine": "m", "commit": "h",
                                                    "n_params": 10, "steps": 10, "profile_step": 8})
    assert "| gradient reduce-scatter | 0.05" in table


@pytest.mark.parametrize("argv, message", [(["--configs", "ddp_powersgd"], "not ZeRO-3"),
                                           (["--configs", "nope"], "unknown"),
                                           (["--profile-step", "3"], "must be 5 to"),
                                           (["--steps", "8", "--profile-step", "8"], "must be 5 to"),
                                           (["--steps", "0"], "--steps must be >= 1"),
                                           (["--steps", "4"], "at least 6"),
                                           (["--micro-batch", "0"], "--micro-batch must be >= 1"),
                                           (["--launch-timeout-s", "nan"], "must be > 0")])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        ps.parse_args(argv)
    assert message in capsys.readouterr().err
