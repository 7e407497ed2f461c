"""The docs site builds with ``mkdocs build --strict``: a broken link between the pages
(README.md, docs/, bench/README.md), a missing anchor, a page left out of the nav, or an API
reference to a name or a docstring parameter that no longer exists fails the suite."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not (ROOT / "mkdocs.yml").is_file(), reason="no source tree beside the tests")
def test_docs_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is not installed: `make setup` installs the docs extra (.[docs])"
    env = {**os.environ, "DISABLE_MKDOCS_2_WARNING": "true", "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([mkdocs, "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    problems = [line for line in (r.stdout + r.stderr).splitlines() if "WARNING" in line or "ERROR" in line]
    assert r.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(problems or [r.stderr[-3000:]])
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "docs" / "api" / "index.html").is_file()


@pytest.mark.skipif(not (ROOT / "bench").is_dir(), reason="no source tree beside the tests")
def test_every_python_m_command_in_the_docs_names_a_runnable_module(monkeypatch):
    """Each ``python -m bench.X`` / ``python -m pccheck.X`` the docs, the Makefile and the scripts
    give still names a module with a ``main`` (or a package with a ``__main__``), wherever the code
    lives (bench/X.py and pccheck/demo.py are faces over their folders)."""
    monkeypatch.syspath_prepend(str(ROOT))
    sources = [ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "Makefile",
               *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "scripts").glob("*.sh"))]
    names = {m for p in sources if p.is_file()
             for m in re.findall(r"(?:python3?|\$\(PY\)) -m ((?:bench|pccheck)(?:\.[a-z_0-9]+)*)\b(?!\.)", p.read_text())}
    assert {"bench", "bench.persist", "bench.overhead", "pccheck.demo"} <= names
    for name in sorted(names):
        spec = importlib.util.find_spec(name)
        assert spec is not None, f"`python -m {name}` (in the docs) names no module"
        if spec.submodule_search_locations is not None:  # a package: runs its __main__
            assert importlib.util.find_spec(f"{name}.__main__") is not None, f"`python -m {name}`: no __main__"
        else:
            assert callable(getattr(importlib.import_module(name), "main", None)), f"`python -m {name}`: no main()"
