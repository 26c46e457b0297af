"""The top-level ``"dgc"`` section of a DeepSpeed config, as a pydantic model: the one config reference.

DeepSpeed keeps an unknown top-level key in the raw config dict and ignores it, so the section is parsed
and validated here, in DeepSpeed's own pydantic style (``extra="forbid"``: an unknown or misspelled key is
an error naming the key; ``strict``: ``"0.5"`` or ``true`` is not a density). Every key's meaning is its
``Field`` description; ``python -m deepspeed_dgc docs`` renders them as ``docs/config.md``.
"""

import difflib
import json
from typing import Any, List, Literal, Mapping, Optional, Union

from typing_extensions import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DGC_SECTION = "dgc"

Density = Union[Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)], Literal["auto"]]
# strict: "0.5" or true for a number, or 1 for a bool, is an error, never a silent coercion (an int is a float)
_MODEL = ConfigDict(extra="forbid", frozen=True, strict=True)


class DGCConfigError(ValueError):
    """A ``"dgc"`` section that is invalid on its own or clashes with the rest of ds_config."""


class WeightsConfig(BaseModel):
    """Compression of ZeRO-3's parameter all-gather (``"dgc": {"weights": {...}}``), like ZeRO++ qwZ
    (Wang et al., arXiv 2306.10209, section 4.1). Master weights and stored shards stay exact."""

    model_config = _MODEL

    quantization: Literal["none", "int8", "fp8_e4m3", "int4"] = Field(
        "none", description="format of the gathered copy of the weights: about 1/4 (INT8, FP8) or 1/8 (INT4) of "
        "fp32 bytes plus 4 bytes of scale per group; `\"none\"` gathers as stock (bytes still counted)")
    group_size: int = Field(256, ge=2, le=1 << 20, multiple_of=2, description="weights per fp32 absmax scale")


class CompressedMomentumConfig(BaseModel):
    """1-bit-Adam-style compression for Adam (``"dgc": {"compressed_momentum": {...}}``).

    Tang et al., "1-bit Adam", ICML 2021, sections 3-4, adapted to ZeRO-3: for the first ``freeze_step``
    optimizer steps the owners run stock Adam on the gradients (compressed by the top-level keys) while every
    rank keeps a local momentum of its own gradient; then Adam's second moment is frozen and the ranks send
    their momenta (preconditioned), compressed by this section's keys, with error feedback. Needs Adam or AdamW
    (without L2 weight decay), one send per optimizer step (``gradient_accumulation_steps`` 1, or any with
    ``accumulate_locally``), the flat topology, fp32 or bf16.
    """

    model_config = _MODEL

    freeze_step: int = Field(ge=1, description="optimizer steps of stock Adam before Adam's second moment is frozen "
                             "and the momentum is sent instead of the gradient (about 20% of the run)")
    quantization: Literal["int1", "int2", "int4", "fp8_e4m3", "fp8_e5m2", "none"] = Field(
        "int1", description="format of the momentum on the wire after the freeze")
    density: Density = Field(1.0, description="top-k density of the momentum after the freeze (`\"auto\"` as the "
                             "top-level key, with its bounds and budget)")
    group_size: int = Field(128, ge=2, le=1 << 20, multiple_of=2, description="values per scale after the freeze")
    precondition: bool = Field(True, description="send `m / (sqrt(v_hat) + eps)`, the update itself (every rank "
                               "then holds the frozen preconditioner of all parameters in bf16, 2 bytes per "
                               "parameter); else `m`, divided by the owner")


