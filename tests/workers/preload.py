"""What the fork server of tests/dist_launch.py imports once for every rank it forks: torch, torch.distributed and
deepspeed (about 3 s of a fresh interpreter's start). Nothing of deepspeed_dgc beyond what the installed start-up hook
loads in any interpreter."""

import torch  # noqa: F401
import torch.distributed  # noqa: F401

import deepspeed  # noqa: F401
