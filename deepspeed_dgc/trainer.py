"""``HybridTrainer``: a small facade over ``deepspeed.initialize`` with compression switched on.

Its names map onto the ``"dgc"`` keys of the DeepSpeed config:

=====================================  ==========================================================
HybridTrainer argument                 DeepSpeed config
=====================================  ==========================================================
``precision_policy="int4"``            ``dgc.quantization = "int4"`` (kept gradient values in INT4)
``precision_policy="fp8"``             ``dgc.quantization = "fp8_e4m3"`` (FP8 with group scales)
``topology="flat"``                    ``dgc.topology = "flat"``
``topology="hybrid_ring"``             ``dgc.topology = "hierarchical"`` (dense inside a node,
                                       compressed between nodes)
``sparse_threshold=<float in (0, 1]>`` ``dgc.density`` (fraction of each tensor's elements sent)
``sparse_threshold="auto"``            ``dgc.density = "auto"`` (adaptive density, energy budget)
``**deepspeed_config_overrides``       merged into the config (nested dicts merge key by key),
                                       e.g. ``train_micro_batch_size_per_gpu=16``,
                                       ``zero_optimization={"reduce_bucket_size": 500000}``,
                                       ``dgc={"weights": {"quantization": "int8"}}``
=====================================  ==========================================================

The base config is ZeRO-3 with ``dgc.enabled = true``; everything is validated by DeepSpeed and by
:func:`~deepspeed_dgc.config.parse_dgc_config` when :meth:`HybridTrainer.init_model` runs.
"""

import copy
from typing import Any, Callable, Dict, Optional, Union

import torch

from .config import DGCConfigError, parse_dgc_config
from .zero3.patches import activate

PRECISION_POLICIES = {"int4": "int4", "fp8": "fp8_e4m3"}
TOPOLOGIES = {"flat": "flat", "hybrid_ring": "hierarchical"}

BASE_CONFIG: Dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1_000_000,
    "zero_optimization": {"stage": 3},
    "dgc": {"enabled": True},
}


def _merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class HybridTrainer:
    """DeepSpeed ZeRO-3 with compressed gradient communication, configured by a few names.

    Args:
        precision_policy: ``"int4"`` or ``"fp8"`` (FP8 e4m3 with group scales) for the gradient values sent.
        topology: ``"flat"`` or ``"hybrid_ring"`` (the hierarchical topology).
        sparse_threshold: fraction of each tensor's elements sent per step, float in (0, 1], or ``"auto"``
            (``dgc.density = "auto"``: chosen per bucket from the gradient distribution). The default, 1.0, sends
            every element quantized with error feedback (stock's loss); below 1 is top-k, lossy with Adam.
        **deepspeed_config_overrides: top-level DeepSpeed config keys, merged into the base config.

    Raises:
        DGCConfigError: an unknown value, naming the argument and the allowed values; a
            ``dgc`` override of a key the named arguments set (``enabled``, ``quantization``,
            ``topology``, ``density``).

    Example::

        trainer = HybridTrainer(precision_policy="int4", topology="flat", sparse_threshold=1.0,
                                train_micro_batch_size_per_gpu=16,
                                optimizer={"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}})
        engine = trainer.init_model(model)
        for batch in loader:
            loss = trainer.train_step(batch, lambda model, b: F.cross_entropy(model(b[0]), b[1]))
    """

    def __init__(self,
                 precision_policy: str = "int4",
                 topology: str = "flat",
                 sparse_threshold: Union[str, float] = 1.0,
                 **deepspeed_config_overrides: Any):
        if precision_policy not in PRECISION_POLICIES:
            raise DGCConfigError(f"HybridTrainer: precision_policy must be one of {', '.join(PRECISION_POLICIES)}, got "
                                 f"{precision_policy!r}")
        if topology not in TOPOLOGIES:
            raise DGCConfigError(f"HybridTrainer: topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")
        if sparse_threshold != "auto" and (isinstance(sparse_threshold, bool) or not isinstance(
                sparse_threshold, (int, float)) or not (0.0 < float(sparse_threshold) <= 1.0)):
            raise DGCConfigError("HybridTrainer: sparse_threshold must be a float in (0, 1] (the fraction of each "
                                 f"tensor's elements sent) or 'auto', got {sparse_threshold!r}")
        dgc_override = deepspeed_config_overrides.get("dgc", {})
        if not isinstance(dgc_override, dict):
            raise DGCConfigError(f"HybridTrainer: dgc must be a dict of \"dgc\" keys, got {dgc_override!r}")
        clash = sorted(set(dgc_override) & {"enabled", "quantization", "topology", "density"})
        if clash:
            raise DGCConfigError(f"HybridTrainer: dgc override(s) {', '.join(clash)} clash with the named arguments "
                                 "(enabled is always true; use precision_policy, topology and sparse_threshold)")
        dgc = {"quantization": PRECISION_POLICIES[precision_policy], "topology": TOPOLOGIES[topology],
               "density": sparse_threshold if sparse_threshold == "auto" else float(sparse_threshold)}
        self.config = _merge(_merge(BASE_CONFIG, {"dgc": dgc}), deepspeed_config_overrides)
        parse_dgc_config(self.config)  # a bad "dgc" override fails here, naming the key
        self.engine = None

    def init_model(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None):
        """``deepspeed.initialize`` the model (collective: every rank calls it) and return the engine.

        Args:
            model: the ``torch.nn.Module`` to train.
            optimizer: a torch optimizer over ``model.parameters()``, or None to use the config's
                ``"optimizer"`` section (default: Adam, lr 1e-3, if the overrides give none).

        Returns:
            The ``DeepSpeedEngine`` (ZeRO-3, DGC on); also kept as ``self.engine``.
        """
        import deepspeed

        activate()  # the hook must be installed before initialize (idempotent)

        config = self.config
        if optimizer is None and "optimizer" not in config:
            config = _merge(config, {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}})
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                    model_parameters=[p for p in model.parameters() if p.requires_grad],
                                                    config=config)
        return self.engine

    def train_step(self, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> float:
        """One forward, backward and optimizer step.

        Args:
            batch: whatever ``loss_fn`` takes (tensors on ``self.engine.device``).
            loss_fn: ``loss_fn(model, batch) -> scalar loss tensor``; ``model`` is the engine (call it
                like the module).

        Returns:
            The loss as a Python float.

        Raises:
            RuntimeError: :meth:`init_model` was not called.
        """
        if self.engine is None:
            raise RuntimeError("HybridTrainer.train_step: call init_model(model) first")
        loss = loss_fn(self.engine, batch)
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())