class DecoupledMomentumConfig(BaseModel):
    """DeMo's decoupled momentum (``"dgc": {"decoupled_momentum": {...}}``), for any optimizer.

    Peng, Quesnelle and Kingma, "DeMo: Decoupled Momentum Optimization", arXiv 2411.19870, section 3, Algorithm 1
    (bloc97/DeMo), inside ZeRO-3's per-owner reduce-scatter: every rank keeps its own momentum
    ``delta = decay delta + g / W``, sends the ``topk`` largest coefficients of the DCT of each ``chunk`` of it (chunks
    cut inside the owners' partitions), and subtracts what it sent (the error feedback). The owners step with the
    sum: DeMo's sign update at the optimizer's learning rate (`update: "sign"`), or the optimizer's own step on it
    (`update: "optimizer"`). From the first step; the top-level `density`, `quantization` and `group_size` do not
    apply. Any optimizer DeepSpeed builds or the job passes (Adam, AdamW, SGD, Lion, ...; the sign update takes its
    learning rate, schedule and weight decay, decoupled for AdamW-like optimizers and Lion, L2 for the others), fp32,
    bf16 or fp16 engines (with ZeRO-Offload and parameter offload too). On the hierarchical topology the momentum is of the node-level sums a rank compresses (1/L of full size).
    Bytes per parameter per step: `topk * (bits(quantization) + log2(chunk)) / chunk / 8` plus the scales (a partition
    shorter than `chunk` is padded to one chunk and still sends `topk` values).
    """

    model_config = _MODEL

    chunk: int = Field(64, ge=2, le=4096, description="columns per DCT chunk (a power of two; DeMo's 64); chunks "
                       "never span two owners' partitions")
    topk: int = Field(2, ge=1, description="coefficients sent per chunk (at most `chunk`): density `topk / chunk` "
                      "(a partition shorter than a chunk is padded to one and still sends `topk`)")
    decay: float = Field(0.999, ge=0.0, lt=1.0, allow_inf_nan=False,
                         description="decay of the local momentum per send: per optimizer step, or per micro-step with "
                         "`accumulate_locally: false` (DeMo's `compression_decay`)")
    transform: Literal["dct", "none"] = Field("dct", description="`\"dct\"`: top-k of each chunk's orthonormal "
                                              "DCT-II (DeMo); `\"none\"`: top-k of the momentum itself (SparseLoCo's "
                                              "chunked top-k, arXiv 2508.15706)")
    quantization: Literal["int4", "int2", "int1", "fp8_e4m3", "fp8_e5m2", "none"] = Field(
        "int4", description="format of the sent coefficients (INT1: ternary; `\"none\"`: fp32)")
    group_size: int = Field(128, ge=2, le=1 << 20, multiple_of=2, description="sent values per fp32 scale")
    update: Literal["sign", "optimizer", "adam"] = Field(
        "sign", description="the owners' step: `\"sign\"`, DeMo's `p <- p (1 - lr wd) - lr sign(u)` with the "
        "optimizer's learning rate (times `lr_scale`) and weight decay (decoupled as the optimizer's is: AdamW, Lion; "
        "else L2, `wd p` added to `u` before the sign; `gradient_clipping` cannot change a sign); the optimizer's own "
        "state and rule are not used; `\"optimizer\"` (`\"adam\"`, its earlier name): the job's optimizer steps on "
        "`u` as its gradient (`u` is a momentum sum up to `1 / (1 - decay)` times the gradient, which a scale-free "
        "optimizer such as Adam or Lion takes as it is: Lion with `decay` 0.9 and `topk` 4 kept stock Lion's loss, "
        "where the sign step at Lion's lr did not; AdamW with betas (0, 0.99) and `decay` 0.99 ended below the sign "
        "step's loss on the main job, docs/methods.md; with `decay` above 0, SGD with momentum "
        "and Adam with `betas[0]` above 0 are refused at initialize, or after the first step where a schedule turned "
        "that momentum on: it would integrate `u` again)")
    lr_scale: float = Field(
        1.0, gt=0.0, le=100.0, allow_inf_nan=False, description="`update: \"sign\"`: the sign step's learning rate "
        "as a multiple of the optimizer's, `p <- p (1 - lr wd) - lr_scale lr sign(u)`: the schedule kept, decoupled "
        "weight decay's rate not scaled (L2's is inside the sign). 1 is DeMo's. The rate a job tuned for Adam is not "
        "a sign step's best (Lion, Chen et al., arXiv 2302.06675, takes 3-10x below AdamW's, its update having the "
        "larger norm); where the sign step lags Adam's loss at the job's rate, a larger one can close it: the Hugging "
        "Face configs take 1.25 (docs/huggingface.md, \"The sign step's rate\"); 0.5 and 1.5 were worse there")
    storage: Literal["fp32", "bf16", "int8"] = Field(
        "fp32", description="storage of the local momentum between steps: 4, 2 or 1.03 bytes per parameter per rank. "
        "bf16 rounds to nearest and drops changes below 2^-9 of the momentum (the 0.999 decay among them), which "
        "costs loss on long runs; `\"int8\"`: int8 codes with a bf16 absmax scale per 64, stochastically rounded, so "
        "the stored momentum is unbiased (results/study_storage.md)")
    offload: Optional[bool] = Field(
        None, description="keep the momentum in pinned host memory between steps: the device holds only a copy "
        "of the first bucket's, fetched for the next backward; each bucket's is fetched ahead of its reduce and "
        "written back when it is staged, on a side stream on a GPU (a "
        "thread on the CPU), beside the backward; the host holds two buffers per bucket (the committed one stays for "
        "a skipped step). Unset: on the host where the optimizer state is (`zero_optimization.offload_optimizer`), "
        "else on the device")

    @model_validator(mode="after")
    def _sizes(self):
        if self.chunk & (self.chunk - 1):
            raise ValueError(f"'dgc.decoupled_momentum.chunk' must be a power of two, got {self.chunk}")
        if self.update != "sign" and "lr_scale" in self.model_fields_set:
            raise ValueError(f"'dgc.decoupled_momentum.lr_scale' scales the sign step's learning rate; with "
                             f"'update' = \"{self.update}\" the optimizer steps at its own: remove 'lr_scale'")
        if self.topk > self.chunk:
            raise ValueError(f"'dgc.decoupled_momentum.topk' ({self.topk}) is above 'dgc.decoupled_momentum.chunk' "
                             f"({self.chunk})")
        return self


