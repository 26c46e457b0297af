"""The top-level ``"dgc"`` section of a DeepSpeed config, as a pydantic model.

DeepSpeed keeps an unknown top-level key in the raw config dict and ignores it, so
the section is parsed and validated here, in DeepSpeed's own pydantic style
(``extra="forbid"``: an unknown or misspelled key is an error naming the key).
"""

from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DGC_SECTION = "dgc"


class DGCConfigError(ValueError):
    """A ``"dgc"`` section that is invalid on its own or clashes with the rest of ds_config."""


class WeightsConfig(BaseModel):
    """Compression of ZeRO-3's parameter all-gather (``"dgc": {"weights": {...}}``).

    - ``quantization`` (``"none"``, ``"int8"``, ``"fp8_e4m3"`` or ``"int4"``, default ``"none"``):
      format of the gathered copy of the weights; master weights and stored shards stay exact.
      ``"none"`` gathers as stock (bytes are still counted).
    - ``group_size`` (even int >= 2, default 256): weights per fp32 absmax scale.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    quantization: Literal["none", "int8", "fp8_e4m3", "int4"] = "none"
    group_size: int = Field(256, ge=2, le=1 << 20, multiple_of=2)


class DGCConfig(BaseModel):
    """Settings of dynamic gradient compression for the ZeRO-3 reduce-scatter.

    Keys (all under the top-level ``"dgc"`` key of ds_config):

    - ``enabled`` (bool, default false): replace ZeRO-3's gradient reduce-scatter.
    - ``density`` (float in (0, 1], default 0.01): fraction of each tensor's elements kept
      by top-k selection each micro-step (DGC, Lin et al. 2018, section 2).
      ``1.0`` sends every element (dense).
    - ``quantization`` (``"int4"`` or ``"none"``, default ``"int4"``): format of the kept values.
      ``"int4"`` is symmetric group-wise quantization with absmax scales; ``"none"`` sends them
      in the communication dtype.
    - ``group_size`` (int >= 2, even, default 128): kept values per INT4 scale group.
    - ``error_feedback`` (bool, default true): carry what was not sent (unselected values and
      quantization error) to the next micro-step.
    - ``min_numel`` (int >= 0, default 2048): tensors with fewer elements are not sparsified:
      they are sent whole (still quantized, with error feedback) and need no indices.
    - ``stats_interval`` (int >= 1, default 100): optimizer steps between telemetry log lines.
    - ``weights`` (:class:`WeightsConfig`): quantized parameter all-gather.
    - ``comm_backend`` (``"torch"`` or ``"mpi"``, default ``"torch"``): who moves the compressed
      payloads: ``deepspeed.comm`` (NCCL/gloo) or mpi4py (the job must be started by ``mpirun``
      or the deepspeed launcher's ``--launcher openmpi``). Both give bit-identical results.
    - ``topology`` (``"flat"`` or ``"hierarchical"``, default ``"flat"``): ``"hierarchical"``
      reduces densely inside a node (fast link) and compresses only between nodes (ZeRO++ qgZ's
      two hops, arXiv 2306.10209 section 4.2), with error feedback on the node-level sums.
    - ``ranks_per_node`` (int >= 1 or null, default null): ranks per node; null takes it from the
      launcher (``LOCAL_SIZE``, ``OMPI_COMM_WORLD_LOCAL_SIZE``) or else from host names.
      Ranks ``k*ranks_per_node ... (k+1)*ranks_per_node - 1`` form node k.
    - ``timeout_s`` (float in [0.001, 604800], default 600): bound, in seconds, on every collective
      of the extension; a rank whose peer died or hangs raises ``DGCTimeoutError`` instead of waiting.
    - ``kernels`` (``"auto"``, ``"fused"`` or ``"reference"``, default ``"auto"``): who compresses.
      ``"auto"`` uses the fused op (C++/OpenMP on CPU, CUDA on GPU; prebuilt, or JIT-built on first
      use) where it loads and else the PyTorch reference, with a one-time warning saying why;
      ``"fused"`` fails at initialize when the op cannot load. Both give the same bytes and residuals.
      The fused ops code INT4 payloads only (``quantization: "none"`` always runs the reference).

    ``density: 1.0`` with ``quantization: "none"`` is the lossless mode: bit-identical to stock
    ZeRO-3 at 2 ranks.
    """

    # strict: "0.5", true or 1 for a float/bool key is an error, never a silent coercion
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = False
    density: float = Field(0.01, gt=0.0, le=1.0, allow_inf_nan=False)
    quantization: Literal["int4", "none"] = "int4"
    group_size: int = Field(128, ge=2, le=1 << 20, multiple_of=2)
    error_feedback: bool = True
    min_numel: int = Field(2048, ge=0)
    stats_interval: int = Field(100, ge=1)
    weights: WeightsConfig = WeightsConfig()
    comm_backend: Literal["torch", "mpi"] = "torch"
    topology: Literal["flat", "hierarchical"] = "flat"
    ranks_per_node: Optional[int] = Field(None, ge=1)
    # at least 1 ms: gloo counts in whole milliseconds and takes 0 as "wait forever"
    timeout_s: float = Field(600.0, ge=0.001, le=7 * 24 * 3600.0, allow_inf_nan=False)
    kernels: Literal["auto", "fused", "reference"] = "auto"

    @model_validator(mode="after")
    def _fused_needs_int4(self):
        if self.kernels == "fused" and self.quantization != "int4":
            raise ValueError("'dgc.kernels' = \"fused\" needs 'dgc.quantization' = \"int4\" (the fused ops code INT4 "
                             "payloads only); use \"auto\" or \"reference\" with quantization \"none\"")
        return self

    @property
    def lossless(self) -> bool:
        """True when nothing is dropped or rounded: density 1 and no quantization."""
        return self.density >= 1.0 and self.quantization == "none"


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in (DGC_SECTION, ) + tuple(e["loc"]))
        if e["type"] == "extra_forbidden":
            model = WeightsConfig if e["loc"][:1] == ("weights", ) else DGCConfig
            allowed = ", ".join(model.model_fields)
            lines.append(f"unknown key '{key}' (allowed keys: {allowed})")
        else:
            lines.append(f"invalid value for '{key}': {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def parse_dgc_config(ds_config: Mapping[str, Any]) -> Optional[DGCConfig]:
    """Read the ``"dgc"`` section of a ds_config dict.

    Args:
        ds_config: the whole DeepSpeed config as a dict (``engine.config``).

    Returns:
        The parsed :class:`DGCConfig`, or None when the section is absent.

    Raises:
        DGCConfigError: the section is not a dict (``null`` included), has an unknown key, a value
            of the wrong JSON type (types are strict: ``"0.5"`` or ``true`` is not a density) or out of range;
            the message names the key (e.g. ``dgc.densty``) and the allowed keys or values.
    """
    if ds_config is None or DGC_SECTION not in ds_config:
        return None
    section = ds_config[DGC_SECTION]
    if not isinstance(section, Mapping):
        raise DGCConfigError(f"'{DGC_SECTION}' must be a JSON object, got {type(section).__name__}")
    try:
        return DGCConfig(**section)
    except ValidationError as err:
        raise DGCConfigError(f"invalid ds_config section '{DGC_SECTION}': " + _format_validation_error(err)) from None


def check_engine_compatible(cfg: DGCConfig, engine) -> None:
    """Reject DeepSpeed settings that the compressed reduce-scatter cannot serve.

    Args:
        cfg: an enabled DGC config.
        engine: the ``DeepSpeedEngine`` being initialized.

    Raises:
        DGCConfigError: ZeRO stage is not 3, ``zero_optimization.reduce_scatter`` is false
            (stock then uses an all-reduce path we do not replace),
            ``zero_optimization.zero_quantized_gradients`` is true (qgZ would compete for the
            same collective), or weight compression is combined with ``zero_quantized_weights``
            or ``zero_quantized_nontrainable_weights``.
    """
    stage = engine.zero_optimization_stage()
    if stage != 3:
        raise DGCConfigError(f"'dgc.enabled' requires 'zero_optimization.stage' = 3, got {stage}")
    if not engine.zero_reduce_scatter():
        raise DGCConfigError("'dgc.enabled' requires 'zero_optimization.reduce_scatter' = true (got false)")
    if cfg.weights.quantization != "none":
        if engine.zero_quantized_weights():
            raise DGCConfigError("'dgc.weights.quantization' cannot be combined with 'zero_optimization.zero_quantized_weights' "
                                 "= true: both quantize the parameter all-gather; disable one of them")
        if engine.zero_quantized_nontrainable_weights():
            raise DGCConfigError("'dgc.weights.quantization' cannot be combined with "
                                 "'zero_optimization.zero_quantized_nontrainable_weights' = true: in DeepSpeed 0.19.8 that "
                                 "option is broken for parameters frozen before conversion and builds a CUDA-only quantizer; "
                                 "our weight compression already covers frozen parameters in transit")
    if engine.zero_quantized_gradients():
        raise DGCConfigError("'dgc.enabled' cannot be combined with 'zero_optimization.zero_quantized_gradients' = "
                             "true: both replace the gradient reduce-scatter; disable one of them")
