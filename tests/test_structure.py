"""The shape of the code (docs/ARCHITECTURE.md): layers, import graph, sizes.

Data flows one way: entry points → integrations → front-end → its parts → state → store services →
orchestrator → persist → native, with ``errors``, ``arrays`` and ``version`` as leaves; each folder
of pccheck/ is one layer (LAYERS). Every import counts, at module level, inside a function or
under ``TYPE_CHECKING``: a cycle through any of them is a cycle a reader has to untangle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import pccheck
from pccheck.version import __version__

PKG = Path(pccheck.__file__).parent
REPO = Path(__file__).resolve().parent.parent

# Lowest first, one layer per folder of pccheck/; the top-level files are the leaves and the public
# faces (FACES), nothing else. A module may import its own layer and the ones below, never one above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaf", ("pccheck.errors", "pccheck.arrays", "pccheck.version")),
    ("native", ("pccheck.native",)),
    ("persist", ("pccheck.persist",)),
    ("orchestrator", ("pccheck.orchestrator",)),
    ("store services", ("pccheck.ops", "pccheck.group", "pccheck.sharded", "pccheck.transparent", "pccheck.tiers")),
    ("state", ("pccheck.state",)),
    ("front-end parts", ("pccheck.lazy", "pccheck.spread", "pccheck.tuner", "pccheck.prepare")),
    ("front-end", ("pccheck.checkpointer", "pccheck.restore", "pccheck.options")),
    ("integrations", ("pccheck.integrations",)),
    ("entry", ("pccheck", "pccheck.aio", "pccheck.dcp", "pccheck.hf", "pccheck.lightning", "pccheck.tune",
               "pccheck.demo", "pccheck.commands")),
]
LEAVES = {"errors", "arrays", "version"}
FACES = {"__init__", "checkpointer", "restore", "options", "aio", "dcp", "hf", "lightning", "tune", "demo"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The pccheck modules ``name`` imports anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # pccheck.native._native (compiled) -> pccheck.native
                t = t.rpartition(".")[0]
            if t.startswith("pccheck") and t != name:
                out.add(t)
    return out


def _layer_of(mod: str) -> int:
    best, found = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:  # "pccheck" is the package's __init__ only, not every module under it
            if (mod == p or (p != "pccheck" and mod.startswith(p + "."))) and len(p) > best:
                best, found = len(p), i
    assert found is not None, f"{mod} belongs to no layer: add it to LAYERS (and to docs/ARCHITECTURE.md)"
    return found


def test_layers_are_folders_and_the_top_level_holds_only_faces_and_leaves():
    top = {p.stem for p in PKG.glob("*.py")}
    assert top <= FACES | LEAVES, f"implementation modules at the top level (move them into a folder): {top - FACES - LEAVES}"
    folders = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    named = [p for _, prefixes in LAYERS for p in prefixes]
    for p in named:
        rel = p.split(".")[1:]
        assert len(rel) <= 1 and (not rel or rel[0] in folders or rel[0] in top), f"{p}: a layer names folders or top-level files"
    assert folders <= {p.split(".")[1] for p in named if "." in p}, "every folder has a layer"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def test_no_import_cycles(graph):
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_module_imports_a_layer_above_it(graph):
    bad = [f"{m} ({LAYERS[_layer_of(m)][0]}) imports {n} ({LAYERS[_layer_of(n)][0]})"
           for m, targets in sorted(graph.items()) for n in sorted(targets) if _layer_of(n) > _layer_of(m)]
    assert not bad, "\n".join(bad)


def test_only_the_orchestrator_opens_the_store_and_only_the_core_touches_native(graph):
    store = [m for m, t in graph.items() if "pccheck.persist.store" in t
             and not m.startswith(("pccheck.orchestrator", "pccheck.persist"))]
    native = [m for m, t in graph.items() if "pccheck.native" in t
              and not m.startswith(("pccheck.orchestrator", "pccheck.persist", "pccheck.native"))]
    assert not store, f"only the orchestrator imports the store: {store}"
    assert not native, f"only persist and the orchestrator import native: {native}"


def test_import_pccheck_loads_no_profiler_torch_or_cupy():
    code = ("import sys, pccheck; "
            "print(sorted(m for m in ('pccheck.tuner.profile', 'pccheck.tuner.search', 'torch', 'cupy') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _python_files() -> list[Path]:
    files = sorted(PKG.rglob("*.py"))
    if (REPO / "bench").is_dir():  # the source tree's bench/ (not installed)
        files += sorted((REPO / "bench").rglob("*.py"))
    return files


def test_no_file_over_600_lines_and_no_function_over_80():
    long_files = [f"{p}: {n}" for p in _python_files() if (n := len(p.read_text().splitlines())) > 600]
    long_funcs = []
    for p in _python_files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long_funcs.append(f"{p}:{node.lineno} {node.name}: {n} lines")
    assert not long_files and not long_funcs, "\n".join(long_files + long_funcs)


def test_version_matches_pyproject():
    pyproject = REPO / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("no source tree beside the tests")
    assert tomllib.loads(pyproject.read_text())["project"]["version"] == __version__ == pccheck.__version__


# bench/__init__.py's contract: each role goes by one name (run, targets, report, plot, main).
BENCH_ROLE_VARIANTS = {"run_benchmark", "run_cycles", "print_report", "_report", "_plot"}


def test_bench_is_folders_by_job_and_names_its_roles_one_way(monkeypatch):
    bench = REPO / "bench"
    if not bench.is_dir():
        pytest.skip("no source tree beside the tests")
    assert {p.name for p in bench.glob("*.py")} == {"__init__.py", "__main__.py"}, "bench modules go in a folder"
    # `python -m bench.X` finds X in the runnable folders (bench/__init__.py's __path__): one X per name
    monkeypatch.setattr(sys, "path", [*sys.path, str(REPO)])  # bench/ is not installed: after site-packages
    from bench import RUNNABLE_FOLDERS

    names = [p.stem for f in RUNNABLE_FOLDERS for p in (bench / f).glob("*.py") if p.stem not in ("__init__", "__main__")]
    shadowed = {n for n in names if (bench / n).is_dir() and not (bench / n / "__main__.py").is_file()}  # gpu runs it
    dup = sorted({n for n in names if names.count(n) > 1} | shadowed)
    assert not dup, f"bench.X would be ambiguous for {dup}"
    bad = [f"{p.relative_to(REPO)}: {n.name}" for p in sorted(bench.glob("*/*.py"))
           for n in ast.parse(p.read_text()).body
           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in BENCH_ROLE_VARIANTS]
    assert not bad, "name these roles run / targets / report / plot (bench/__init__.py):\n" + "\n".join(bad)