class SharedMaskConfig(BaseModel):
    """Owner-chosen shared masks for Adam (``"dgc": {"shared_mask": {...}}``), after SCAPE (arXiv 2607.01678,
    section 3): after every optimizer step each owner picks, in its partition of every parameter, the ``density``
    share of coordinates with the largest score from its Adam state, and sends those positions to every rank
    (``ceil(log2 c)`` bits each). In the next step every rank sends its error-feedback accumulator at exactly those
    coordinates, values only (no per-sender positions), and the owner sums the compacted buffers densely; error
    feedback keeps the rest. An ``explore`` share of each mask is a window that moves through the partition, so every
    coordinate is sent at least every ``1 / (explore * density)`` steps (a coordinate whose Adam state decayed
    while it was not sent would otherwise never be chosen again). The first ``warmup_steps`` steps are sent dense
    (INT4 with error feedback: Adam has no state yet). On the hierarchical topology the masks and the values go
    between nodes only, over the node-level sums (residuals 1/L of full size). Needs Adam, AdamW, FusedAdam or
    DeepSpeedCPUAdam, fp32 or bf16; the top-level codec keys do not apply (`residual_dtype` and `residual_offload`
    do).
    It loses validation loss against stock on the main job at every density tried (results/study_convergence.md):
    not a setting to train with; `decoupled_momentum` is.
    """

    model_config = _MODEL

    density: float = Field(0.05, gt=0.0, lt=1.0, allow_inf_nan=False,
                           description="share of each owner's partition of every parameter sent per step")
    score: Literal["update", "exp_avg"] = Field(
        "update", description="what chooses: `\"update\"`, Adam's step size `|exp_avg| / (sqrt(exp_avg_sq) + eps)`; "
        "`\"exp_avg\"`, the first moment's magnitude")
    explore: float = Field(0.25, ge=0.0, lt=1.0, allow_inf_nan=False,
                           description="share of each mask taken by the moving window instead of the score "
                           "(what it does to the loss: results/study_convergence.md)")
    quantization: Literal["int4", "int2", "int1", "fp8_e4m3", "fp8_e5m2"] = Field(
        "int4", description="format of the sent values")
    group_size: int = Field(128, ge=2, le=1 << 20, multiple_of=2, description="sent values per fp32 scale")
    warmup_steps: int = Field(1, ge=1, description="first optimizer steps sent dense (INT4, error feedback)")


