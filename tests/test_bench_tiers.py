"""bench.tiers' steps-lost trials (bench.tiers_loss): one tiny trial of each kind through
``python -m bench.tiers --configs=`` (the loop configurations off), its JSON section and target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
