"""DeepSpeed's universal checkpoint of any method's ZeRO-3 checkpoint, also where the optimizer keeps no Adam moments.

A checkpoint resumes at another data-parallel world size through DeepSpeed's universal checkpoint (``ds_to_universal``,
then ``"checkpoint": {"load_universal": true}``). DeepSpeed 0.19.8's converter reads ``exp_avg`` and ``exp_avg_sq`` of
every ZeRO-3 sub-group's optimizer state, and its universal load reads the ``step`` of sub-group 0: on a checkpoint
whose optimizer keeps no Adam moments it raises ``KeyError`` (``0`` where the state is empty, ``'exp_avg'`` where it
holds only a step count). That is every checkpoint of decoupled momentum's sign update (which never writes Adam's
moments) and of SGD (momentum correction's, or stock's).

:func:`convert` runs DeepSpeed's converter on a staged copy of the checkpoint folder: links to its files, except the
optimizer files that lack the moments, which are copied with zeros for them and a step of 0, the state of Adam before
its first step (the checkpoint itself is not changed). It writes what it filled, why, and the saved optimizer state a
universal checkpoint does not hold (SGD's ``momentum_buffer``) to ``<output_folder>/dgc_universal.json``
(:data:`~deepspeed_dgc.zero3.switching.MARKER`); the load reads it and says that those moments start from zero (a run
whose step does not read them drops the zeros: :func:`~deepspeed_dgc.zero3.switching.optimizer_note`). A checkpoint
with Adam's moments is converted as DeepSpeed converts it, and no note is written.

The side-cars are not copied: loading ``<tag>_universal`` reads them from ``<tag>`` beside it
(:func:`~deepspeed_dgc.zero3.checkpoint.sidecar_dir`), so the output folder must be named so, next to the input.

Command line (the options of DeepSpeed's converter)::

    python -m deepspeed_dgc universal --input_folder ckpt/global_step5 --output_folder ckpt/global_step5_universal
"""

import argparse
import glob
import json
import os
import re
import shutil
import sys
from typing import List, Optional, Sequence

import torch

from . import switching

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
STAGING_SUFFIX = ".dgc_staging"


class DGCUniversalError(RuntimeError):
    """The checkpoint folder cannot be converted (no optimizer files, or DeepSpeed's converter failed)."""


def _optim_files(folder: str) -> List[str]:
    """The ZeRO optimizer files of a checkpoint folder (ZeRO-3's own where there are, as DeepSpeed's converter picks)."""
    files = sorted(glob.glob(os.path.join(folder, "*optim_states.pt")))
    zero3 = [f for f in files if re.match(r"(?:bf16_)?zero_pp_rank_", os.path.basename(f))]
    return zero3 or files


def _reason(folder: str, param_groups) -> str:
    """Why a checkpoint's optimizer keeps no Adam moments, for the note: its side-car's method, else its optimizer."""
    from .checkpoint import DGCCheckpointError, read_sidecar, sidecar_name  # checkpoint imports switching, not this
    config = None
    path = os.path.join(folder, sidecar_name(0))
    if os.path.isfile(path):
        try:
            config = read_sidecar(path).get("config")
        except DGCCheckpointError:
            config = None
    if switching.sign_update(config):
        return "decoupled momentum's sign update keeps none"
    if switching.method_of(config) == "momentum_correction":
        return "momentum correction's SGD keeps none"
    group = (param_groups or [{}])[0]
    if "betas" not in group:
        return "the saved optimizer is not Adam" + (" (SGD with momentum)" if group.get("momentum") else "")
    return "the saved optimizer state holds none"


def stage(input_folder: str, staging: str) -> Optional[dict]:
    """Fill in what DeepSpeed's converter needs: ``staging`` gets a link to every file of ``input_folder``, except
    the ZeRO-3 optimizer files whose sub-groups lack ``exp_avg`` or ``exp_avg_sq``, copied with zeros for them and a
    step of 0. Returns the note for :data:`switching.MARKER` (``filled``, ``not_carried``, ``reason``, ``source``), or
    None where nothing was missing (``staging`` is then not needed)."""
    files = _optim_files(input_folder)
    if not files:
        raise DGCUniversalError(f"{input_folder} holds no *optim_states.pt file: not a ZeRO checkpoint folder")
    os.makedirs(staging)
    filled, other, groups = set(), set(), None
    for path in files:
        sd = torch.load(path, map_location="cpu", weights_only=False)
        outer = sd.get("optimizer_state_dict", {})
        if outer.get("zero_stage", 1) != 3:
            return None  # DeepSpeed's ZeRO-1/2 path reads its own layout; left to it
        inner = outer["optimizer_state_dict"]
        groups = groups or inner.get("param_groups")
        state = inner.setdefault("state", {})
        changed = False
        for idx, flat in enumerate(outer["fp32_flat_groups"]):
            st = state.setdefault(idx, {})
            other.update(k for k in st if k not in ADAM_MOMENTS and k != "step")
            missing = [k for k in ADAM_MOMENTS if k not in st]
            if missing:
                for k in missing:
                    st[k] = torch.zeros_like(flat, dtype=torch.float32)
                st["step"] = torch.tensor(0.0)  # Adam's state before its first step: bias corrections start over
                filled.update(missing)
                changed = True
        if changed:
            torch.save(sd, os.path.join(staging, os.path.basename(path)))
    if not filled:
        return None
    for path in glob.glob(os.path.join(input_folder, "*")):
        target = os.path.join(staging, os.path.basename(path))
        if not os.path.exists(target):
            os.symlink(os.path.abspath(path), target)
    return {"format": 1, "source": os.path.abspath(input_folder), "filled": sorted(filled),
            "not_carried": sorted(other), "reason": _reason(input_folder, groups)}


