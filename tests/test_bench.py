"""The benchmark code: the goodput simulator against PCcheck §5.2.3, and every bench module in --quick mode.

These tests check structure and sanity only, never speed: the numbers of a quick run on a shared
2-core machine mean nothing. The quick run of ``python -m bench all`` exercises bench.recovery,
bench.fig11 (over bench.persist), bench.fig8 (over bench.overhead, bench.systems and pccheck.tuner),
bench.fig12 and bench.goodput in one go.
"""

from __future__ import annotations

import csv
import json
import math
import random
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is not installed: import it from the checkout, after site-packages
    sys.path.append(str(ROOT))  # (so pccheck itself still comes from the installed package, as conftest says)

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from bench.paper import goodput as gp

# -- the simulator against §5.2.3 ----------------------------------------------------------------------


def test_paper_example_text_arithmetic():
    """6137 vs 3404 iterations, redo 550 and 257 -> 5587 vs 3147, 1.77x (Figure 9d, interval 10)."""
    ex = gp.paper_example()
    pc, cf = ex["pccheck_text"], ex["checkfreq_text"]
    assert pc.iterations_failure_free == pytest.approx(6137, abs=1e-6)
    assert cf.iterations_failure_free == pytest.approx(3404, abs=1e-6)
    assert pc.redo_iterations == pytest.approx(550, abs=1e-6)
    assert cf.redo_iterations == pytest.approx(257, abs=1e-6)
    assert pc.useful_iterations == pytest.approx(5587, abs=1e-6)
    assert cf.useful_iterations == pytest.approx(3147, abs=1e-6)
    assert pc.goodput / cf.goodput == pytest.approx(1.77, abs=0.01)
    assert pc.throughput == pytest.approx(0.5)
    # the text's "0.256 iters/sec" for CheckFreq is its goodput over the same T (see PAPER_EXAMPLE)
    assert cf.goodput == pytest.approx(0.256, abs=0.001)


def test_paper_example_from_the_recovery_model():
    """§4.2's lost work with the artifact's inputs (l = 12.6 s, N = 2, r = 26) lands within 1% of the
    text's effective iterations and ratio; CheckFreq's redo count within 10% (see PAPER_EXAMPLE)."""
    ex = gp.paper_example()
    pc, cf = ex["pccheck_model"], ex["checkfreq_model"]
    assert pc.redo_iterations == pytest.approx(550, rel=0.01)
    assert cf.redo_iterations == pytest.approx(257, rel=0.10)
    assert pc.useful_iterations == pytest.approx(5587, rel=0.01)
    assert cf.useful_iterations == pytest.approx(3147, rel=0.01)
    assert pc.goodput / cf.goodput == pytest.approx(1.77, rel=0.01)


# -- the simulator's own invariants --------------------------------------------------------------------


def _model(policy="concurrent", **kw):
    base = dict(name=policy, policy=policy, iter_s=0.5, interval=10, load_s=3.0, tw_s=2.0, max_concurrent=2)
    base.update(kw)
    return gp.SystemModel(**base)


def test_no_failures_goodput_is_throughput():
    tr = gp.Trace(1000.0, ())
    for pol in gp.POLICIES:
        m = _model(pol)
        assert gp.replay(m, tr).goodput == pytest.approx(1 / m.iter_s, rel=1e-3)
        assert gp.closed_form(m, tr.duration_s, 0).goodput == pytest.approx(1 / m.iter_s)


def test_replay_by_hand():
    # iter 1 s, interval 10, durable 5 s after each call, load 2 s. Event at t=37: done 37 iterations;
    # checkpoints at 10, 20, 30 called at 10, 20, 30 s; durable at 15, 25, 35 -> back to 30 (7 lost).
    # Resume at 39 s from 30; trace ends at 100 s: 61 more iterations -> 91 useful.
    m = gp.SystemModel("x", "concurrent", 1.0, 10, 2.0, tw_s=5.0, max_concurrent=4)
    out = gp.replay(m, gp.Trace(100.0, (gp.Event(37.0),)))
    assert out.lost_iterations == 7
    assert out.useful_iterations == 91
    assert out.recovering_s == pytest.approx(2.0)
    # the same event 4 s after a call: checkpoint 30 (durable at 35) is not durable yet -> back to 20
    out = gp.replay(m, gp.Trace(100.0, (gp.Event(34.0),)))
    assert out.lost_iterations == 14


