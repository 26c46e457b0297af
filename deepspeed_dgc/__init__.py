"""deepspeed_dgc: dynamic gradient compression for DeepSpeed ZeRO-3.

``import deepspeed_dgc`` before ``deepspeed.initialize`` and add a top-level ``"dgc"`` section to ds_config;
ZeRO-3's gradient reduce-scatter then sends top-k sparsified, quantized gradients with error feedback
(Lin et al., "Deep Gradient Compression", ICLR 2018). The package by role:

- :mod:`.codec`: what goes on the wire (selection, value formats, positions, the payload format, the ops);
- :mod:`.memory`: what each rank keeps between steps (error feedback, local momentum states);
- :mod:`.comm`: moving bytes between ranks (communicators, topology, agreement);
- :mod:`.zero3`: the seam with DeepSpeed ZeRO-3 (patches, reduce-scatter, all-gather, owners' steps, checkpoints);
- :mod:`.config` (the ``"dgc"`` section), :mod:`.telemetry`, :mod:`.trainer` (``HybridTrainer``).
"""

from ._version import __version__
from .codec.kernels import DGCKernelError
from .codec.wire import DGCProtocolError
from .comm.communicators import DGCBackendError, DGCCommError, DGCTimeoutError
from .config import DGCConfig, DGCConfigError, parse_dgc_config, read_ds_config
from .trainer import HybridTrainer
from .zero3.patches import DGCSeamError, activate, deactivate, install, uninstall
from .zero3.ds_api import DGCStateError
from .zero3.state import get_stats

activate()

__all__ = ["DGCBackendError", "DGCCommError", "DGCConfig", "DGCConfigError", "DGCKernelError", "DGCProtocolError",
           "DGCSeamError", "DGCStateError", "DGCTimeoutError", "HybridTrainer", "activate", "deactivate", "get_stats", "install",
           "parse_dgc_config", "read_ds_config", "uninstall", "__version__"]