class DGCConfig(BaseModel):
    """Settings of dynamic gradient compression for ZeRO-3, under the top-level ``"dgc"`` key of ds_config.

    ``density: 1.0`` with ``quantization: "none"`` is the lossless mode: bit-identical to stock ZeRO-3 at 2 ranks
    (within fp32 summation order at 3 or more; with gradient accumulation, to stock's
    ``engine.coalesce_grad_reduction()``, or with ``accumulate_locally: false`` to stock's own). The meaning of each
    key is its field's description.
    """

    model_config = _MODEL

    enabled: bool = Field(False, description="replace ZeRO-3's gradient reduce-scatter")
    density: Density = Field(
        1.0, description="fraction of each tensor's elements kept by top-k selection each send (DGC, Lin et "
        "al., ICLR 2018, section 2); `1.0` (the default) sends every element, quantized, with error feedback: "
        "stock's loss with any optimizer, while top-k below 1 is lossy with Adam at short horizons "
        "(results/README.md). `\"auto\"`: per bucket, the smallest "
        "density that leaves at most `energy_budget` of the accumulated gradient's energy unsent (estimated on "
        "DGC's 1% sample), within `[density_min, density_max]`; the ranks take the largest of their choices (one "
        "all-reduce of one float per bucket), so all agree")
    density_min: float = Field(0.01, gt=0.0, le=1.0, allow_inf_nan=False, description="lower bound of `\"auto\"`")
    density_max: float = Field(0.3, gt=0.0, le=1.0, allow_inf_nan=False, description="upper bound of `\"auto\"`")
    energy_budget: float = Field(0.5, gt=0.0, lt=1.0, allow_inf_nan=False,
                                 description="share of the accumulator's energy `\"auto\"` may leave in the residual")
    threshold: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False,
                                       description="keep every element with `|acc| >= threshold` (unscaled gradient "
                                       "units) instead of top-k; kept counts then vary per rank and step")
    threshold_reuse_steps: int = Field(
        1, ge=1, description="estimate each tensor's top-k threshold once every this many exchanges and reuse it in "
        "between (Ok-Topk, Li and Hoefler, PPoPP 2022, section 3.1.3); the kept count then varies around k and is "
        "cut to the k largest above 1.3 k; a density change, or momentum replacing gradients, estimates afresh")
    warmup_dense_steps: int = Field(0, ge=0, description="first optimizer steps sent dense (still quantized)")
    warmup_steps: int = Field(0, ge=0, description="then the density falls geometrically from max(0.25, density) to "
                              "`density` over this many optimizer steps (DGC's warm-up, Lin et al. 2018, section 3.4)")
    quantization: Literal["int4", "int2", "int1", "fp8_e4m3", "fp8_e5m2", "none"] = Field(
        "int4", description="format of the sent values, each with an fp32 scale per group: INT4 (absmax/7), INT2 "
        "(4 levels, absmax/1.5), INT1 (sign times the group's mean magnitude, 1-bit Adam's compressor), FP8 (absmax "
        "/ the format's max); `\"none\"`: the communication dtype. Exact zeros arrive as zeros in every format (INT1/"
        "INT2: a group mixing zeros and non-zeros adds one bit per value)")
    stochastic_rounding: bool = Field(False, description="INT4/INT2 codes rounded up or down at random, unbiased "
                                      "(Gupta et al., ICML 2015)")
    index_coding: Literal["auto", "varint", "bitmap"] = Field(
        "auto", description="positions of kept values: varint gaps (about 8 bits each down to density 1/128) or a "
        "bitmap (1 bit per element); `\"auto\"` takes the bitmap above density 1/8")
    entropy_coding: Literal["none", "zlib"] = Field(
        "none", description="`\"zlib\"`: DEFLATE (level 1) of every gradient payload after quantization and index "
        "coding; lossless (training is bit-identical); it shrinks INT2 and INT4 codes of heavy-tailed values, INT1 "
        "signs not at all (what it saved: results/figures.md); runs on the host")
    group_size: int = Field(128, ge=2, le=1 << 20, multiple_of=2,
                            description="values per scale group (groups never span two tensors)")
    layout: Literal["auto", "fixed", "exact"] = Field(
        "auto", description="payload layout. `\"fixed\"`, the device path: every size known from the bucket's shape "
        "and density (DGC's threshold computed on the device, a fixed capacity per owner: `capacity_factor`; chunk "
        "counts and 8-16-bit in-chunk offsets; INT1 ternary, 1.6 bits), one all-to-all per bucket, nothing read back "
        "on the host. "
        "`\"exact\"`: payloads of the kept count (DGC's sampled threshold, varint or bitmap positions, a size exchange "
        "first); needed by `density: \"auto\"`, `threshold`, `threshold_reuse_steps`, `entropy_coding` and "
        "`index_coding`. `\"auto\"`: fixed on a GPU, exact on CPU (the fused CPU op codes it, and exact sizes are "
        "smaller), and exact wherever one of those settings asks for it. `decoupled_momentum` and `shared_mask` "
        "have payloads of their own: a `layout` other than `\"auto\"` is refused with them")
    capacity_factor: float = Field(
        2.0, ge=1.0, le=64.0, allow_inf_nan=False, description="fixed layout: each owner's slice of a sparsified "
        "tensor sends what reaches DGC's threshold up to `ceil(capacity_factor * density * c)` values, and always "
        "carries that many slots (unused ones cost bytes); a tensor whose slots and positions would cost as many bytes "
        "as its values sent whole goes whole, dense (e.g. INT1 at density 0.1: 1.6 bits a value against the slots' "
        "values and 8-16-bit offsets; the telemetry's density says so). 2.0 kept the exact layout's loss on the main "
        "job; Ok-Topk's 1.3 did not, because slices of one tensor differ (an attention projection's q, k and v); "
        "measured in results/fixed_layout.md")
    error_feedback: bool = Field(True, description="carry what was not sent (unselected values and quantization "
                                 "error) to the next send (Seide et al., Interspeech 2014)")
    accumulate_locally: bool = Field(
        True, description="with gradient accumulation (`gradient_accumulation_steps` > 1, or micro-steps before "
        "`set_gradient_accumulation_boundary(True)`), each rank adds its micro-steps' gradients up locally and the "
        "window's sum is compressed and sent once, at ZeRO-3's accumulation boundary (DGC's local accumulation, Lin "
        "et al., ICLR 2018, section 3.1; in ZeRO-3's gradient accumulation dtype, `data_types.grad_accum_dtype`, "
        "the model's by default: the very sum DeepSpeed's `engine.coalesce_grad_reduction()` forms). Stock ZeRO-3 "
        "reduce-scatters every micro-step: with N micro-steps this sends N times fewer gradient bytes and collectives "
        "(the telemetry's ratio counts stock's N). Under `decoupled_momentum` each send is one top-k: held, one per "
        "step instead of N (with `false`, N times the bytes and somewhat lower loss; at equal bytes, `topk` times N "
        "held, about the same loss: docs/huggingface.md). It holds the window's sum "
        "until its end, the parameters' full size in that dtype (2 or 4 bytes per element; sending every micro-step "
        "staged the residuals or momenta in fp32, 4). "
        "`false`: every micro-step is compressed and sent (nothing held). With "
        "`managed_gradient_accumulation: false` every micro-step is sent either way (the boundary is the step)")
    residual_dtype: Literal["auto", "fp32", "bf16", "fp8", "int8"] = Field(
        "auto", description="storage of the residuals between steps: 4, 2 or about 1.03 bytes per element (fp8: e4m3 "
        "with an fp32 absmax scale per 128, as LoCo's 8-bit buffer, arXiv 2407.04480, rounded to nearest; int8: a "
        "bf16 absmax scale per 64, stochastically rounded, unbiased); the storage's own rounding is not fed back. `\"auto\"`: fp8, the cheapest storage that kept fp32's loss in the convergence studies, flat "
        "and hierarchical (results/study_convergence.md, results/multinode.md); fp32 with `momentum_correction`, "
        "which needs it")
    residual_offload: bool = Field(
        False, description="keep the committed residuals in pinned host memory between steps (the device holds "
        "only a copy of the first bucket's, fetched for the next backward): a bucket's are fetched ahead of its "
        "reduce and written back when staged at the window's last micro-step, on a side stream on a GPU (a thread on the CPU), beside the backward; the host holds two buffers "
        "per bucket (docs/methods.md, \"State on the host\"). Residuals kept per parameter (the exact layout) are "
        "copied at the commit and back when their bucket comes")
    min_numel: int = Field(2048, ge=0, description="tensors with fewer elements are not sparsified: they are sent "
                           "whole (still quantized, with error feedback) and need no positions")
    stats_interval: int = Field(100, ge=1, description="optimizer steps between telemetry log lines and monitor events. The lines "
                                "are INFO records of DeepSpeed's logger (`deepspeed.utils.logger`), which DeepSpeed "
                                "0.19 keeps at WARNING: `logger.setLevel(logging.INFO)` shows them; "
                                "`deepspeed_dgc.get_stats(engine)` returns the totals at any time")
    weights: WeightsConfig = Field(WeightsConfig(), description="quantized parameter all-gather (`weights.*` below)")
    comm_backend: Literal["torch", "mpi"] = Field(
        "torch", description="who moves the compressed payloads: `deepspeed.comm` (NCCL/gloo) or mpi4py "
        "(`Ialltoallv`; the job must be started by `mpirun` or the deepspeed launcher's `--launcher openmpi`); "
        "both give bit-identical results")
    topology: Literal["flat", "hierarchical"] = Field(
        "flat", description="`\"hierarchical\"`: dense reduce-scatter inside a node, compressed exchange between "
        "nodes only (ZeRO++ qgZ's two hops, arXiv 2306.10209, section 4.2), with error feedback on the node-level "
        "sums")
    ranks_per_node: Optional[int] = Field(
        None, ge=1, description="ranks per node; `null` takes the launcher's `LOCAL_SIZE` / "
        "`OMPI_COMM_WORLD_LOCAL_SIZE`, else counts host names. Ranks `k*L ... (k+1)*L - 1` form node k")
    # at least 1 s: the same bound covers start-up (rendezvous, the config agreement) and a bucket's exchange on a
    # slow link, which take longer than a few milliseconds even when every rank is healthy
    timeout_s: Optional[float] = Field(
        None, ge=1.0, le=7 * 24 * 3600.0, allow_inf_nan=False,
        description="seconds any collective of the extension may wait (a peer died or hangs); `null`: the process "
        "group's own timeout, as DeepSpeed's collectives (`deepspeed.init_distributed(timeout=...)`, "
        "`DEEPSPEED_TIMEOUT` minutes), so a rank slow in a long checkpoint write is waited for as stock would. "
        "gloo and MPI: the waiting rank raises `DGCTimeoutError` naming the collective; NCCL: the extension's own "
        "process group has this timeout and NCCL's watchdog aborts the collective (the process ends with NCCL's "
        "error; no host wait). At least 1 (start-up and a bucket's exchange on a slow link take that long on healthy "
        "ranks)")
    policy: Literal["fixed", "auto"] = Field(
        "fixed", description="`\"auto\"`: per bucket, stock ZeRO-3's reduce-scatter or the compressed one, whichever "
        "measures faster on this job's link (every rank times both on random tensors of the bucket's sizes, on the "
        "same group, when a bucket shape is first seen and every `policy_interval` applied steps; the slowest rank's "
        "times decide, so every rank agrees; ties go to stock). A bucket sent by stock takes its residuals along; "
        "under `decoupled_momentum` it sends each rank's DeMo extraction (the decoded top-k DCT coefficients of "
        "`decay delta + g / W`, the rest kept as the momentum) densely, so the owners take the method's step (flat "
        "topology only). Not with the other momentum methods or `shared_mask`. Each choice is in the telemetry (`policy`, "
        "`stock_buckets_total`) and logged at INFO by DeepSpeed's logger")
    policy_interval: int = Field(500, ge=1, description="with `policy: \"auto\"`: applied steps between two "
                                 "measurements of the same bucket shape or gather size (each costs a few exchanges "
                                 "of it both ways: small values cost more than they save)")
    kernels: Literal["auto", "fused", "reference"] = Field(
        "auto", description="who compresses: the fused op where it loads (else the PyTorch reference, with one "
        "warning saying why), the fused op or fail at initialize, or the reference. Same bytes either way; the "
        "fused ops code every value and weight format rounded to nearest with varint positions and hand the rest "
        "(stochastic rounding, bitmap positions, raw values) to the reference")
    compressed_momentum: Optional[CompressedMomentumConfig] = Field(
        None, description="Adam only: 1-bit-Adam-style compressed momentum after a warm-up (`compressed_momentum.*` "
        "below)")
    decoupled_momentum: Optional[DecoupledMomentumConfig] = Field(
        None, description="any optimizer (Adam and AdamW above all): DeMo's decoupled momentum, a chunked DCT top-k of each rank's own "
        "momentum (`decoupled_momentum.*` below)")
    shared_mask: Optional[SharedMaskConfig] = Field(
        None, description="Adam-family jobs: owner-chosen shared masks, after SCAPE (`shared_mask.*` below)")
    momentum_correction: bool = Field(
        False, description="momentum SGD only: DGC's momentum correction (Lin et al. 2018, section 3.1): every rank "
        "keeps its velocity `u = m u + g / W`, error feedback accumulates and sends `u`, the owners step without "
        "momentum. Needs `torch.optim.SGD` with momentum > 0, no Nesterov, dampening or maximize, one send per "
        "optimizer step (gradient accumulation with `accumulate_locally`, the default), not fp16, the flat topology "
        "and fp32 residuals; DeepSpeed's `gradient_clipping` is switched "
        "off (use `local_clip_norm`)")
    momentum_factor_masking: bool = Field(True, description="with `momentum_correction` only: zero the velocity of "
                                          "the elements top-k just sent (section 3.3)")
    local_clip_norm: Optional[float] = Field(
        None, gt=0.0, allow_inf_nan=False, description="with `momentum_correction` only: clip each tensor's local "
        "gradient on each rank to this L2 norm before it enters the velocity (section 3.2; per tensor, as DGC's "
        "reference code, so smaller than the paper's whole-model threshold)")

    @model_validator(mode="after")
    def _fused_needs_what_it_codes(self):
        if self.kernels != "fused":
            return self
        for key, value, bad in (("quantization", self.quantization, "none"),
                                ("stochastic_rounding", self.stochastic_rounding, True),
                                ("index_coding", self.index_coding, "bitmap")):
            if value == bad:
                raise ValueError(f"'dgc.kernels' = \"fused\" cannot code 'dgc.{key}' = {json.dumps(value)} (the fused "
                                 "ops code quantized values rounded to nearest with varint positions); use \"auto\" "
                                 "or \"reference\"")
        return self

    @model_validator(mode="after")
    def _stochastic_rounding_needs_int4_or_int2(self):
        if self.stochastic_rounding and self.quantization not in ("int4", "int2"):
            raise ValueError("'dgc.stochastic_rounding' needs 'dgc.quantization' \"int4\" or \"int2\", got "
                             f"\"{self.quantization}\"")
        return self

    @model_validator(mode="after")
    def _one_way_to_choose_what_is_kept(self):
        if self.density_min > self.density_max:
            raise ValueError(f"'dgc.density_min' ({self.density_min}) is above 'dgc.density_max' ({self.density_max})")
        if self.threshold is not None and self.density == "auto":
            raise ValueError("'dgc.threshold' and 'dgc.density' = \"auto\" both choose what is kept: set one of them")
        if self.threshold is not None and self.threshold_reuse_steps > 1:
            raise ValueError("'dgc.threshold_reuse_steps' reuses estimated top-k thresholds, but 'dgc.threshold' fixes "
                             "one and estimates none: set one of them")
        if self.threshold is not None and "density" in self.model_fields_set:
            raise ValueError("'dgc.threshold' keeps what reaches it and 'dgc.density' keeps a fraction: set one of them")
        auto = self.density == "auto" or (self.compressed_momentum is not None
                                           and self.compressed_momentum.density == "auto")
        unused = sorted({"density_min", "density_max", "energy_budget"} & self.model_fields_set)
        if unused and not auto:
            raise ValueError(f"'dgc.{unused[0]}' is a setting of density \"auto\", which neither 'dgc.density' nor "
                             "'dgc.compressed_momentum.density' asks for")
        return self

    @model_validator(mode="after")
    def _fixed_layout_limits(self):
        if self.layout == "fixed" and self.exact_only_settings():
            key = self.exact_only_settings()[0]
            value = "auto" if key == "density" else getattr(self, key)
            raise ValueError(f"'dgc.{key}' = {json.dumps(value)} needs payloads of the exact kept count: set "
                             "'dgc.layout' to \"exact\" or \"auto\" (got \"fixed\")")
        return self

    def exact_only_settings(self) -> List[str]:
        """The settings this config sets that only the exact layout has (see ``layout``)."""
        keys = []
        if self.density == "auto" or (self.compressed_momentum is not None and self.compressed_momentum.density == "auto"):
            keys.append("density")
        if self.threshold is not None:
            keys.append("threshold")
        if self.threshold_reuse_steps > 1:
            keys.append("threshold_reuse_steps")
        if self.entropy_coding != "none":
            keys.append("entropy_coding")
        if self.index_coding != "auto":
            keys.append("index_coding")
        return keys

    def layout_for(self, device_type: str) -> str:
        """``"fixed"`` or ``"exact"`` for gradients on ``device_type`` (``layout`` with ``"auto"`` resolved)."""
        if self.layout != "auto":
            return self.layout
        return "exact" if device_type == "cpu" or self.exact_only_settings() else "fixed"

    @model_validator(mode="after")
    def _hierarchical_topology_limits(self):
        if self.topology != "hierarchical":
            return self
        if self.local_clip_norm is not None:
            raise ValueError("'dgc.local_clip_norm' needs 'dgc.topology' = \"flat\" (got \"hierarchical\"): it clips "
                             "each rank's whole local gradient, and on the hierarchical topology a rank holds only its "
                             "node's sums of its owners' slices")
        return self

    @model_validator(mode="after")
    def _policy_rules(self):
        if self.policy == "auto":
            # decoupled momentum sends its extraction by stock's collective (policy.py); these cannot switch:
            # their owners' step or masks follow from what was compressed (a frozen preconditioner, Adam-chosen
            # coordinates, velocities masked where sent)
            methods = [k for k in ("compressed_momentum", "shared_mask") if getattr(self, k)
                       is not None] + (["momentum_correction"] if self.momentum_correction else [])
            if methods:
                raise ValueError(f"'dgc.policy' = \"auto\" switches buckets between stock and compressed, which "
                                 f"'dgc.{methods[0]}' cannot (what the owners step with follows from what it "
                                 "compressed): set 'dgc.policy' to \"fixed\", or use 'dgc.decoupled_momentum', which "
                                 "can")
            if self.decoupled_momentum is not None and self.topology == "hierarchical":
                raise ValueError("'dgc.policy' = \"auto\" with 'dgc.decoupled_momentum' needs 'dgc.topology' = "
                                 "\"flat\" (got \"hierarchical\"): a bucket sent by stock carries each rank's "
                                 "extraction of its own momentum, and on the hierarchical topology the momentum is of "
                                 "the node's sums, which stock's reduce-scatter never forms; set 'dgc.policy' to "
                                 "\"fixed\" or 'dgc.topology' to \"flat\"")
        elif "policy_interval" in self.model_fields_set:
            raise ValueError("'dgc.policy_interval' is a setting of 'dgc.policy' = \"auto\" (got \"fixed\")")
        return self

    @model_validator(mode="after")
    def _methods_with_their_own_codec(self):
        for method, kept, own in (
                ("decoupled_momentum", (), "its 'chunk', 'topk', 'quantization' and 'group_size'; it keeps no residual: "
                 "its momentum, stored in 'storage', is the error feedback"),
                ("shared_mask", ("residual_dtype", "residual_offload"), "its 'density', 'quantization' and 'group_size'")):
            if getattr(self, method) is None:
                continue
            unused = sorted((set(_GRADIENT_CODEC_KEYS) - set(kept)) & self.model_fields_set)
            if unused:  # every one at once: a user removes them in one edit
                names = ", ".join(f"'dgc.{k}'" for k in unused)
                are = "is a setting" if len(unused) == 1 else "are settings"
                raise ValueError(f"{names} {are} of the gradient codec, which 'dgc.{method}' replaces by its own "
                                 f"({own}): remove {'it' if len(unused) == 1 else 'them'}")
        return self

    @model_validator(mode="after")
    def _momentum_correction_rules(self):
        for key in ("local_clip_norm", "momentum_factor_masking"):
            if key in self.model_fields_set and not self.momentum_correction:
                raise ValueError(f"'dgc.{key}' is part of DGC's momentum correction: set 'dgc.momentum_correction' "
                                 "= true as well")
        methods = [k for k in ("compressed_momentum", "decoupled_momentum", "shared_mask") if getattr(self, k) is not None]
        if self.momentum_correction:
            methods.insert(0, "momentum_correction")
        if len(methods) > 1:
            raise ValueError(f"'dgc.{methods[0]}' and 'dgc.{methods[1]}' both change what is sent and exclude each "
                             "other: set one of them")
        if not self.momentum_correction:
            return self
        if self.compressed_momentum is not None:
            raise ValueError("'dgc.momentum_correction' (momentum SGD) and 'dgc.compressed_momentum' (Adam) "
                             "exclude each other: set one of them")
        if self.residual_dtype not in ("auto", "fp32") or not self.error_feedback:
            raise ValueError("'dgc.momentum_correction' needs 'dgc.residual_dtype' = \"fp32\" and "
                             "'dgc.error_feedback' = true (the velocity is accumulated by error feedback; got "
                             f"residual_dtype {self.residual_dtype!r}, error_feedback {self.error_feedback})")
        return self

    def index_coding_for(self, density: float) -> str:
        """``"varint"`` or ``"bitmap"`` for kept positions at ``density`` (``"auto"``: bitmap above 1/8)."""
        if self.index_coding != "auto":
            return self.index_coding
        return "bitmap" if density > 0.125 else "varint"

    @property
    def residual_storage(self) -> str:
        """The residuals' storage dtype: ``residual_dtype``, with ``"auto"`` resolved (``"fp32"`` with
        ``momentum_correction``, else ``"fp8"``)."""
        if self.residual_dtype != "auto":
            return self.residual_dtype
        return "fp32" if self.momentum_correction else "fp8"

    @property
    def lossless(self) -> bool:
        """True when nothing is dropped or rounded: density 1 and no quantization."""
        return self.density == 1.0 and self.quantization == "none" and self.threshold is None


