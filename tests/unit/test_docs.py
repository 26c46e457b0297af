"""The repository's promises about itself: the config reference is current, the README is short, nothing points
outside the repository, and the package's modules import each other without cycles."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGE = ROOT / "deepspeed_dgc"


def test_config_reference_is_current():
    """docs/config.md equals what ``python -m deepspeed_dgc docs`` renders from the pydantic model; ``--check`` on a
    stale copy exits 1 naming the command that fixes it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ok = subprocess.run([sys.executable, "-m", "deepspeed_dgc", "docs", "--check"], capture_output=True, text=True,
                        timeout=300, cwd=ROOT, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr[-2000:]


def test_docs_check_fails_on_a_stale_reference(tmp_path):
    stale = tmp_path / "config.md"
    stale.write_text((ROOT / "docs" / "config.md").read_text().replace("top-k", "top-q", 1))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "deepspeed_dgc", "docs", "--check", "--path", str(stale)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 1 and "is stale: run `python -m deepspeed_dgc docs`" in proc.stderr


def test_readme_is_at_most_120_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 120


def test_nothing_points_outside_the_repository():
    """No source, doc or config refers to the workspace's shared folder (``../shared``), which a clone lacks."""
    hits = []
    for folder in ("deepspeed_dgc", "op_builder", "csrc", "benchmarks", "examples", "tests", "docs", "results", "configs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".cpp", ".cu", ".h", ".json") and path != Path(__file__):
                text = path.read_text(errors="replace")
                if "../shared" in text or "shared/DESIGN" in text:
                    hits.append(str(path.relative_to(ROOT)))
    assert "../shared" not in (ROOT / "README.md").read_text()
    assert not hits, hits


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules) -> set:
    """Modules of the package ``path`` imports (module level or inside functions), by name."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            for alias in node.names:  # "from . import wire" imports a module; "from .x import f" the module x
                out.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
    return {m for m in out if m in modules and m != name}


def test_no_import_cycle_among_the_package_modules():
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _imports(path, paths) for name, path in paths.items()}
    assert graph["deepspeed_dgc.zero3.reduce_scatter"] >= {"deepspeed_dgc.codec.wire", "deepspeed_dgc.comm.topology"}
    state, cycle = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycle, " -> ".join(cycle[0])


def test_relative_links_resolve():
    """Every relative Markdown link in README.md, docs/ and results/ names a file that exists (documents moved between
    docs/ and results/ keep their links)."""
    broken = []
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "results").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_product_carries_no_lab_record():
    """Comments and docstrings of the package and the kernels state behaviour, not dated measurements: no dates and
    no "took N ms" (measured runs live in results/)."""
    pattern = re.compile(r"20\d{2}-\d{2}-\d{2}|took [0-9.\-]+ ?ms\b")
    hits = []
    for folder in ("deepspeed_dgc", "csrc"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".cpp", ".cu", ".cuh", ".h"):
                hits += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in pattern.finditer(path.read_text())]
    assert not hits, hits