def test_replay_orders_the_policies():
    """Same throughput: the more in flight (the staler the newest durable checkpoint), the more lost."""
    tr = gp.synthetic_trace("thorpe", seed=3)
    ideal = gp.replay(_model("ideal"), tr).goodput
    one = gp.replay(_model("one_in_flight", tw_s=4.0), tr).goodput
    conc = gp.replay(_model("concurrent", tw_s=8.0, max_concurrent=2), tr).goodput
    assert ideal > one > conc > 0
    assert gp.durable_lag_s(_model("one_in_flight", tw_s=100.0)) == pytest.approx(5.0)  # capped at f t
    assert gp.durable_lag_s(_model("concurrent", tw_s=100.0)) == pytest.approx(10.0)  # capped at N f t


def test_replay_agrees_with_the_exact_expectation():
    """Many random events: lost work per failure -> f t / 2 + lag, less the half iteration in progress
    (a partly done iteration is lost time but not a lost iteration)."""
    m = _model("concurrent", iter_s=0.1, interval=10, load_s=0.0, tw_s=0.5)
    rng = random.Random(1)
    tr = gp.Trace(200_000.0, tuple(gp.Event(t) for t in sorted(rng.uniform(0, 200_000.0) for _ in range(2000))))
    out = gp.replay(m, tr)
    per_failure = out.lost_iterations / tr.failures * m.iter_s
    assert per_failure == pytest.approx(m.interval * m.iter_s / 2 + 0.5 - m.iter_s / 2, rel=0.03)


def test_recovery_longer_than_the_gap_makes_no_progress():
    m = _model("ideal", iter_s=1.0, load_s=50.0)
    tr = gp.Trace(100.0, (gp.Event(10.0), gp.Event(20.0), gp.Event(30.0)))
    out = gp.replay(m, tr)
    assert out.useful_iterations == 30  # 10 before the first event (durable at 10), 20 from 80 s on
    assert out.recovering_s == pytest.approx(10 + 10 + 50)


def test_synthetic_traces_have_the_published_rates():
    a = gp.synthetic_trace("andre")
    assert a.failures == 26 and a.duration_s == pytest.approx(3.5 * 3600)
    t = gp.synthetic_trace("thorpe")
    assert t.failures == 127 and t.duration_s == pytest.approx(24 * 3600)
    assert gp.synthetic_trace("andre", duration_s=7 * 3600).failures == 52
    assert gp.synthetic_trace("andre", seed=1) != gp.synthetic_trace("andre", seed=2)
    assert gp.synthetic_trace("andre", seed=1) == gp.synthetic_trace("andre", seed=1)
    r = gp.synthetic_trace("andre", with_recoveries=True)
    assert r.failures > 26 and {e.kind for e in r.events} == {"preempt", "recover"}
    with pytest.raises(ValueError):
        gp.synthetic_trace("nope")


def test_trace_csv_round_trip_and_resource_format(tmp_path):
    tr = gp.synthetic_trace("andre", seed=5)
    p = tmp_path / "t.csv"
    gp.write_trace_csv(tr, p)
    back = gp.read_trace_csv(p)
    assert back.failures == tr.failures
    assert back.duration_s == pytest.approx(tr.duration_s, abs=1e-3)
    res = tmp_path / "gpus.csv"
    res.write_text(",Time,GPUs\n0,1000.0,56\n1,1063.0,56\n2,1126.0,36\n3,1189.0,31\n4,1252.0,31\n5,1315.0,40\n")
    r = gp.read_trace_csv(res)
    assert r.duration_s == pytest.approx(315.0)
    assert [(e.time_s, e.kind) for e in r.events] == [(126.0, "preempt"), (189.0, "preempt"), (315.0, "recover")]
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError):
        gp.read_trace_csv(bad)


def test_invalid_models_are_rejected():
    with pytest.raises(ValueError):
        _model("bogus")
    with pytest.raises(ValueError):
        _model(iter_s=0.0)
    with pytest.raises(ValueError):
        gp.Trace(10.0, (gp.Event(20.0),))


# -- the systems' names ---------------------------------------------------------------------------------


