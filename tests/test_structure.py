"""The shape of the code (docs/ARCHITECTURE.md): layers, import graph, sizes.

Data flows one way: entry points → integrations → front-end → its parts → state → store services →
orchestrator → persist → native, with ``errors``, ``arrays`` and ``version`` as leaves; each folder
of pccheck/ is one layer (LAYERS). Every import counts, at module level, inside a function or
under ``TYPE_CHECKING``: a cycle through any of them is a cycle a reader has to untangle.
"""

from __future__ import annotations

import ast
import re
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
    ("leaf", ("pccheck.errors", "pccheck.arrays", "pccheck.version", "pccheck.shutdown")),
    ("native", ("pccheck.native",)),
    ("persist", ("pccheck.persist",)),
    ("orchestrator", ("pccheck.orchestrator",)),
    ("store services", ("pccheck.ops", "pccheck.group", "pccheck.sharded", "pccheck.transparent", "pccheck.tiers")),
    ("state", ("pccheck.state",)),
    ("front-end parts", ("pccheck.lazy", "pccheck.spread", "pccheck.tuner", "pccheck.prepare", "pccheck.preemption")),
    ("front-end", ("pccheck.checkpointer", "pccheck.restore", "pccheck.options")),
    ("integrations", ("pccheck.integrations",)),
    ("entry", ("pccheck", "pccheck.aio", "pccheck.dcp", "pccheck.hf", "pccheck.lightning", "pccheck.tune",
               "pccheck.demo", "pccheck.commands", "pccheck.__main__", "pccheck.cli")),
]
LEAVES = {"errors", "arrays", "version", "shutdown"}
FACES = {"__init__", "__main__", "cli", "checkpointer", "restore", "options", "aio", "dcp", "hf", "lightning", "tune",
         "demo"}


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


def _orchestrators_built(source: str) -> list[str]:
    """Where ``source`` builds an Orchestrator itself: a call of anything named ``Orchestrator``
    (plain, ``module.Orchestrator``, or an alias it imported under another name)."""
    tree = ast.parse(source)
    names = {"Orchestrator"} | {a.asname for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                                for a in node.names if a.name == "Orchestrator" and a.asname}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in names:
                out.append(f"line {node.lineno}: {name}(...)")
    return out


def test_the_orchestrator_check_catches_each_spelling():
    assert _orchestrators_built("from x import Orchestrator\no = Orchestrator(p)")
    assert _orchestrators_built("from x import Orchestrator as O\no = O(p)")
    assert _orchestrators_built("import pccheck.orchestrator.orchestrator as m\no = m.Orchestrator(p)")
    assert not _orchestrators_built("from x import TierStack\ns = TierStack(ctx)")


def test_every_entry_point_gets_its_tiers_through_the_stack():
    """No module under pccheck/integrations builds an Orchestrator: each opens its disk store
    and its tiers through tiers.stack.TierStack, so a tier added there reaches every entry point."""
    bad = {str(p.relative_to(PKG)): hits for p in sorted((PKG / "integrations").rglob("*.py"))
           if (hits := _orchestrators_built(p.read_text()))}
    assert not bad, f"integrations build an Orchestrator instead of a TierStack: {bad}"


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


# -- the tree speaks of the project only ----------------------------------------------------------
# Names, comments, docstrings, docs, test names and result files give the reason for a thing, never
# the ticket, the working session or the person it came from: those mean nothing to a reader of
# the tree. Another project's issue is cited as "<project> #N" (a name in OTHER_PROJECTS, or an
# owner/repo), or by its URL. The patterns hold no example of what they catch, so this file
# passes its own scan; the samples in the pattern test are assembled at run time for the same reason.
OTHER_PROJECTS = ("pytorch", "torch", "torchtitan", "torchtune", "torchsnapshot", "Megatron-LM", "Megatron",
                  "NeMo", "NeMo-Automodel", "DeepSpeed", "transformers", "accelerate", "lightning",
                  "pytorch-lightning", "vllm", "CRIU", "cuda-checkpoint", "SeaweedFS", "MinIO", "boto3",
                  "botocore", "obstore", "fsspec", "safetensors", "numpy", "gloo", "NCCL", "CheckFreq",
                  "Gemini", "GoCkpt", "PCcheck")