# top-level keys of the gradient codec (what ``decoupled_momentum`` replaces)
_GRADIENT_CODEC_KEYS = ("density", "density_min", "density_max", "energy_budget", "threshold", "threshold_reuse_steps",
                        "warmup_dense_steps", "warmup_steps", "quantization", "stochastic_rounding", "index_coding",
                        "entropy_coding", "group_size", "layout", "capacity_factor", "error_feedback",
                        "residual_dtype", "residual_offload", "min_numel")

SUBSECTIONS = {"weights": WeightsConfig, "compressed_momentum": CompressedMomentumConfig,
               "decoupled_momentum": DecoupledMomentumConfig, "shared_mask": SharedMaskConfig}


def _format_validation_error(err: ValidationError) -> str:
    lines, by_key = [], {}
    for e in err.errors():
        # a union (density: float or "auto") reports one error per member, tagged in the location
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and (p.startswith("constrained-") or "[" in p)))
        key = ".".join(str(p) for p in (DGC_SECTION, ) + loc)
        # a rule across keys (of the section or of a subsection): its own message names them
        if e["type"] == "value_error" and (not loc or (len(loc) == 1 and loc[0] in SUBSECTIONS)):
            lines.append(e["msg"].removeprefix("Value error, "))
        elif e["type"] == "extra_forbidden":
            model = SUBSECTIONS.get(loc[0], DGCConfig) if len(loc) > 1 else DGCConfig
            allowed = ", ".join(model.model_fields)
            near = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
            hint = f"; did you mean '{'.'.join(key.split('.')[:-1] + near)}'?" if near else ""
            lines.append(f"unknown key '{key}' (allowed keys: {allowed}){hint}")
        else:
            # the docs say "even" where pydantic says "a multiple of 2"
            msg = "Input should be even" if (e.get("ctx") or {}).get("multiple_of") == 2 else e["msg"]
            if key in by_key:
                by_key[key][0].append(msg)
            else:
                by_key[key] = ([msg], e.get("input"))
                lines.append(key)
    return "; ".join(line if line not in by_key else
                     f"invalid value for '{line}': {' or '.join(by_key[line][0])} (got {_as_json(by_key[line][1])})"
                     for line in lines)


