"""bench.scale, the goodput model of a large job per tier set: its replay keeps the rules it states."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.resilience import scale  # noqa: E402

INPUTS = json.loads(scale.DEFAULT_INPUTS.read_text(encoding="utf-8"))


def _goodput(doc: dict, name: str, seeds: int = 20) -> float:
    return next(r["goodput"] for r in scale.run(doc, seeds)["rows"] if r["config"] == name)


def test_without_interruptions_goodput_is_one_over_the_slowdown():
    doc = copy.deepcopy(INPUTS)
    doc["job"]["interruptions"] = 1e-9  # none within the job's days
    for row in scale.run(doc, 3)["rows"]:
        assert row["goodput"] == pytest.approx(1 / row["slowdown"], rel=1e-6)


def test_a_node_loss_takes_local_tiers_with_it():
    doc = copy.deepcopy(INPUTS)
    doc["job"]["hardware_share"] = 1.0
    local_only = {"name": "local", "tiers": ["memory", "disk"], "slowdown": 1.0, "source": "test"}
    with_remote = {**local_only, "name": "local + remote", "tiers": ["memory", "disk", "remote"]}
    doc["configs"] = [local_only, with_remote]
    assert _goodput(doc, "local") < 0.05  # every node loss goes back to step 0
    assert _goodput(doc, "local + remote") > 0.9


def test_a_process_failure_restores_from_memory_and_loses_at_most_an_iteration():
    doc = copy.deepcopy(INPUTS)
    doc["job"]["hardware_share"] = 0.0
    doc["configs"] = [{"name": "mem", "tiers": ["memory", "disk"], "slowdown": 1.0, "source": "test"}]
    row = scale.run(doc, 10)["rows"][0]
    per_failure_s = row["lost_h"] * 3600 / doc["job"]["interruptions"]
    assert per_failure_s <= doc["job"]["iter_s"] * 1.5


def test_refresh_reads_measured_efficiencies(tmp_path):
    doc = copy.deepcopy(INPUTS)
    (tmp_path / "r.json").write_text(json.dumps({"a": {"x": 3.0, "y": 4.0}, "ratio": 0.5}))
    doc["tiers"]["disk"]["efficiency_from"] = {"file": "r.json", "num": "a.x", "den": "a.y"}
    doc["tiers"]["remote"]["efficiency_from"] = {"file": "r.json", "key": "ratio"}
    doc["tiers"]["peer"]["efficiency_from"] = {"file": "missing.json", "key": "k"}
    changed = scale.refresh(doc, tmp_path)
    assert doc["tiers"]["disk"]["efficiency"] == 0.75 and doc["tiers"]["remote"]["efficiency"] == 0.5
    assert any("missing.json not found" in c for c in changed)


def test_an_unknown_tier_is_refused():
    doc = copy.deepcopy(INPUTS)
    doc["configs"] = [{"name": "x", "tiers": ["tape"], "slowdown": 1.0, "source": "test"}]
    with pytest.raises(ValueError, match="unknown tiers"):
        scale.run(doc, 1)
