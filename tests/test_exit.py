"""Every way a script can end leaves pccheck's threads stopped and joined (pccheck/shutdown.py).

A daemon thread still in native code when the interpreter finalizes is ended by ``pthread_exit``,
and the forced unwind through a C++ destructor aborts the process ("terminate called without an
active exception", SIGABRT). Each scenario below runs in fresh forked processes, 20 times (the
driver, tests/_exit_child.py, says how). Each run must end with the script's own exit code, print
nothing of pccheck's on stderr, and, where a Checkpointer was left open, leave its newest
checkpoint committed (closed at exit as ``close()`` would).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pccheck

RUNS = 20       # per scenario in the slow round
RUNS_DEFAULT = 4  # in `make test` (the code before the fix aborted in about half the runs of two endings: 1/256 to miss it)
CHILD = Path(__file__).with_name("_exit_child.py")
# KIND:ENDING (see _exit_child.scenario) -> the exit code the script asks for
CODES = {"end": 0, "raise": 1, "signal": 7}
SCENARIOS = ["lazy:end", "lazy:raise", "lazy:signal", "lazy-wait:end", "aio:end", "open:end", "open:signal",
             "spread:end", "memory:end", "remote:end"]
# every kind with every ending: `make test-slow`
ALL = [f"{k}:{e}" for k in ("lazy", "lazy-wait", "aio", "open", "spread", "memory", "remote") for e in CODES]
TRACEBACK = re.compile(r"Traceback \(most recent call last\):\n(?:  .*\n)+RuntimeError: the script failed\n")


def _drive(root: Path, names: list[str], env: dict[str, str], drivers: int = 2, runs: int = RUNS) -> dict[str, list[dict]]:
    """Runs every scenario ``runs`` times, split over ``drivers`` driver processes at once."""
    subprocess.run([sys.executable, str(CHILD), "make", str(root)], check=True, timeout=300)
    procs = [subprocess.Popen([sys.executable, str(CHILD), "run", str(root), str(runs), ",".join(names[i::drivers])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(drivers)]
    runs: dict[str, list[dict]] = {}
    for p in procs:
        out, err = p.communicate(timeout=1800)
        assert p.returncode == 0, err[-3000:]
        for line in out.splitlines():
            d = json.loads(line)
            runs.setdefault(d["scenario"], []).append(d)
    return runs


def _env(s3_server, tmp: Path) -> dict[str, str]:
    env = {**os.environ, **s3_server.env(), "EXIT_TEST_S3": f"s3://{s3_server.bucket}/exit-{tmp.name}",
           "AWS_CONFIG_FILE": str(tmp / "no-aws-config"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-aws-creds")}
    for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def ended(s3_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("exit")
    return root, _drive(root, SCENARIOS, _env(s3_server, root), runs=RUNS_DEFAULT), _env(s3_server, root)


def _check(root: Path, name: str, runs: list[dict], env: dict[str, str], monkeypatch, expected: int = RUNS) -> None:
    kind, ending = name.split(":")
    assert len(runs) == expected, f"{name}: {len(runs)} of {expected} runs reported"
    bad = [(r["run"], r["rc"], r["stderr"][-400:]) for r in runs if r["rc"] != CODES[ending]]
    assert not bad, f"{name}: {len(bad)} of {len(runs)} runs ended with another exit code: {bad[:3]}"
    for r in runs:
        rest = TRACEBACK.sub("", r["stderr"], count=1) if ending == "raise" else r["stderr"]
        assert rest == "", f"{name} run {r['run']}: stderr {r['stderr'][-800:]!r}"
    # A Checkpointer left open was closed at exit: its newest checkpoint is committed.
    newest = {"open": 5, "memory": 4, "spread": 5}  # spread: the one gathering, finished as the last call's step
    for r in runs:
        if kind in newest:
            assert pccheck.load_latest(root / f"{kind}-{ending}-{r['run']}").step == newest[kind], f"{name} run {r['run']}"
    if kind == "remote":
        for k, v in env.items():
            if k.startswith("AWS_"):
                monkeypatch.setenv(k, v)
        for r in (runs[0], runs[-1]):  # the upload in flight at the end was finished, not cut off
            assert pccheck.load_latest(f"{env['EXIT_TEST_S3']}/{ending}-{r['run']}").step == 5, f"{name} run {r['run']}"


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_ending_exits_with_the_scripts_code_and_nothing_from_pccheck(ended, name, monkeypatch):
    root, runs, env = ended
    _check(root, name, runs[name], env, monkeypatch, expected=RUNS_DEFAULT)


@pytest.mark.slow
def test_every_kind_with_every_ending(s3_server, tmp_path, monkeypatch):
    env = _env(s3_server, tmp_path)
    runs = _drive(tmp_path, ALL, env)
    for name in ALL:
        _check(tmp_path, name, runs[name], env, monkeypatch)


def test_python_m_pccheck_runs_the_cli_and_the_old_path_still_works(tmp_path):
    for mod in ("pccheck", "pccheck.cli"):
        out = subprocess.run([sys.executable, "-m", mod, "--help"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "Usage: pccheck" in out.stdout and "verify" in out.stdout
    out = subprocess.run([sys.executable, "-m", "pccheck", "verify", str(tmp_path / "none"), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and json.loads(out.stdout)  # the command itself, with its exit codes
    old = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", "import pccheck.cli"],
                         capture_output=True, text=True, timeout=120)
    assert old.returncode != 0 and "python -m pccheck" in old.stderr  # the old path warns, naming the new
