"""The main job through the three launchers of a multi-node job, at 2 and 4 ranks on this machine.

- ``deepspeed --num_gpus N`` (single-node launcher, sets LOCAL_SIZE);
- ``deepspeed --hostfile H --launcher openmpi --force_multi --no_ssh_check`` (a localhost hostfile);
- ``mpirun -np N python examples/train_char_gpt.py`` (DeepSpeed's MPI discovery).

No torch variable (RANK, WORLD_SIZE, MASTER_ADDR, ...) is preset for the MPI launches; each
rank reports its rank and the world size it found. 4 ranks run as 2 nodes of 2 with the
hierarchical topology; the MPI communicator carries the payloads in two of the three.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from dist_launch import ROOT, free_port, launch_mpirun, mpi_job_env, remove_shm_buffers
from .test_main_job import TINY_MODEL

STEPS = ["--max-steps", "24", "--eval-interval", "8"]
DISCOVERY_PORT = 29500  # DeepSpeed's MPI discovery always uses distributed_port (default 29500)

CASES = {  # (launcher, ranks): "dgc" overrides; each launcher once, each communicator flat or hierarchical once
    ("deepspeed", 4): {"topology": "hierarchical", "ranks_per_node": 2},
    ("hostfile", 2): {"comm_backend": "mpi"},
    ("mpirun", 4): {"comm_backend": "mpi", "topology": "hierarchical", "ranks_per_node": 2},
}


def run_launcher(launcher, world, overrides, summary):
    script = ["examples/train_char_gpt.py", "--deepspeed_config", "configs/zero3_dgc_int4_d01.json", *STEPS, *TINY_MODEL,
              "--summary-json", summary]
    for key, value in overrides.items():
        script += ["--dgc-set", f"{key}={json.dumps(value)}"]
    if launcher == "mpirun":
        return launch_mpirun(world, [sys.executable, *script], timeout_s=400, mpirun_args=["--map-by", "slot"])
    runner = [sys.executable, "-m", "deepspeed.launcher.runner"]
    port = free_port()
    if launcher == "deepspeed":
        cmd = runner + ["--num_gpus", str(world), "--master_port", str(port), *script]
    else:
        hostfile = os.path.join(os.path.dirname(summary), "hostfile")
        with open(hostfile, "w") as f:
            f.write(f"localhost slots={world}\n")
        cmd = runner + ["--hostfile", hostfile, "--launcher", "openmpi", "--force_multi", "--no_ssh_check",
                        "--master_addr", "127.0.0.1", "--launcher_args", "--oversubscribe --map-by slot", *script]
    try:
        return subprocess.run(cmd, cwd=ROOT, env=mpi_job_env(), capture_output=True, text=True, timeout=400)
    finally:
        remove_shm_buffers(port)
        remove_shm_buffers(DISCOVERY_PORT)


@pytest.mark.parametrize("launcher, world", list(CASES), ids=[f"{l}-{w}" for l, w in CASES])
def test_main_job_trains_under_launcher(launcher, world):
    overrides = CASES[(launcher, world)]
    summary = os.path.join(tempfile.mkdtemp(), "summary.json")
    proc = run_launcher(launcher, world, overrides, summary)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = re.findall(r"rank (\d+) of (\d+) \(local rank", proc.stdout)
    assert sorted(seen) == sorted((str(r), str(world)) for r in range(world)), seen
    s = json.load(open(summary))
    assert s["world_size"] == world and s["steps"] == 24 and s["skipped_steps"] == 0
    assert all(s["dgc"][k] == v for k, v in overrides.items())
    vals = [v for _, v in s["val_losses"]]
    assert vals[-1] < vals[0] - 0.2 and vals == sorted(vals, reverse=True), vals  # learning, from about ln(65) = 4.17
    stats = s["dgc_stats"]
    if overrides.get("topology") == "hierarchical":
        # dense inside a node, compressed between nodes: far fewer bytes cross nodes than stock's
        assert stats["grad_intra_node_wire_bytes_total"] > stats["grad_inter_node_wire_bytes_total"] > 0
        assert stats["grad_inter_node_dense_fp32_bytes_total"] > 5 * stats["grad_inter_node_wire_bytes_total"]
    else:  # one node: every byte stays inside it
        assert stats["grad_inter_node_wire_bytes_total"] == 0
        assert s["compression_ratio"] > 5
