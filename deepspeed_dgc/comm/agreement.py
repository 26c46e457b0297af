"""All ranks agree on the effective ``"dgc"`` config and the software versions, or all fail.

Ranks that compress differently would exchange payloads of sizes the others do not expect, so
a mismatch must stop the job at initialize, on every rank, with a message naming the key.
"""

import hashlib
import json
from typing import Any, Dict, List, Optional

import torch
from deepspeed.accelerator import get_accelerator

from .communicators import wait_torch_work
from ..config import DGC_SECTION, DGCConfig, DGCConfigError


def effective_settings(cfg: DGCConfig, ranks_per_node: Optional[int]) -> Dict[str, Any]:
    """Flat ``{key: value}`` of what must be equal on every rank.

    Keys: every ``dgc.*`` config key (nested ``dgc.weights.*`` too), the resolved
    ``ranks_per_node`` (hierarchical topology, when given) and the versions of deepspeed, torch and
    deepspeed_dgc.
    """
    import deepspeed

    from .._version import __version__

    flat = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            flat[prefix] = value

    walk(DGC_SECTION, cfg.model_dump())
    if cfg.topology == "hierarchical" and ranks_per_node is not None:  # flat only labels bytes with it
        flat["ranks per node (resolved)"] = ranks_per_node
    flat["deepspeed version"] = deepspeed.__version__
    flat["torch version"] = torch.__version__
    flat["deepspeed_dgc version"] = __version__
    return flat


def settings_digest(settings: Dict[str, Any]) -> int:
    """A 63-bit hash of the settings (JSON with sorted keys, SHA-256)."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def describe_mismatch(everyone: List[Dict[str, Any]]) -> str:
    """Name each key whose value differs between ranks, with the value on rank 0 and on a differing rank."""
    keys = sorted(set().union(*everyone))
    parts = []
    for key in keys:
        values = [s.get(key, "<absent>") for s in everyone]
        odd = [r for r, v in enumerate(values) if v != values[0]]
        if odd:
            parts.append(f"'{key}' is {values[0]!r} on rank 0 but {values[odd[0]]!r} on rank(s) {odd}")
    return "; ".join(parts)


def check_agreement(cfg: DGCConfig, ranks_per_node: Optional[int], timeout_s: float) -> None:
    """Compare the hash of :func:`effective_settings` across the torch world; fail on every rank if any differs.

    Collective over the world (an all-gather of one int64, plus an object all-gather of the
    settings only when the hashes differ), bounded by ``timeout_s``.

    Raises:
        DGCConfigError: on every rank, naming each differing key and the ranks that differ.
        DGCTimeoutError: a rank did not join within ``timeout_s`` seconds.
    """
    settings = effective_settings(cfg, ranks_per_node)
    world = torch.distributed.get_world_size()
    device = get_accelerator().current_device_name()  # NCCL needs device tensors
    mine = torch.tensor([settings_digest(settings)], dtype=torch.int64, device=device)
    digests = torch.empty(world, dtype=torch.int64, device=device)
    work = torch.distributed.all_gather_into_tensor(digests, mine, async_op=True)
    wait_torch_work(work, "the config agreement check", torch.distributed.get_rank(), timeout_s)
    if bool((digests == digests[0]).all()):
        return
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, settings)
    raise DGCConfigError("the 'dgc' settings differ between ranks (every rank must use the same config and "
                         "versions): " + describe_mismatch(everyone))


def gather_int(value: int, what: str, timeout_s: float) -> List[int]:
    """Every rank's int64 ``value``, in rank order (collective over the torch world: an all-gather of one int64).

    Raises:
        DGCTimeoutError: a rank did not join within ``timeout_s`` seconds (``what`` names the step in the error).
    """
    world = torch.distributed.get_world_size()
    device = get_accelerator().current_device_name()
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    values = torch.empty(world, dtype=torch.int64, device=device)
    work = torch.distributed.all_gather_into_tensor(values, mine, async_op=True)
    wait_torch_work(work, what, torch.distributed.get_rank(), timeout_s)
    return values.tolist()


def ranks_failing(ok: bool, what: str, timeout_s: float) -> List[int]:
    """Which ranks of the torch world report ``ok = False`` (collective: :func:`gather_int`).

    Lets a failure that happens on some ranks only (e.g. an op that cannot load there) fail every
    rank at once, instead of leaving the others waiting in their next collective.

    Raises:
        DGCTimeoutError: a rank did not join within ``timeout_s`` seconds.
    """
    return [r for r, f in enumerate(gather_int(1 if ok else 0, what, timeout_s)) if not f]
