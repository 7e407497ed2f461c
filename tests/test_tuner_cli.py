"""``pccheck-tune`` end to end on small sizes: JSON output, the config it writes and reads back,
bad arguments (exit 2 with a message), and profiling a real training script (``-- python x.py``).
Nothing here asserts on speed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

import pccheck.tune
from pccheck.tuner import config, online
from pccheck.commands.tune_cli import app, parse_size

MiB = 1 << 20
# small and quick: an 8 MiB state, 2 thread counts, chunk sizes no larger than the state
SMALL = ["--size", "8MiB", "--threads", "1,2", "--chunks", "4MiB,8MiB", "--max-n", "3"]


def _tune(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pccheck.commands.tune_cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_entry_point_is_installed():
    exe = Path(sys.executable).with_name("pccheck-tune")
    assert exe.exists(), "pyproject.toml [project.scripts] pccheck-tune; run `make setup`"
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--iter-time" in r.stdout


def test_end_to_end_json_and_config_round_trip(tmp_path):
    r = _tune("--path", str(tmp_path), *SMALL, "--iter-time", "0.01", "--json", "--write-config")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    chosen, measured = doc["chosen"], doc["measured"]
    assert doc["config_written"] == str(tmp_path / config.CONFIG_NAME)
    assert chosen["objective"] == "overhead" and chosen["max_overhead"] == 1.03
    assert chosen["interval"] >= chosen["interval_eq3"] >= 1
    assert 1 <= chosen["max_concurrent"] <= 3 and chosen["writer_threads"] in (1, 2)
    assert chosen["chunk_size"] in (4 * MiB, 8 * MiB)
    assert chosen["expected_slowdown"] <= 1.03 + 1e-9 and chosen["recovery_bound_s"] > 0
    assert all(s["bytes_per_s"] > 0 for s in measured["copy"] + measured["storage"])
    assert [w["n"] for w in measured["write"]] == list(range(1, len(measured["write"]) + 1))
    assert all(w["tw_s"] > 0 for w in measured["write"])
    # what Checkpointer(interval="auto", ...) will get
    r2 = config.resolve_auto(tmp_path, "auto", "auto", "auto", "auto")
    assert {k: r2[k] for k in ("interval", "max_concurrent", "writer_threads", "chunk_size")} == {
        k: chosen[k] for k in ("interval", "max_concurrent", "writer_threads", "chunk_size")}
    assert r2["max_overhead"] == 1.03
    # the scratch store is gone; only the config stays
    assert [p.name for p in tmp_path.iterdir()] == [config.CONFIG_NAME]


def test_failure_rate_switches_to_goodput(tmp_path):
    r = CliRunner().invoke(app, ["--path", str(tmp_path), *SMALL, "--max-n", "1", "--iter-time", "0.01",
                                 "--failure-rate", "30", "--load-time", "1.5"])
    assert r.exit_code == 0, r.output
    assert "goodput" in r.output and "Young/Daly" in r.output and "recovery bound" in r.output
    assert not (tmp_path / config.CONFIG_NAME).exists()  # no --write-config


@pytest.mark.parametrize("args,message", [
    (["--size", "-1GiB", "--iter-time", "0.1"], "--size"),
    (["--size", "0", "--iter-time", "0.1"], "--size"),
    (["--size", "lots", "--iter-time", "0.1"], "cannot parse --size"),
    (["--size", "8MiB", "--iter-time", "-0.1"], "--iter-time"),
    (["--size", "8MiB"], "--iter-time"),
    (["--iter-time", "0.1"], "--size"),
    (["--size", "8MiB", "--iter-time", "0.1", "--max-overhead", "0.97"], "q >= 1"),
    (["--size", "8MiB", "--iter-time", "0.1", "--storage-budget", "8MiB"], "at least 2 checkpoints"),
    (["--size", "8MiB", "--iter-time", "0.1", "--dram-budget", "-2x"], "--dram-budget"),
    (["--size", "8MiB", "--iter-time", "0.1", "--failure-rate", "-3"], "--failure-rate"),
    (["--size", "8MiB", "--iter-time", "0.1", "--threads", "0"], "--threads"),
    (["--size", "8MiB", "--iter-time", "0.1", "--chunks", "5000"], "4096"),
])
def test_bad_arguments_exit_2_with_a_message(tmp_path, args, message):
    r = CliRunner().invoke(app, ["--path", str(tmp_path), *args])
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert not any(tmp_path.iterdir())  # nothing was profiled


def test_unwritable_path_exits_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    r = _tune("--path", str(blocker / "ckpt"), "--size", "8MiB", "--iter-time", "0.1")
    assert r.returncode == 2
    assert "not a writable directory" in r.stderr


def test_bad_arguments_in_json_mode_print_an_error_document(tmp_path):
    r = CliRunner().invoke(app, ["--path", str(tmp_path), "--size", "8MiB", "--iter-time", "0.1",
                                 "--max-overhead", "0.5", "--json"])
    assert r.exit_code == 2
    assert "q >= 1" in json.loads(r.output.splitlines()[0])["error"]


TRAIN = textwrap.dedent("""
    import sys, time
    import pccheck.tune
    print("training starts")  # goes to pccheck-tune's stderr, not into its JSON
    for step in range(int(sys.argv[1])):
        time.sleep(0.01)
        pccheck.tune.report_iteration(state_bytes={nbytes})
