"""What the fork server of tests/dist_launch.py imports once for every rank it forks: torch, torch.distributed and
deepspeed (about 3 s of a fresh interpreter's start), and DeepSpeed's Muon optimizer module. Nothing of deepspeed_dgc
beyond what the installed start-up hook loads in any interpreter.

deepspeed.initialize imports the Muon module in every rank (``is_zero_supported_optimizer`` in
deepspeed/runtime/zero/utils.py, DeepSpeed 0.19.8), and that module's ``torch.compile`` pulls in torch._dynamo and
inductor: 2.6-4 s of each rank's CPU, paid in every launch. Imported here, it is paid once. It starts no thread, so the
server still forks from a single thread."""

import torch  # noqa: F401
import torch.distributed  # noqa: F401

import deepspeed  # noqa: F401
from deepspeed.runtime.zero.muon import muon_optimizer  # noqa: F401  (see above)
