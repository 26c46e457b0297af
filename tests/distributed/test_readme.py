"""README.md's quick start runs as written, on 2 real ranks."""

import json
import os

from dist_launch import check_ok, launch


def test_readme_quick_start_trains(tmp_path):
    check_ok(launch(2, "readme_worker.py", ["--out", str(tmp_path)], timeout_s=300))
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # the README prints the totals before training: nothing sent yet
        assert [float(v) for v in r["printed"].splitlines()[-1].split()] == [0, 0, 0], r["printed"]
        assert all(l == l for l in r["losses"]) and r["losses"][-1] < r["losses"][0], r["losses"]
        # "dgc": {"enabled": true} sends dense INT4 with group-wise scales: about 7.5x fewer bytes than fp32
        assert 6 < r["ratio"] < 8.5, r["ratio"]
    assert os.path.exists(tmp_path / "ds_config.json")
