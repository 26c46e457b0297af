"""deepspeed_dgc: dynamic gradient compression for DeepSpeed ZeRO-3.

``import deepspeed_dgc`` before ``deepspeed.initialize`` and add a top-level ``"dgc"`` section
to ds_config; ZeRO-3's gradient reduce-scatter then sends top-k sparsified, INT4-quantized
gradients with error feedback (Lin et al., "Deep Gradient Compression", ICLR 2018).
"""

__version__ = "0.1.0"

from .comm import DGCBackendError, DGCCommError, DGCTimeoutError  # noqa: E402
from .config import DGCConfig, DGCConfigError, parse_dgc_config  # noqa: E402
from .integration import DGCSeamError, activate, get_stats  # noqa: E402
from .kernels import DGCKernelError  # noqa: E402
from .trainer import HybridTrainer  # noqa: E402

activate()

__all__ = ["DGCBackendError", "DGCCommError", "DGCConfig", "DGCConfigError", "DGCKernelError", "DGCSeamError", "DGCTimeoutError", "HybridTrainer", "get_stats", "parse_dgc_config", "__version__"]
