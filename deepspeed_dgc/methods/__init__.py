"""The methods of reducing a bucket, one class each behind one interface (:mod:`.base`), registered by name:

- :mod:`.topk`: top-k (or every element) of the gradient with error feedback, exact or fixed layout;
- :mod:`.decoupled`: DeMo's decoupled momentum (chunked DCT top-k);
- :mod:`.shared_mask`: owner-chosen shared masks, after SCAPE;
- :mod:`.compressed_momentum`, :mod:`.momentum_correction`: a local momentum sent through the top-k codec;
- :mod:`.hierarchical`: the two-hop topology around any of them.
"""

from . import compressed_momentum, decoupled, momentum_correction, shared_mask, topk  # noqa: F401 (registration)
from .base import METHODS, Bucket, Exchange, GradientMethod, Reduced, method_name, register
from .hierarchical import Hierarchical


def build(reducer, device_type: str) -> GradientMethod:
    """The method for ``reducer``'s config on ``device_type``, wrapped by the hierarchical topology when it asks."""
    from .base import build as _build
    return _build(reducer, device_type, Hierarchical if reducer.cfg.topology == "hierarchical" else None)


__all__ = ["METHODS", "Bucket", "Exchange", "GradientMethod", "Hierarchical", "Reduced", "build", "method_name",
           "register"]