def _as_json(value: Any) -> str:
    """``value`` as the ds_config spells it (``null``, ``true``, ``"yes"``), or its repr where JSON has no spelling."""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages: ``null``, ``a boolean``, ``a number``, ``a string``,
    ``an array``, ``an object``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an object" if isinstance(value, Mapping) else "an array" if isinstance(value, (list, tuple)) else \
        type(value).__name__


def read_ds_config(path) -> dict:
    """A ds_config file, read as JSON with a key given twice in an object refused, as ``deepspeed.initialize`` refuses
    it given the path (``DeepSpeedConfig``); a file that is not JSON is read as hjson (comments, trailing commas,
    unquoted keys), as DeepSpeed reads a path. A JSON file is not read as hjson: hjson reads ``0.0`` as the integer 0
    (torch's Adam then refuses ``"betas": [0.0, 0.99]``), where a config passed as a dict, as the Trainer and most
    scripts pass it, keeps JSON's float.

    Args:
        path: the file (str or path-like).

    Returns:
        The config as a dict.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is empty, not UTF-8 text, neither JSON nor hjson, nested too deeply for Python's parser,
            gives a key twice in an object (DeepSpeed's message), or its top level is not an object.
    """
    import hjson
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not text.strip():
        raise ValueError("the file is empty")
    try:
        try:
            config = json.loads(text, object_pairs_hook=dict_raise_error_on_duplicate_keys)
        except json.JSONDecodeError as not_json:
            try:
                config = hjson.loads(text, object_pairs_hook=dict_raise_error_on_duplicate_keys)
            except (hjson.HjsonDecodeError, OverflowError):
                raise ValueError(f"not JSON: {not_json} (nor hjson, which DeepSpeed also reads)") from None
    except RecursionError:  # either parser, on arrays or objects nested some thousands deep
        raise ValueError("arrays or objects nested too deeply to read") from None
    if not isinstance(config, dict):
        raise ValueError(f"the top level is {json_type(config)}, not an object")
    return config


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
        raise DGCConfigError(f"'{DGC_SECTION}' must be a JSON object, got {json_type(section)}")
    odd = [k for k in section if not isinstance(k, str)]
    if odd:
        raise DGCConfigError(f"'{DGC_SECTION}' keys must be strings, got {odd[0]!r}")
    try:
        return DGCConfig(**section)
    except ValidationError as err:
        raise DGCConfigError(f"invalid ds_config section '{DGC_SECTION}': " + _format_validation_error(err)) from None