def test_system_names_parse():
    """The names the result files carry: pccheck configurations, checkpoints in flight, O_DIRECT pieces."""
    from bench.harness import systems

    assert systems.parse_pccheck_name("pccheck_N2_p1_c16_b0.5m") == {"n": 2, "p": 1, "chunk": 16 << 20, "budget_x": 0.5}
    assert systems.parse_pccheck_name("pccheck_N3") == {"n": 3, "p": 2, "chunk": 64 << 20, "budget_x": None}
    assert systems.parse_pccheck_name("checkfreq") is None
    assert systems.n_in_flight("pccheck_tuned", {"n": 3, "p": 2, "chunk": 1 << 20}) == 3
    assert systems.n_in_flight("pccheck_N4_p1") == 4 and systems.n_in_flight("dcp_async") == 1
    assert systems.pieces(10, 4) == [(0, 4), (4, 4), (8, 2)]
    with pytest.raises(ValueError):
        systems.make_loop_system("no_such_system", None, Path("unused"), 10, None)


# -- every bench module, --quick --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``python -m bench all --quick`` once, in-process, into a temporary results directory."""
    from bench.__main__ import main

    out = tmp_path_factory.mktemp("results")
    scratch = tmp_path_factory.mktemp("scratch")
    assert main(["all", "--quick", "--out", str(out), "--dir", str(scratch)]) == 0
    return out


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_quick_run_writes_every_figure(quick_run):
    for stem in ("recovery/quick", "fig11/quick", "fig8/quick", "fig12/quick", "goodput/quick"):
        png = quick_run / f"{stem}.png"
        assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG", stem
        assert _csv(quick_run / f"{stem}.csv"), stem
    assert (quick_run / "goodput" / "quick-inputs.json").exists()
    assert (quick_run / "goodput" / "quick-trace-andre.csv").exists()


def test_quick_summary_has_every_target(quick_run):
    text = (quick_run / "all" / "quick.md").read_text(encoding="utf-8")
    for needle in ("persist 1 GiB", "slowdown at interval 10", "goodput / CheckFreq", "pccheck speed / raw O_DIRECT read",
                   "GPU EMULATED", "REAL CPU training"):
        assert needle in text, needle
    doc = json.loads((quick_run / "all" / "quick.json").read_text(encoding="utf-8"))
    assert set(doc["targets"]) == {"persist", "slowdown", "goodput", "load"}
    assert doc["runtime_s"] > 0


def test_quick_fig8_cells_are_sane(quick_run):
    rows = _csv(quick_run / "fig8" / "quick.csv")
    systems = {r["system"] for r in rows if r["workload"] == "emulated"}
    assert {"none", "torch_save", "dcp_async", "checkfreq", "gpm", "pccheck_N1", "pccheck_N2"} <= systems
    assert any(r["workload"] == "real" for r in rows)
    for r in rows:
        assert float(r["it_per_s"]) > 0 and math.isfinite(float(r["slowdown"]))
        if r["system"] != "none":
            assert int(r["checkpoints"]) >= 1
        if r["system"] in ("checkfreq", "dcp_async") or r["system"].startswith("pccheck"):
            assert float(r["tw_s"]) > 0, r  # call-to-durable was recorded
    doc = json.loads((quick_run / "fig8" / "quick.json").read_text(encoding="utf-8"))
    assert "tuner" in doc and ("reason" in doc["tuner"] or doc["tuner"]["max_concurrent"] >= 1)


def test_quick_fig11_and_recovery_are_sane(quick_run):
    rows = _csv(quick_run / "fig11" / "quick.csv")
    assert {r["system"] for r in rows} == {"pccheck", "raw_odirect", "torch_save", "safetensors", "dcp_async"}
    assert all(float(r["median_s"]) > 0 for r in rows)
    rec = {r["what"]: r for r in _csv(quick_run / "recovery" / "quick.csv")}
    assert {"pccheck", "raw_odirect", "raw_odirect_fresh", "torch_load", "safetensors", "dcp", "crc32c"} <= set(rec)
    assert all(float(r["median_s"]) > 0 for r in rec.values())


def test_quick_fig12_and_goodput_are_sane(quick_run):
    rows = _csv(quick_run / "fig12" / "quick.csv")
    assert {r["panel"] for r in rows} == {"a_N", "b_threads", "c_memory"}
    assert {r["writer_threads"] for r in rows if r["panel"] == "b_threads" and r["writer_threads"]} == {"1", "2"}
    g = _csv(quick_run / "goodput" / "quick.csv")
    assert {r["trace"] for r in g} == {"andre", "thorpe"}
    for r in g:
        assert 0 < float(r["goodput_replay"]) <= float(r["throughput"]) * (1 + 1e-9)


