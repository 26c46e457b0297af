"""The repository's promises about itself: the config reference is current, the README is short, nothing points
outside the repository, the modules of the package, the benchmarks and the examples import each other without cycles,
and no file edits the import path (the import roots are the repository root and pytest.ini's)."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGE = ROOT / "deepspeed_dgc"
# the packages importable from the repository root, whose modules the cycle check covers
IMPORT_ROOTS = ("deepspeed_dgc", "benchmarks", "examples")


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
    """Modules of ``modules`` that ``path`` imports (module level or inside functions), by name."""
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


def test_no_import_cycle_among_the_modules():
    """No cycle among the modules of the package, the benchmarks and the examples (one graph: a benchmark importing
    an example that imports the benchmark is a cycle too). Imports inside functions count: a cycle is not undone by
    moving one of its imports into a function."""
    paths = {_module_name(p): p for root in IMPORT_ROOTS for p in (ROOT / root).rglob("*.py")}
    graph = {name: _imports(path, paths) for name, path in paths.items()}
    assert graph["deepspeed_dgc.zero3.reduce_scatter"] >= {"deepspeed_dgc.codec.wire", "deepspeed_dgc.comm.topology"}
    assert graph["benchmarks.bench_network"] >= {"benchmarks.configs", "benchmarks.launcher", "benchmarks.netlink",
                                                 "benchmarks.report", "benchmarks.stats", "benchmarks.two_nodes"}
    assert graph["benchmarks.ddp_powersgd"] >= {"examples.train_char_gpt"}
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


# an edit of sys.path: a call of its list methods that change it (insert, append, ...), an assignment to it or to a
# slice of it, +=
SYS_PATH_EDIT = re.compile(r"\bsys\.path\s*(\.\s*(insert|append|extend|remove|pop|clear)\s*\("
                           r"|(\[[^\]]*\]\s*)?\+?=(?!=))")
# tests/dist_launch.py runs a worker script in a forked rank as Python would start it (its folder first); setup.py
# imports op_builder while setuptools runs it
MAY_EDIT_SYS_PATH = {"setup.py", "tests/dist_launch.py"}


def test_no_file_edits_the_import_path():
    """Modules import each other by their names from the repository root (``from benchmarks import configs``,
    ``from examples.train_char_gpt import CharGPT``); the tests' further roots are pytest.ini's ``pythonpath``. No
    Python file (generated source in strings included) changes ``sys.path`` besides :data:`MAY_EDIT_SYS_PATH`."""
    files = [*ROOT.glob("*.py")] + [p for folder in ("deepspeed_dgc", "op_builder", "benchmarks", "examples", "tests")
                                    for p in (ROOT / folder).rglob("*.py")]
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in files
            if str(path.relative_to(ROOT)) not in MAY_EDIT_SYS_PATH
            for n, line in enumerate(path.read_text().splitlines(), 1) if SYS_PATH_EDIT.search(line)]
    assert len(files) > 100 and not hits, hits


def test_conftest_changes_nothing_at_import():
    """tests/conftest.py's module level only defines: the environment it sets (PATH, TORCH_EXTENSIONS_DIR) and the
    stale locks it deletes are a hook's work (``pytest_configure``), not an import's."""
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    top = [node for node in tree.body if not isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    effects = [ast.unparse(node) for node in top for sub in ast.walk(node)
               if isinstance(sub, ast.Attribute) and ast.unparse(sub) in ("os.environ", "sys.path", "os.unlink")]
    assert not effects, effects


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