def switched_off_by_default(cfg: Optional[DGCConfig]) -> Optional[str]:
    """The warning for a ``"dgc"`` section that does not say ``"enabled"`` (which defaults to false, as DeepSpeed's own
    sections do), naming the settings it holds; None where it says it (either way) or is absent.

    A section with settings and no switch is most likely a slip: the run would otherwise train as stock with nothing
    in the log.
    """
    if cfg is None or "enabled" in cfg.model_fields_set:
        return None
    named = sorted(cfg.model_fields_set)
    holds = f"sets {', '.join(repr(k) for k in named)}" if named else "is empty"
    return (f"deepspeed_dgc: the ds_config's '{DGC_SECTION}' section {holds} but not '{DGC_SECTION}.enabled', which "
            "defaults to false: gradient compression is OFF and ZeRO-3 reduces as stock. Add \"enabled\": true to "
            "switch it on (or \"enabled\": false to keep it off without this warning)")


def misspelled_section(ds_config: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The warning for top-level ds_config keys that look like a misspelled ``"dgc"`` (``"DGC"``, ``"dcg"``,
    ``"dgc_config"``), which DeepSpeed ignores as it ignores every unknown key; None where there are none."""
    if not isinstance(ds_config, Mapping):
        return None
    near = [k for k in ds_config if isinstance(k, str) and k != DGC_SECTION and (
        k.lower().replace("-", "_") in ("dgc", "dgc_config", "deepspeed_dgc")
        or difflib.get_close_matches(k.lower(), [DGC_SECTION], n=1, cutoff=0.6))]
    if not near:
        return None
    return (f"deepspeed_dgc: the ds_config has {', '.join(repr(k) for k in near)} at its top level, which DeepSpeed "
            f"ignores; the section deepspeed_dgc reads is spelled '{DGC_SECTION}' (lower case)"
            + ("" if DGC_SECTION in ds_config else ", and there is none: gradient compression is OFF"))


def check_engine_compatible(cfg: DGCConfig, engine) -> None:
    """Reject DeepSpeed settings that the compressed reduce-scatter cannot serve.

    Args:
        cfg: an enabled DGC config.
        engine: the ``DeepSpeedEngine`` being initialized.

    Raises:
        DGCConfigError: ZeRO stage is not 3, ``zero_optimization.zero_quantized_gradients`` is true (qgZ would compete for the
            same collective), or weight compression is combined with ``zero_quantized_weights``
            or ``zero_quantized_nontrainable_weights``.
    """
    stage = engine.zero_optimization_stage()
    if stage != 3:
        raise DGCConfigError(f"'dgc.enabled' requires 'zero_optimization.stage' = 3, got {stage}")
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