def test_goodput_module_replays_an_external_trace(quick_run, tmp_path):
    trace = tmp_path / "mine.csv"
    trace.write_text("time_s,kind\n100,preempt\n400,recover\n900,end\n")
    out = tmp_path / "out"
    assert gp.main(["--trace", str(trace), "--inputs", str(quick_run / "goodput" / "quick-inputs.json"),
                    "--out", str(out)]) == 0
    rows = _csv(out / "goodput" / "latest.csv")
    assert {r["trace"] for r in rows} == {"mine"} and all(r["failures"] == "2" for r in rows)


def test_summary_command_rebuilds_from_saved_results(quick_run):
    from bench.__main__ import main

    md = quick_run / "all" / "quick.md"
    md.unlink()
    assert main(["summary", "--quick", "--out", str(quick_run)]) == 0
    assert "goodput / CheckFreq" in md.read_text(encoding="utf-8")


# -- bench.restart (its own processes: not part of the quick run above) ------------------------------------


@pytest.mark.slow  # two restart rounds in their own processes: 1.5 min on 2 shared vCPUs
def test_restart_quick_and_a_failing_system(tmp_path):
    """``python -m bench.restart --quick`` for pccheck and torch.load: every phase measured, the checkpoint
    the killed run made durable is the one loaded, JSON (with its command) and PNG written; a restart
    that raises (nothing to load) comes back as an error, not a crash."""
    from bench.training import restart

    out = tmp_path / "restart.json"
    systems = ["pccheck_eager", "torch_load", "pccheck_lazy_build_first"]  # the last: Checkpointer, then load
    assert restart.main(["--quick", "--size", "16MiB", "--iters", "5", "--quiet-wait", "0", "--first-after", "2",
                         "--model", "mlp_relu", "--threads", "1", "--systems",
                         ",".join(systems), "--json", str(out), "--dir", str(tmp_path / "scratch")]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["command"].startswith("python -m bench.restart --quick") and doc["cache"] in ("fadvise", "drop_caches")
    for name in systems:
        s = doc["results"][name]["summary"]
        assert set(s["phases_s"]) == set(restart.PHASES) and all(v >= 0 for v in s["phases_s"].values()), name
        assert s["to_first_step_s"] >= s["phases_s"]["load"] > 0 and s["it_s_restart"] > 0 and s["it_s_fresh"] > 0
        run = doc["results"][name]["runs"][0]
        assert run["restart"]["loaded_step"] == run["durable_step"] == 10
    assert doc["results"]["pccheck_eager"]["runs"][0]["restart"]["first_checkpoint"]["outcome"] == "committed"
    assert doc["config"]["model"] == "mlp_relu" and doc["config"]["threads"] == 1  # the figure's setting
    for name in ("pccheck_eager", "pccheck_lazy_build_first"):  # the pool's readiness, from Checkpointer.wait_ready
        first = doc["results"][name]["runs"][0]["restart"]["first_checkpoint"]
        assert isinstance(first["pool_ready_at_first"], bool) and first["backpressure_s"] >= 0, name
        assert doc["results"][name]["summary"]["pool_ready_at_first"] in (0, 1), name
    png = out.with_suffix(".png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    cfg = restart.Config(nbytes=1 << 20, quiet_wait_s=0)
    failed = restart.run_child(restart.child_spec("restart", "torch_load", tmp_path / "empty", cfg), cfg)
    assert failed["error"].startswith("FileNotFoundError"), failed


@pytest.mark.parametrize("shape", [[], ["--model", "mlp_relu", "--order", "build_first"]])
def test_lazy_bench_small(tmp_path, shape):
    """``python -m bench.lazy`` on a small state: every measure taken, ratios and targets written;
    also the ReLU MLP (``mlp_relu``), its store written and restarted with the Checkpointer built first."""
    from bench.modes import lazy

    out = tmp_path / "lazy.json"
    assert lazy.main(["--size", "16MiB", "--repeats", "1", "--json", str(out), "--dir", str(tmp_path / "s"),
                      *shape]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    m = doc["median"]
    assert doc["command"].startswith("python -m bench.lazy") and doc["blocks"] == 8
    assert doc["model"] == (shape[1] if shape else "bench") and doc["order"] == (shape[3] if shape else "none")
    assert 0 < m["lazy_return_s"] <= m["first_block_s"] <= m["first_forward_s"] <= m["lazy_all_s"]
    assert m["eager_s"] > 0 and m["param_read_s"] > 0 and doc["param_bytes"] * 3 <= doc["state_bytes"] * 1.05
    assert set(doc["targets"]) == {"first_block_vs_eager", "first_forward_vs_param_read"}


def test_incremental_bench_small(tmp_path):
    """``python -m bench.incremental`` on a 16 MiB base: every row measured in one run, the load pair
    bit-exact, every target judged from the measured values (ok agrees with value and limit), the
    plot written; the incremental row writes about the changed bytes, the full row the whole state."""
    from bench.training import incremental

    out = tmp_path / "latest.json"  # a latest*.json result gets the commit it was measured at
    assert incremental.main(["--base", "16MiB", "--steps", "2", "--lora-rounds", "2", "--full-steps", "1", "--full-pairs", "2",
                             "--repeats", "1", "--quiet-wait", "0", "--json", str(out), "--dir", str(tmp_path / "s")]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    s = doc["summary"]
    # the judged ratios are medians over adjacent pairs: two window pairs, 2 x LOAD_ROUNDS load pairs
    pairs = doc["runs"][0]["full_params_pair_ratios"]
    assert len(pairs) == 2 and s["full_params_slowdown"]["median"] == statistics.median(pairs)
    loads = doc["runs"][0]["load"]["ratios"]
    assert len(loads) == 2 * incremental.LOAD_ROUNDS and s["load_ratio"]["median"] == statistics.median(loads)
    assert next(t for t in doc["targets"] if t["name"] == "load_vs_full")["value"] == s["load_ratio"]["median"]
    # the time-lost target's rows: one time lost per round, each against its round's none window
    lost = doc["runs"][0]["pccheck_incremental"]["rounds_time_lost_s"]
    assert len(lost) == 2 and s["pccheck_incremental"]["time_lost_s"]["median"] == statistics.median(lost)
    assert doc["command"].startswith("python -m bench.incremental") and doc["commit"] is not None
    assert set(incremental.ROWS + incremental.FULL_ROWS) <= set(s) and doc["bit_exact"] is True
    inc, full = s["pccheck_incremental"], s["pccheck_full"]
    assert inc["library_bytes_written"]["median"] < doc["changed_bytes"] + (64 << 10)  # + padding per array
    assert inc["bytes_referenced"]["median"] >= 16 << 20
    assert full["library_bytes_written"]["median"] >= doc["state_bytes"]
    assert full["io_write_bytes"]["median"] >= doc["state_bytes"] > 10 * inc["io_write_bytes"]["median"]
    for name in incremental.ROWS[1:]:
        assert s[name]["durable_s"]["median"] > 0 and "time_lost_s" in s[name], name
    names = {t["name"] for t in doc["targets"]}
    assert names == {"io_bytes_per_checkpoint", "library_bytes_per_checkpoint", "time_lost_vs_adapters",
                     "full_params_slowdown", "load_vs_full", "load_bit_exact"}
    for t in doc["targets"]:
        if t["name"] not in ("load_bit_exact", "time_lost_vs_adapters"):
            assert t["ok"] == (0 <= t["value"] <= t["limit"]), t
    assert (tmp_path / "latest.png").stat().st_size > 0


def test_gockpt_summary_judges_the_training_thread_waits_against_the_models():
    from bench.modes.gockpt import summarize

    cfg = {"nbytes": 12 << 20, "grad_bytes": 4 << 20, "iter_time": 0.05, "link_bps": (12 << 20) / 0.2,
           "checkpoints": 2, "spread": 4, "ratio": 4.0}
    clean = 1.0  # 10 iterations of 0.05 s + a 0.05 s step

    def run(extra, k=None, blocked=None):
        out = {"ratios": [(clean + e) / clean for e in extra], "deltas_s": list(extra),
               "cycles_s": [[clean + e, clean, clean] for e in extra], "iters_per_cycle": 10}
        if k is not None:
            out.update({"spread_steps": [k] * 2, "blocked_s": [blocked] * 2, "replay_s": [0.1] * 2})
        return out
    s = summarize({"none": [run([0.0, 0.01])], "pccheck_k1": [run([0.15, 0.17], 1, 0.15)],
                   "pccheck_spread": [run([0.04, 0.06], 4, 0.03)]}, cfg)
    assert s["none"]["optimizer_step_s"] == pytest.approx(0.05)
    assert s["none"]["slowdown"] == pytest.approx(1.005)
    assert s["pccheck_k1"]["model_s"] == pytest.approx(0.15) and s["pccheck_k1"]["loop_stall_s"] == pytest.approx(0.16)
    assert s["pccheck_spread"]["slowdown"] == pytest.approx(1.05)
    assert s["pccheck_spread"]["paper_model_s"] == pytest.approx(0.2 / 3 * 5 / 2)
    ratio, spread_fit, k1_fit, loop = s["targets"]
    assert ratio["value"] == pytest.approx(0.2) and ratio["met"]
    model = s["pccheck_spread"]["model_s"]  # step 4's gradients need 0.067 s of link in a 0.05 s update
    assert model == pytest.approx(0.2 / 3 - 0.05)
    assert spread_fit["value"] == pytest.approx(0.03 / model) and not spread_fit["met"] and k1_fit["met"]
    assert loop["limit"] == 1.10 and loop["value"] == pytest.approx(1.05) and loop["met"]
    # the spread, not only the median: min-max over checkpoints and triples, each repeat's median
    assert (s["pccheck_k1"]["stall_min"], s["pccheck_k1"]["stall_max"]) == (0.15, 0.15)
    assert s["pccheck_spread"]["slowdown_min"] == pytest.approx(1.04)
    assert s["pccheck_spread"]["slowdown_max"] == pytest.approx(1.06)
    assert s["none"]["slowdown_repeat_medians"] == [pytest.approx(1.005)]


def test_gockpt_summary_judges_autos_choice_and_the_model_at_the_measured_link():
    from bench.modes.gockpt import summarize

    s_bytes, t = 12 << 20, 0.05
    cfg = {"nbytes": s_bytes, "grad_bytes": 4 << 20, "iter_time": t, "link_bps": s_bytes / (4 * t),
           "checkpoints": 2, "spread": "auto", "ratio": 4.0}

    def run(k, blocked, copy_wall, decisions):
        return {"ratios": [1.0, 1.0], "deltas_s": [0.0, 0.0], "cycles_s": [[1.0, 1.0, 1.0]] * 2,
                "iters_per_cycle": 10, "spread_steps": k, "blocked_s": blocked, "replay_s": [0.0, 0.0],
                "copy_wall_s": copy_wall, "decisions": decisions}
    dec = {"link_bps": s_bytes / 0.25, "window_s": t}
    # k = 1's copies ran at half the nominal link (0.4 s): the model at the measured link is 0.35 s
    k1 = run([1, 1], [0.35, 0.35], [0.4, 0.4], [None, None])
    spread = run([1, 5], [0.1, 0.0], [0.3, 0.3], [dec, dec])
    s = summarize({"none": [run([1, 1], [0, 0], [0, 0], [None, None])], "pccheck_k1": [k1],
                   "pccheck_spread": [spread]}, cfg)
    assert s["pccheck_k1"]["model_s"] == pytest.approx(0.15)
    assert s["pccheck_k1"]["model_measured_s"] == pytest.approx(0.35)
    auto = s["targets"][0]
    assert auto["value"] == pytest.approx(0.5) and not auto["met"]  # one checkpoint kept k = 1
    assert s["pccheck_spread"]["link_measured_bps"] == pytest.approx(s_bytes / 0.25)


@pytest.mark.slow  # every system's loop once: about 1.5 min on 2 shared vCPUs
def test_overhead_spread_row_runs_every_system(tmp_path):
    """``python -m bench.overhead --spread k``: the GoCkpt row through bench.gockpt's harness."""
    from bench.training import overhead

    out = tmp_path / "gockpt.json"
    assert overhead.main(["--spread", "2", "--quick", "--size", "16MiB", "--intervals", "6", "--quiet-wait", "0",
                          "--json", str(out), "--dir", str(tmp_path / "s")]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["command"].startswith("python -m bench.overhead --spread 2")
    assert doc["config"]["interval"] == 6 and doc["config"]["ratio"] == 4.0
    s = doc["summary"]
    assert set(s) >= {"none", "pccheck_k1", "pccheck_spread", "dcp_async", "targets"}
    assert s["pccheck_spread"]["spread_steps"] == 2 and s["pccheck_k1"]["spread_steps"] == 1
    assert all(r["outcomes"] == ["committed"] * len(r["outcomes"]) for r in doc["runs"]["pccheck_spread"])
    assert s["pccheck_spread"]["stall_s"] >= 0 and s["none"]["slowdown"] > 0
    with pytest.raises(SystemExit):
        overhead.main(["--spread", "2", "--intervals", "10,20"])  # one interval only


def test_sharded_floor_bracket_and_page_cache_residency(tmp_path):
    """bench.sharded: the repeat's floor is the mean of the raw reads before and after its load, the
    target judged on the median and on the worst repeat; ``resident_fraction`` sees a file just read."""
    from bench.modes import sharded

    runs = [{"saves": [{"block_s": 0.3, "durable_s": 1.0}], "load_s": 0.9, "floor_s": 0.6, "floor_after_s": 1.0,
             "load_warm_s": 0.3},
            {"saves": [{"block_s": 0.3, "durable_s": 1.0}], "load_s": 1.0, "floor_s": 0.8, "floor_after_s": 0.8,
             "load_warm_s": 0.3}]
    s = sharded._summary(runs)
    assert s["spread"]["load_over_floor"]["max"] == pytest.approx(1.25)
    assert s["spread"]["load_over_floor_before"]["max"] == pytest.approx(1.5)
    t = sharded._targets({"pccheck": {"summary": s}})[-1]
    assert t["worst"] == pytest.approx(1.25) and t["met_every_repeat"] is False
    # per raw method, the slowest loading rank; the repeat's floor: the fastest method's mean of
    # its reads before and after the load (not the fastest read of either alone)
    raw = [{"methods": {"a": 1.0, "b": 0.7}}, {"methods": {"a": 0.9, "b": 0.8}}]
    assert sharded._floor_methods(raw) == {"a": 1.0, "b": 0.8}
    run = {"floor_s": 0.8, "floor_methods_s": {"a": 1.0, "b": 0.8}, "floor_after_s": 0.6,
           "floor_after_methods_s": {"a": 0.6, "b": 1.2}}
    assert sharded._floor_bracket(run) == pytest.approx(0.8)
    f = tmp_path / "d" / "f.bin"
    f.parent.mkdir()
    f.write_bytes(b"\1" * (1 << 20))
    f.read_bytes()
    frac = sharded.resident_fraction(f.parent)
    assert frac is None or frac > 0.5  # just written and read: in the page cache


def test_gockpt_replay_floor_runs_a_spreads_replay_work_one_step_per_call():
    """replay_floor: step j of k updates the first j/k of a shadow of the state (AdamW's step
    counters show which), one step per call after the checkpoint call, all drained at the end."""
    import torch

    from bench.modes import gockpt

    _model, opt, _step = gockpt.make_workload(4096 * 12, 0.0)
    floor = gockpt.ReplayFloor(opt, 4, 10)
    live = [p for g in opt.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in live]
    assert floor.call(10) is False    # a checkpoint call: the replay begins
    floor.call(11)
    floor.call(12)                    # steps 1 and 2 have arrived
    floor.drain()                     # the rest arrive and the replay ends
    steps = [float(floor.optimizer.state[p]["step"]) for p in floor.shadow]
    n = len(steps)
    # after the workload's first live step (1): parameter i took step j whenever i < j/k of them
    assert steps == [1 + sum(1 for j in range(1, 5) if i < round(j * n / 4)) for i in range(n)]
    assert steps[0] == 5 and steps[-1] == 2
    assert all(torch.equal(p, b) for p, b in zip(live, before))  # the live state is never touched
    floor.call(20)                    # the next checkpoint call starts another replay
    floor.drain()
    assert float(floor.optimizer.state[floor.shadow[0]]["step"]) == 1 + 2 * 4


def test_gockpt_thread_cpu_names_threads_and_breaks_the_training_threads_time_down():
    import threading

    from bench.modes.gockpt import cpu_breakdown, thread_cpu

    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="pccheck-spread-copy_1")
    worker.start()
    try:
        cpu = thread_cpu()
    finally:
        stop.set()
        worker.join()
    assert "training" in cpu and "pccheck-spread-copy" in cpu and "pccheck-spread-copy_1" not in cpu
    assert all(v >= 0 for v in cpu.values())
    out = cpu_breakdown({"training": 1.0, "gone": 0.5}, {"training": 3.0, "replay": 0.25}, wall=10.0, slept=4.0)
    assert out["thread_cpu_s"] == {"replay": 0.25, "training": 2.0}  # an ended thread's share is lost
    assert out["timed_wall_s"] == 10.0 and out["training_off_cpu_s"] == pytest.approx(4.0)
