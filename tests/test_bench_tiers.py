"""bench.tiers' steps-lost trials (bench.tiers_loss): one tiny trial of each kind through
``python -m bench.tiers --configs=`` (the loop configurations off), its JSON section and target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a crash, a node loss and a cluster loss, each with torchrun: about a minute
def test_one_tiny_trial_of_each_kind_reports_verified_steps_lost(tmp_path):
    out = tmp_path / "tiers.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "bench.tiers", "--configs=", "--size", "2MiB", "--iter-time", "0.02",
                        "--loss-trials", "1", "--kill-range", "4,7",
                        "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    lost = res["steps_lost"]
    assert res["configs"] == [] and "iter_s" not in res  # the loop did not run
    mc = lost["max_concurrent"]
    assert isinstance(mc, int) and mc >= 1 and lost["memory_in_flight"] >= 1
    assert res["targets"]["steps_lost"] == f"<= {mc}"
    for kind in ("crash", "node_loss"):
        (x, step, n, _), = lost[kind]["trials"]
        assert 4 <= x <= 7 and 1 <= step <= x and n == x - step >= 0
        assert lost[kind]["median"] == lost[kind]["max"] == n
        assert lost[kind]["detail"][0]["verified"] is True
        assert res["targets"]["steps_lost_met"][kind] == (n <= mc)
    assert lost["crash"]["trials"][0][3] == ["memory", "memory"]
    assert lost["node_loss"]["trials"][0][3] == ["memory", "peer"]  # rank 1's part came from node 0
    assert "steps lost" in p.stdout
    assert not out.with_suffix(".png").exists()  # no loop configurations: nothing to draw


def test_the_figure_is_drawn_from_a_result_and_refuses_one_without_the_loop(tmp_path):
    """bench.tiers_plot: both panels from a result's slowdown and restore times (a PNG written);
    a result of the kill trials alone draws nothing and says so (exit 1)."""
    from bench.resilience import tiers_plot

    res = {"slowdown": {"none": 1.0, "memory": 1.2, "disk": 1.01, "dcp": 1.6}, "size_bytes_per_rank": 1 << 28,
           "iter_time_s": 0.2, "restore_s": {"crash_memory_s": 0.25, "crash_disk_s": 2.9, "node_loss_peer_s": 0.3,
                                             "node_loss_remote_s": None, "raw_link_s": 0.28}}
    src = tmp_path / "tiers.json"
    src.write_text(json.dumps(res))
    assert tiers_plot.main([str(src)]) == 0
    png = src.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    (tmp_path / "loss.json").write_text(json.dumps({"steps_lost": {}}))
    assert tiers_plot.main([str(tmp_path / "loss.json"), str(tmp_path / "x.png")]) == 1
    assert not (tmp_path / "x.png").exists()
