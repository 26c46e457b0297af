"""The top-level ``"dgc"`` section of a DeepSpeed config, as a pydantic model.

DeepSpeed keeps an unknown top-level key in the raw config dict and ignores it, so
the section is parsed and validated here, in DeepSpeed's own pydantic style
(``extra="forbid"``: an unknown or misspelled key is an error naming the key).
"""

from typing import Any, Literal, Mapping, Optional, Union

from typing_extensions import Annotated

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


VALUE_FORMATS = ("int4", "int2", "int1", "fp8_e4m3", "fp8_e5m2")


class CompressedMomentumConfig(BaseModel):
    """1-bit-Adam-style compression for Adam (``"dgc": {"compressed_momentum": {...}}``).

    Tang et al., "1-bit Adam", ICML 2021, sections 3-4, adapted to ZeRO-3: for the first
    ``freeze_step`` optimizer steps the optimizer is stock Adam on the (compressed, per the top-level
    keys) gradients, and every rank keeps a local momentum ``m_r = b1 m_r + (1 - b1) g_r / W`` of its
    own gradient (full parameter shape). After that step Adam's second moment is frozen; ranks send
    each owner its slice of ``m_r`` (divided by ``sqrt(v_hat) + eps`` with ``precondition``, so the
    quantity compressed is the update itself) with error feedback, and the owner applies
    ``p -= lr * sum_r m_r / (sqrt(v_hat) + eps)`` (plus AdamW's decoupled weight decay). The update is
    linear in what was sent, so compression error is corrected by error feedback instead of being
    amplified by Adam's normalisation.

    - ``freeze_step`` (int >= 1): optimizer steps of stock Adam before the freeze.
    - ``quantization`` (``"int1"``, ``"int2"``, ``"int4"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"none"``;
      default ``"int1"``): format of the momentum on the wire after the freeze.
    - ``density`` (float in (0, 1] or ``"auto"``, default 1.0): top-k of the momentum after the freeze
      (``"auto"`` as the top-level key, with its bounds and budget).
    - ``group_size`` (even int >= 2, default 128): values per scale.
    - ``precondition`` (bool, default true): compress ``m / (sqrt(v_hat) + eps)``; needs every
      rank to hold ``1 / (sqrt(v_hat) + eps)`` for all parameters (gathered once at the freeze,
      bf16, 2 bytes per parameter).

    Needs Adam or AdamW (``torch.optim.Adam``/``AdamW``, DeepSpeed's FusedAdam or CPU Adam, without
    L2 weight decay unless decoupled), ``gradient_accumulation_steps`` 1 and the flat topology.
    Gradient clipping does not apply after the freeze (the clipped quantity would be the update).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    freeze_step: int = Field(ge=1)
    quantization: Literal["int1", "int2", "int4", "fp8_e4m3", "fp8_e5m2", "none"] = "int1"
    density: Union[Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)], Literal["auto"]] = 1.0
    group_size: int = Field(128, ge=2, le=1 << 20, multiple_of=2)
    precondition: bool = True


class DGCConfig(BaseModel):
    """Settings of dynamic gradient compression for the ZeRO-3 reduce-scatter.

    Keys (all under the top-level ``"dgc"`` key of ds_config):

    - ``enabled`` (bool, default false): replace ZeRO-3's gradient reduce-scatter.
    - ``density`` (float in (0, 1] or ``"auto"``, default 0.01): fraction of each tensor's elements
      kept by top-k selection each micro-step (DGC, Lin et al. 2018, section 2). ``1.0`` sends every
      element (dense). ``"auto"``: each bucket's density is the smallest that leaves at most
      ``energy_budget`` of the accumulated gradient's energy (sum of squares, estimated on DGC's 1%
      sample) unsent, clamped to ``[density_min, density_max]``; the ranks then take the largest of
      their choices (one small all-reduce per bucket), so all use the same density.
    - ``density_min``, ``density_max`` (floats in (0, 1], defaults 0.01 and 0.3): bounds of ``"auto"``.
    - ``energy_budget`` (float in (0, 1), default 0.5): fraction of energy ``"auto"`` may leave in the residual.
    - ``threshold`` (float > 0 or null, default null): keep every element with ``|acc| >= threshold``
      instead of top-k (a fixed absolute threshold; the number kept then varies per rank and step).
    - ``threshold_reuse_steps`` (int >= 1, default 1): estimate each tensor's top-k threshold (DGC's sampled
      estimate and its corrections) at one exchange and reuse it for the next ``threshold_reuse_steps - 1``
      exchanges of that tensor (optimizer steps without gradient accumulation), as Ok-Topk does (Li and Hoefler,
      PPoPP 2022, section 3.1.3): the gradient's distribution changes slowly, and a reused threshold costs one
      compare per element instead of a sample, a selection and counting rounds. The number kept then varies
      around k; above 1.3 k it is cut to the k largest, so payloads stay bounded. A change of density (warm-up,
      ``"auto"``) or of what is selected (gradients, then momentum after the freeze of ``compressed_momentum``)
      estimates afresh. 1: estimate at every exchange.
    - ``warmup_dense_steps`` (int >= 0, default 0): optimizer steps sent dense (still quantized) first.
    - ``warmup_steps`` (int >= 0, default 0): after those, the density falls geometrically from
      max(0.25, density) to ``density`` over this many steps (DGC's exponential warm-up, Lin et al.
      2018, section 3.4: 25%, 6.25%, 1.5625%, ... per epoch).
    - ``quantization`` (``"int4"``, ``"int2"``, ``"int1"``, ``"fp8_e4m3"``, ``"fp8_e5m2"`` or ``"none"``,
      default ``"int4"``): format of the kept values, with group-wise scales
      (:func:`deepspeed_dgc.compressor.quantize_values`); ``"none"`` sends them in the communication dtype.
    - ``stochastic_rounding`` (bool, default false): round INT4/INT2 codes up or down at random so that
      the decoded value is unbiased (runs the PyTorch path).
    - ``index_coding`` (``"auto"``, ``"varint"`` or ``"bitmap"``, default ``"auto"``): positions of the
      kept values as varint gaps (about 8 bits each down to density 1/128) or as a bitmap (1 bit per
      element); ``"auto"`` takes the bitmap when the density is above 1/8, where it is smaller.
    - ``entropy_coding`` (``"none"`` or ``"zlib"``, default ``"none"``): ``"zlib"`` DEFLATE-codes every
      payload after quantization and index coding (lossless: the training is bit-identical, only the
      bytes on the wire change; see :func:`deepspeed_dgc.reducer.deflate`). Runs on the host.
    - ``group_size`` (int >= 2, even, default 128): kept values per scale.
    - ``error_feedback`` (bool, default true): carry what was not sent (unselected values and
      quantization error) to the next micro-step.
    - ``residual_dtype`` (``"auto"``, ``"fp32"``, ``"bf16"`` or ``"fp8"``, default ``"auto"``): storage of the
      error-feedback residuals between steps (4, 2 or about 1.03 bytes per element; see
      :class:`deepspeed_dgc.memory.ErrorFeedback`). ``"auto"`` is the cheapest storage that kept the loss of
      fp32 residuals in the convergence study (``docs/study_convergence.md``: fp8, on five settings from dense INT4
      to top-k 0.01 and compressed momentum) where it is supported, ``"fp8"``; and ``"fp32"`` with the
      hierarchical topology or ``momentum_correction``, which need it (:attr:`residual_storage`).
    - ``residual_offload`` (bool, default false): keep the committed residuals in pinned host memory
      between steps and copy each to the device only while its bucket is compressed (asynchronous copies on
      the current stream), so error feedback holds no device memory between steps (the new residuals still live
      on the device from their bucket's compression to the step); on the CPU accelerator host memory is the
      device's (one extra copy per commit). The summary's ``host_state_bytes`` counts them.
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
    - ``compressed_momentum`` (:class:`CompressedMomentumConfig` or null): 1-bit-Adam-style
      compression of Adam's momentum after a warm-up.
    - ``momentum_correction`` (bool, default false): DGC's momentum correction for momentum SGD (Lin et al.
      2018, section 3.1): every rank keeps its own velocity ``u = m u + g / W`` and error feedback
      accumulates and sends ``u`` instead of ``g``; the owners then step ``p -= lr (u_sum + wd-term)``
      without applying momentum again (:class:`deepspeed_dgc.momentum.MomentumCorrection`). Needs
      ``torch.optim.SGD`` (ds_config ``"SGD"``) with momentum > 0, no Nesterov, no dampening,
      ``gradient_accumulation_steps`` 1, not fp16, the flat topology and fp32 residuals. DeepSpeed's
      ``gradient_clipping`` (default 1.0) would clip the summed velocity and is switched off, with a
      warning; ``local_clip_norm`` is DGC's clipping.
    - ``momentum_factor_masking`` (bool, default true): with ``momentum_correction``, zero the velocity of
      the elements just sent by top-k (section 3.3), so stale momentum does not push them again.
    - ``local_clip_norm`` (float > 0 or null, default null): with ``momentum_correction``, clip each
      tensor's local gradient on each rank to this L2 norm before it enters the velocity (local gradient
      clipping, section 3.2). Per tensor, as DGC's reference code does: the paper's threshold (the global
      clipping norm times ``W ** -0.5``) is for the whole model's norm, so a per-tensor value is smaller.
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
    density: Union[Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)], Literal["auto"]] = 0.01
    density_min: float = Field(0.01, gt=0.0, le=1.0, allow_inf_nan=False)
    density_max: float = Field(0.3, gt=0.0, le=1.0, allow_inf_nan=False)
    energy_budget: float = Field(0.5, gt=0.0, lt=1.0, allow_inf_nan=False)
    threshold: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    threshold_reuse_steps: int = Field(1, ge=1)
    warmup_dense_steps: int = Field(0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    quantization: Literal["int4", "int2", "int1", "fp8_e4m3", "fp8_e5m2", "none"] = "int4"
    stochastic_rounding: bool = False
    index_coding: Literal["auto", "varint", "bitmap"] = "auto"
    entropy_coding: Literal["none", "zlib"] = "none"
    group_size: int = Field(128, ge=2, le=1 << 20, multiple_of=2)
    error_feedback: bool = True
    residual_dtype: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    residual_offload: bool = False
    min_numel: int = Field(2048, ge=0)
    stats_interval: int = Field(100, ge=1)
    weights: WeightsConfig = WeightsConfig()
    comm_backend: Literal["torch", "mpi"] = "torch"
    topology: Literal["flat", "hierarchical"] = "flat"
    ranks_per_node: Optional[int] = Field(None, ge=1)
    # at least 1 ms: gloo counts in whole milliseconds and takes 0 as "wait forever"
    timeout_s: float = Field(600.0, ge=0.001, le=7 * 24 * 3600.0, allow_inf_nan=False)
    kernels: Literal["auto", "fused", "reference"] = "auto"
    compressed_momentum: Optional[CompressedMomentumConfig] = None
    momentum_correction: bool = False
    momentum_factor_masking: bool = True
    local_clip_norm: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _fused_needs_int4(self):
        if self.kernels == "fused" and self.quantization != "int4":
            raise ValueError("'dgc.kernels' = \"fused\" needs 'dgc.quantization' = \"int4\" (the fused ops code INT4 "
                             f"payloads only); use \"auto\" or \"reference\" with quantization \"{self.quantization}\"")
        if self.stochastic_rounding and self.quantization not in ("int4", "int2"):
            raise ValueError("'dgc.stochastic_rounding' needs 'dgc.quantization' \"int4\" or \"int2\", got "
                             f"\"{self.quantization}\"")
        if self.density_min > self.density_max:
            raise ValueError(f"'dgc.density_min' ({self.density_min}) is above 'dgc.density_max' ({self.density_max})")
        if self.threshold is not None and self.density == "auto":
            raise ValueError("'dgc.threshold' and 'dgc.density' = \"auto\" both choose what is kept: set one of them")
        if self.threshold is not None and self.threshold_reuse_steps > 1:
            raise ValueError("'dgc.threshold_reuse_steps' reuses estimated top-k thresholds, but 'dgc.threshold' fixes "
                             "one and estimates none: set one of them")
        if self.topology == "hierarchical" and self.density == "auto":
            raise ValueError("'dgc.density' = \"auto\" is not supported with 'dgc.topology' = \"hierarchical\" yet "
                             "(use the flat topology or a fixed density)")
        if self.topology == "hierarchical" and self.residual_dtype not in ("auto", "fp32"):
            raise ValueError(f"'dgc.residual_dtype' = \"{self.residual_dtype}\" is not supported with 'dgc.topology' = "
                             "\"hierarchical\" yet (its residuals are fp32: use \"auto\" or \"fp32\", or the flat topology)")
        if self.compressed_momentum is not None and self.topology != "flat":
            raise ValueError("'dgc.compressed_momentum' needs 'dgc.topology' = \"flat\" (got \"hierarchical\")")
        for key in ("local_clip_norm", "momentum_factor_masking"):
            if key in self.model_fields_set and not self.momentum_correction:
                raise ValueError(f"'dgc.{key}' is part of DGC's momentum correction: set 'dgc.momentum_correction' "
                                 "= true as well")
        if self.momentum_correction:
            if self.compressed_momentum is not None:
                raise ValueError("'dgc.momentum_correction' (momentum SGD) and 'dgc.compressed_momentum' (Adam) "
                                 "exclude each other: set one of them")
            if self.topology != "flat" or self.residual_dtype not in ("auto", "fp32") or not self.error_feedback:
                raise ValueError("'dgc.momentum_correction' needs 'dgc.topology' = \"flat\", 'dgc.residual_dtype' = "
                                 "\"fp32\" and 'dgc.error_feedback' = true (the velocity is accumulated by error "
                                 f"feedback; got topology {self.topology!r}, residual_dtype {self.residual_dtype!r}, "
                                 f"error_feedback {self.error_feedback})")
        return self

    def index_coding_for(self, density: float) -> str:
        """``"varint"`` or ``"bitmap"`` for kept positions at ``density`` (``"auto"``: bitmap above 1/8)."""
        if self.index_coding != "auto":
            return self.index_coding
        return "bitmap" if density > 0.125 else "varint"

    @property
    def residual_storage(self) -> str:
        """The residuals' storage dtype: ``residual_dtype``, with ``"auto"`` resolved (``"fp32"`` for the
        hierarchical topology and ``momentum_correction``, else ``"fp8"``)."""
        if self.residual_dtype != "auto":
            return self.residual_dtype
        return "fp32" if self.topology == "hierarchical" or self.momentum_correction else "fp8"

    @property
    def lossless(self) -> bool:
        """True when nothing is dropped or rounded: density 1 and no quantization."""
        return self.density == 1.0 and self.quantization == "none" and self.threshold is None


def _format_validation_error(err: ValidationError) -> str:
    lines, by_key = [], {}
    for e in err.errors():
        # a union (density: float or "auto") reports one error per member, tagged in the location
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and (p.startswith("constrained-") or "[" in p)))
        key = ".".join(str(p) for p in (DGC_SECTION, ) + loc)
        if e["type"] == "extra_forbidden":
            sub = {"weights": WeightsConfig, "compressed_momentum": CompressedMomentumConfig}
            model = sub.get(loc[0], DGCConfig) if len(loc) > 1 else DGCConfig
            allowed = ", ".join(model.model_fields)
            lines.append(f"unknown key '{key}' (allowed keys: {allowed})")
        elif key in by_key:
            by_key[key][0].append(e["msg"])
        else:
            by_key[key] = ([e["msg"]], e.get("input"))
            lines.append(key)
    return "; ".join(line if line not in by_key else
                     f"invalid value for '{line}': {' or '.join(by_key[line][0])} (got {by_key[line][1]!r})" for line in lines)


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
