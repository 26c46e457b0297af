"""Worker: run a list of scenario jobs in turn in this rank and save each record.

Usage: scenario_worker.py --out DIR. DIR/jobs.pt holds the jobs (dataclasses of :mod:`scenarios`, saved by
``dist_launch.run_scenarios``, or ``dist_launch.save_jobs``); the record of job i on rank r goes to DIR/rank<r>_<i>.pt.
One launch runs several cases, so the start-up of the ranks is paid once. Started by ``mpirun`` (as
``dist_launch.run_scenarios_mpirun`` does), the ranks come from Open MPI's variables (``common.init``).
"""

import argparse
import sys

import torch

from common import finish, init
from scenarios import run_job


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    jobs = torch.load(f"{args.out}/jobs.pt", weights_only=False)
    rank = init()
    for i, job in enumerate(jobs):
        torch.save(run_job(job, rank), f"{args.out}/rank{rank}_{i}.pt")
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