def convert(input_folder: str, output_folder: str, num_extract_workers: int = 1, num_merge_workers: int = 1,
            keep_temp_folder: bool = False, strict: bool = True) -> Optional[dict]:
    """DeepSpeed's ``ds_to_universal`` of ``input_folder`` into ``output_folder`` (which also writes ``latest_universal``
    beside it), through :func:`stage` where the optimizer keeps no Adam moments; returns the note written to
    ``output_folder/dgc_universal.json``, or None (nothing was missing).

    Raises:
        DGCUniversalError: no optimizer files, or DeepSpeed's converter failed (its error chained).
    """
    from deepspeed.checkpoint import ds_to_universal

    input_folder, output_folder = os.path.abspath(input_folder), os.path.abspath(output_folder)
    staging = output_folder.rstrip(os.sep) + STAGING_SUFFIX
    shutil.rmtree(staging, ignore_errors=True)
    try:
        note = stage(input_folder, staging)
        args = argparse.Namespace(input_folder=staging if note else input_folder, output_folder=output_folder,
                                  num_extract_workers=num_extract_workers, num_merge_workers=num_merge_workers,
                                  keep_temp_folder=keep_temp_folder, strict=strict, inject_missing_state=False)
        try:
            ds_to_universal.main(args)
        except Exception as err:
            raise DGCUniversalError(f"DeepSpeed's ds_to_universal failed on {input_folder} ({type(err).__name__}: "
                                    f"{err})") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if note:
        with open(os.path.join(output_folder, switching.MARKER), "w") as f:
            json.dump(note, f, indent=1)
    if os.path.basename(output_folder) != os.path.basename(input_folder) + "_universal" or (
            os.path.dirname(output_folder) != os.path.dirname(input_folder)):
        print(f"deepspeed_dgc: {output_folder} is not <input>_universal beside {input_folder}: a run with DGC on "
              "will not find the side-cars of the saved run (name it so, or load it with DGC off)", file=sys.stderr)
    return note


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepspeed_dgc universal",
                                 description="DeepSpeed's ds_to_universal, also for checkpoints without Adam's moments "
                                             "(decoupled momentum's sign update, SGD)")
    ap.add_argument("--input_folder", required=True, help="the checkpoint's tag folder, e.g. ckpt/global_step5")
    ap.add_argument("--output_folder", required=True, help="ckpt/<tag>_universal (where DGC runs find the side-cars)")
    ap.add_argument("--num_extract_workers", type=int, default=1)
    ap.add_argument("--num_merge_workers", type=int, default=1)
    ap.add_argument("--keep_temp_folder", action="store_true")
    ap.add_argument("--no_strict", dest="strict", action="store_false")
    args = ap.parse_args(argv)
    src, out = os.path.abspath(args.input_folder), os.path.abspath(args.output_folder)
    if os.path.basename(out) != os.path.basename(src) + "_universal" or os.path.dirname(out) != os.path.dirname(src):
        print(f"deepspeed_dgc universal: --output_folder must be {src}_universal, beside the input's tag folder (a run "
              f"with DGC on finds the saved run's side-cars through that name), got {out}", file=sys.stderr)
        return 2
    try:
        note = convert(args.input_folder, args.output_folder, args.num_extract_workers, args.num_merge_workers,
                       args.keep_temp_folder, args.strict)
    except DGCUniversalError as e:
        print(f"deepspeed_dgc universal: {e}", file=sys.stderr)
        return 1
    if note:
        print(f"deepspeed_dgc: {args.input_folder}'s optimizer state held no {' and '.join(note['filled'])} "
              f"({note['reason']}): the universal checkpoint holds zeros for them and step 0, so they start from zero "
              "when it is loaded" + (f"; not carried: {', '.join(note['not_carried'])}" if note["not_carried"] else ""))
    return 0
