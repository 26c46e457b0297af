"""benchmarks/bench_kernels.py: a small real run (every row gives the reference's bytes, the JSON holds the table)
and its refusals of arguments it cannot run with."""

import json

import pytest

from benchmarks import bench_kernels as bk


def test_a_small_run_writes_the_table_and_same_bytes(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert bk.main(["--sizes", "2K", "--formats", "int4", "fp8_e5m2", "--densities", "0.01", "1", "--weight-formats",
                    "int8", "--repeats", "2", "--json", str(out)]) in (0, None)
    data = json.loads(out.read_text())
    assert [(r["format"], r["density"]) for r in data["rows"]] == [("int4", 0.01), ("fp8_e5m2", 0.01), ("int4", 1.0),
                                                                    ("fp8_e5m2", 1.0)]
    assert all(r["same_bytes"] and r["n"] == 2048 for r in data["rows"] + data["weight_rows"])
    assert all(r["fused_vs_clone"] == pytest.approx(r["ms"]["fused"] / r["ms"]["clone"]) for r in data["rows"])
    assert "| int4 | 0.01 | 2K |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "1K", "--world", "1025"], "more owner rows than the smallest size's 1024 elements"),
    (["--sizes", "1K", "--json", "/nonexistent-dir-of-this-test/x.json"], "no directory"),
    (["--sizes", "0"], "at least 1024"),
    (["--densities", "2"], "(0, 1]"),
])
def test_arguments_it_cannot_run_with_are_refused_before_running(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bk.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_size_labels():
    assert [bk.size_label(n) for n in (1 << 24, 512 << 10, 3 << 30, 1000)] == ["16M", "512K", "3G", "1000"]