""")


def test_profiles_a_training_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN.format(nbytes=8 * MiB))
    r = _tune("--path", str(tmp_path / "ck"), "--threads", "2", "--chunks", "8MiB", "--max-n", "2",
              "--iterations", "20", "--warmup-iterations", "3", "--json", "--",
              sys.executable, str(script), "100000")  # stopped once it reported enough iterations
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["inputs"]["state_bytes"] == 8 * MiB  # reported by the script
    assert 0.01 <= doc["inputs"]["iter_time_s"] < 1.0  # sleep(0.01) per iteration, plus overhead
    assert "training starts" in r.stderr  # the script's stdout, kept out of the JSON


CK_TRAIN = textwrap.dedent("""
    import sys, time
    import numpy as np
    import pccheck
    w = np.zeros({nbytes} // 4, np.float32)
    with pccheck.Checkpointer({{"w": w}}, sys.argv[2], interval=5) as ck:  # no report_iteration()
        for step in range(1, int(sys.argv[1])):
            time.sleep(0.01)
            w[0] += 1
            ck.maybe_checkpoint(step)
""")


def test_profiles_a_script_through_its_checkpointer(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CK_TRAIN.format(nbytes=4 * MiB))
    r = _tune("--path", str(tmp_path / "ck"), "--threads", "2", "--chunks", "8MiB", "--max-n", "2",
              "--iterations", "20", "--warmup-iterations", "3", "--json", "--",
              sys.executable, str(script), "100000", str(tmp_path / "train-ck"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["inputs"]["state_bytes"] == 4 * MiB  # the Checkpointer's state size
    assert 0.01 <= doc["inputs"]["iter_time_s"] < 0.05  # the median iteration: sleep(0.01) + a little


def test_a_script_that_does_not_report_exits_2(tmp_path):
    script = tmp_path / "silent.py"
    script.write_text("print('no reports')\n")
    r = _tune("--path", str(tmp_path / "ck"), "--size", "8MiB", "--", sys.executable, str(script))
    assert r.returncode == 2
    assert "report_iteration()" in r.stderr


def test_script_and_iter_time_are_exclusive(tmp_path):
    r = CliRunner().invoke(app, ["--path", str(tmp_path), "--size", "8MiB", "--iter-time", "0.1", "--",
                                 sys.executable, "-c", "pass"])
    assert r.exit_code == 2 and "not both" in r.output


def test_report_iteration(tmp_path, monkeypatch):
    monkeypatch.delenv(pccheck.tune.ENV_VAR, raising=False)
    pccheck.tune.report_iteration(state_bytes=5)  # no-op without the variable
    target = tmp_path / "reports"
    monkeypatch.setenv(pccheck.tune.ENV_VAR, str(target))
    for _ in range(3):
        pccheck.tune.report_iteration(state_bytes=4096)
    pccheck.tune.report_iteration()
    lines = [ln.split() for ln in target.read_text().splitlines()]
    assert [ln[1] for ln in lines] == ["4096", "4096", "4096", "-1"]
    stamps = [float(ln[0]) for ln in lines]
    assert stamps == sorted(stamps)


def test_state_bytes_counts_tied_tensors_once():
    torch = pytest.importorskip("torch")
    emb = torch.nn.Embedding(10, 4)
    model = torch.nn.Sequential(emb, torch.nn.Linear(4, 10, bias=False))
    model[1].weight = emb.weight  # tied
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()
    assert pccheck.tune.state_bytes(model) == 10 * 4 * 4
    assert pccheck.tune.state_bytes(model, opt) == 2 * 10 * 4 * 4  # + one momentum buffer


def test_parse_size():
    assert parse_size("1.5GiB") == 3 << 29 and parse_size("64MiB") == 64 * MiB and parse_size("1e3") == 1000
    assert parse_size("2GB") == 2 * 10**9 and parse_size("4096") == 4096
    for bad in ("-1", "0", "1.3XB", "", "nan"):
        with pytest.raises(ValueError):
            parse_size(bad)



def test_the_checkpointer_reports_only_for_a_silent_script(tmp_path, monkeypatch):
    target = tmp_path / "reports"
    monkeypatch.setattr(online, "_script_reports", False)  # the state behind the face
    monkeypatch.delenv(pccheck.tune.ENV_VAR, raising=False)
    pccheck.tune.report_from_checkpointer(lambda: 1 // 0)  # no-op without the variable: size not asked
    monkeypatch.setenv(pccheck.tune.ENV_VAR, str(target))
    pccheck.tune.report_from_checkpointer(lambda: 4096)
    pccheck.tune.report_from_checkpointer(lambda: 8192)
    pccheck.tune.report_iteration(state_bytes=1)  # the script reports: from now on only it does
    pccheck.tune.report_from_checkpointer(lambda: 1 // 0)
    assert [ln.split()[1] for ln in target.read_text().splitlines()] == ["4096", "8192", "1"]
