"""The small ZeRO-3 models, base ds_config and inputs the scenarios share."""

import copy
from typing import Optional

import torch
import deepspeed
from torch.utils.checkpoint import checkpoint
from deepspeed.utils import safe_get_full_fp32_param

BASE = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 1000000,
}


class Lion(torch.optim.Optimizer):
    """Lion in plain PyTorch (Chen et al., "Symbolic Discovery of Optimization Algorithms", NeurIPS 2023, Algorithm 2):
    ``p <- p (1 - lr wd) - lr sign(b1 m + (1 - b1) g)``, then ``m <- b2 m + (1 - b2) g`` (``exp_avg``, fp32 like
    ``p``). An optimizer DeepSpeed did not build, handed to ``deepspeed.initialize`` by the user."""

    def __init__(self, params, lr: float, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-lr)
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


# optimizers a user passes to deepspeed.initialize (``Train.client_optimizer``): name -> (class, settings)
CLIENT_OPTIMIZERS = {"lion": (Lion, {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1})}


class Net(torch.nn.Module):
    """Odd sizes so partitions are padded: 24 -> 101 -> 37; weights above and below the bucket size."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(24, 101)
        self.ln = torch.nn.LayerNorm(101)
        self.l2 = torch.nn.Linear(101, 37)

    def forward(self, x, y):
        h = self.l2(self.ln(torch.nn.functional.gelu(self.l1(x))))
        return torch.nn.functional.mse_loss(h.float(), y.float())


class EmbedNet(torch.nn.Module):
    """An embedding of 64 rows of 12 (scale groups span rows) of which the inputs use only the first 16, then 12 -> 37."""

    USED_ROWS = 16

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 12)
        self.l2 = torch.nn.Linear(12, 37)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.l2(self.emb(x).mean(dim=1)).float(), y.float())


class WideNet(torch.nn.Module):
    """24 -> 4096 -> 37 (about 250k parameters in 4 tensors): per-element costs dominate per-tensor ones."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(24, 4096)
        self.l2 = torch.nn.Linear(4096, 37)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.l2(torch.nn.functional.gelu(self.l1(x))).float(), y.float())


class SkipLastNet(torch.nn.Module):
    """Net's layers and a side layer (24 -> 37) that every second forward leaves out: with 2 micro-steps per step,
    the side layer has a gradient in the first and none in the last (the window's end)."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(24, 101)
        self.l2 = torch.nn.Linear(101, 37)
        self.side = torch.nn.Linear(24, 37)
        self.calls = 0

    def forward(self, x, y):
        h = self.l2(torch.nn.functional.gelu(self.l1(x)))
        if self.calls % 2 == 0:
            h = h + self.side(x)
        self.calls += 1
        return torch.nn.functional.mse_loss(h.float(), y.float())


class ReentrantNet(Net):
    """Net in two segments of reentrant activation checkpointing (``use_reentrant=True``, what DeepSpeed's own
    ``checkpointing.checkpoint`` and HF's default do), the loss outside them: backward recomputes each segment in a
    backward of its own (autograd's reentrant phases), the second segment's parameters' gradients first."""

    def forward(self, x, y):
        # a reentrant segment's output needs an input that requires grad, else no gradient reaches its parameters
        h = checkpoint(lambda t: torch.nn.functional.gelu(self.l1(t)), x.requires_grad_(), use_reentrant=True)
        h = checkpoint(lambda t: self.l2(self.ln(t)), h, use_reentrant=True)
        return torch.nn.functional.mse_loss(h.float(), y.float())


MODELS = {"net": Net, "embed": EmbedNet, "wide": WideNet, "skiplast": SkipLastNet, "reentrant": ReentrantNet}


def check_model(name: str) -> None:
    """Raises ValueError naming the known models when ``name`` is not one of them."""
    if name not in MODELS:
        raise ValueError(f"model {name!r}: expected one of {sorted(MODELS)}")


def merge(base: dict, extra: dict) -> dict:
    """``extra`` merged into a copy of ``base``: nested dicts key by key (an ``"optimizer"`` is replaced whole),
    ``None`` removes a key."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict) and key != "optimizer":
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def make_engine(config: dict, model: str = "net", client_optimizer: Optional[str] = None):
    """A DeepSpeed engine of a freshly seeded ``MODELS[model]`` under ``config``; with ``client_optimizer`` (a key of
    :data:`CLIENT_OPTIMIZERS`) the user's optimizer is passed instead of the config's (its ``"optimizer"`` dropped)."""
    torch.manual_seed(0)
    module = MODELS[model]()
    optimizer = None
    if client_optimizer is not None:
        cls, settings = CLIENT_OPTIMIZERS[client_optimizer]
        optimizer = cls(module.parameters(), **settings)
        config = merge(config, {"optimizer": None, "zero_allow_untested_optimizer": True})
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), optimizer=optimizer,
                                           config=config)
    return engine


def full_params(engine):
    """Every parameter's full fp32 master copy (None for a frozen one: DeepSpeed keeps no fp32 copy reachable)."""
    if not hasattr(engine.optimizer, "optimizer"):  # an engine without optimizer keeps no fp32 master copy
        return []
    values = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
    return [None if v is None else v.clone() for v in values]


def batches(rank: int, steps: int, micro: int, dtype: torch.dtype, model: str = "net"):
    """``steps`` lists of ``micro`` ``(x, y)`` inputs of this rank (seeded by the rank): x float ``(4, 24)`` in
    ``dtype`` (EmbedNet: int64 token ids ``(4, 3)`` of its used rows), y ``(4, 37)`` in ``dtype``."""
    gen = torch.Generator().manual_seed(100 + rank)

    def x():
        if model == "embed":  # token ids of the used rows only
            return torch.randint(0, EmbedNet.USED_ROWS, (4, 3), generator=gen)
        return torch.randn(4, 24, generator=gen).to(dtype)

    return [[(x(), torch.randn(4, 37, generator=gen).to(dtype)) for _ in range(micro)] for _ in range(steps)]


def dtype_of(cfg: dict) -> torch.dtype:
    """The engine's compute dtype under ``cfg``: fp16, bf16 or fp32."""
    if cfg.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.bfloat16 if cfg.get("bf16", {}).get("enabled") else torch.float32