_CITATION = re.compile(r"(?:\b[\w.-]+/[\w.-]+|(?<![\w-])(?:" + "|".join(map(re.escape, OTHER_PROJECTS))
                       + r"))\s*#\d+", re.IGNORECASE)
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
PROCESS_MENTIONS = {
    "an issue number": re.compile(r"(?<![a-z])issues?\s*[-_#]?\s*\d+|\bthis\s+issue\b|\bthe\s+issue's",
                                  re.IGNORECASE),
    # "#N" alone; not a colour ("#999"), an HTML entity, a format spec, an anchor ("#9-sharded"), or
    # the build number of a kernel's uname ("#1 SMP") in a recorded environment
    "an issue reference": re.compile(r"(?<![\w\"'&#/%:{.-])#\d+\b(?![-\w]| SMP)"),
    "a session": re.compile(r"\bsession\s*[-_]?\d+|(?<![\w./])s[1-9]\d\b", re.IGNORECASE),
    "who did it": re.compile(r"\bthe\s+helper\b(?!\s+(?:thread|threads|function|functions|process|module|script)\b)"
                             r"|\bhelper(?:'s|s')?\s+notes\b", re.IGNORECASE),
}
# In a file's path: "issue<N>" and "-s<NN>"-style session tags (one digit is S3's, or a step's: s3://, s1.json)
PROCESS_NAME_TAGS = re.compile(r"(?<![a-z])issue[-_]?\d+|session[-_]?\d+|(?:^|[-_/])s[1-9]\d(?=[-_./]|$)",
                               re.IGNORECASE)


def _tracked_files(exclude: tuple[str, ...] = ()) -> list[str]:
    """The repository's tracked files (``git ls-files``), minus those under the ``exclude`` prefixes."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f and not f.startswith(exclude)]


def _process_mentions(text: str) -> list[str]:
    """What ``text`` (one line) says of the project's development process, by kind."""
    text = _CITATION.sub(" ", _URL.sub(" ", text))
    return [kind for kind, pattern in PROCESS_MENTIONS.items() if pattern.search(text)]


def _scan_tree(exclude: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    """(text files read, ``file:line: kind: text`` for every mention and ``file: kind`` for every
    tagged path) over the tracked files outside ``exclude``."""
    found, scanned = [], 0
    for rel in _tracked_files(exclude):
        if PROCESS_NAME_TAGS.search(rel):
            found.append(f"{rel}: an issue or session tag in its name")
        path = REPO / rel
        if not path.is_file():  # deleted in the work tree, not yet in the index
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # not text (an image)
        scanned += 1
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            for kind in _process_mentions(line):
                found.append(f"{rel}:{n}: {kind}: {line.strip()[:160]}")
    return scanned, found


def test_the_mention_patterns_catch_the_process_and_let_citations_through():
    issue, session, helper = "iss" + "ue", "ses" + "sion", "the hel" + "per"
    caught = [f"see {issue} 29", f"{issue}-29's target", f"({issue}s 31 and 32)", f"test_{issue}31_order",
              "fixed in #" + "29", f"{session} 16 measured", "(s" + "17; s" + "16 received)", "run-s" + "15.json",
              f"{helper}'s notes", f"{helper} measured", f"as {issue} #" + "12 asked"]
    passed = ["torchtitan #" + "3884", "pytorch #" + "156207", "Megatron-LM #" + "1508", "NeMo-Automodel #" + "405",
              "huggingface/transformers#" + "123", f"https://github.com/pytorch/pytorch/{issue}s/" + "156207",
              'color="#' + '999"', "FORMAT.md#" + "9-sharded", "Linux 6.1 #" + "1 SMP", "s3://bucket/s1.json",
              "s1, s2 = store.acquire_slot()", "a helper thread", "the helpers above", "session-scoped fixture"]
    assert [s for s in caught if not _process_mentions(s)] == []
    assert [s for s in passed if _process_mentions(s)] == []
    assert PROCESS_NAME_TAGS.search(f"bench/results/gockpt-{issue}33-s" + "14-hog.json")
    assert not PROCESS_NAME_TAGS.search("tests/_s3proxy.py") and not PROCESS_NAME_TAGS.search("data/s1-x/s3.json")


def test_the_tree_speaks_of_the_project_only():
    """No tracked file names an issue of this project, a working session, or who did the work: in
    its path, or on any line of its text (code, comments, docstrings, docs, recorded results)."""
    scanned, found = _scan_tree()
    assert scanned >= 150, f"only {scanned} text files read from git ls-files: the scan would prove nothing"
    assert not found, ("give the reason or the fact instead (another project's issue: '<project> #N', with the "
                       "name in OTHER_PROJECTS):\n" + "\n".join(found))
