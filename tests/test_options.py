"""pccheck.Options: grouped, frozen, validated once; the 0.1.0 keyword spellings keep working."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import pccheck
from pccheck import ConfigError, EngineOptions, HistoryOptions, Options, SnapshotOptions

MiB = 1 << 20


def _arrays():
    return {"w": np.arange(4096, dtype=np.float32)}


def test_keywords_and_options_build_the_same_checkpointer(tmp_path):
    opts = Options(engine=EngineOptions(max_concurrent=1, writer_threads=1, chunk_size=MiB),
                   history=HistoryOptions(keep_every=2))
    with pccheck.Checkpointer(_arrays(), tmp_path / "a", options=opts) as a, \
            pccheck.Checkpointer(_arrays(), tmp_path / "b", max_concurrent=1, writer_threads=1, chunk_size=MiB,
                                 keep_every=2) as b:
        assert a.options == b.options
        assert (a._orch.max_concurrent, a._orch._writer_threads, a._orch._chunk_size) == (1, 1, MiB)
        assert a._orch.num_slots == b._orch.num_slots == 2


def test_a_keyword_overrides_its_field_and_leaves_the_rest(tmp_path):
    opts = Options(engine=EngineOptions(max_concurrent=3, writer_threads=1, chunk_size=MiB))
    with pccheck.Checkpointer(_arrays(), tmp_path, options=opts, max_concurrent=1) as ck:
        assert ck.options.engine == EngineOptions(max_concurrent=1, writer_threads=1, chunk_size=MiB)
    assert opts.engine.max_concurrent == 3  # frozen: the caller's options are untouched


def test_unknown_keyword_lists_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError) as exc:
        pccheck.Checkpointer(_arrays(), tmp_path, max_concurent=2)
    msg = str(exc.value)
    assert "'max_concurent'" in msg and "max_concurrent" in msg and "keep_every" in msg
    assert not (tmp_path / "LOCK").exists()  # refused before touching the disk


@pytest.mark.parametrize("kw", [
    {"max_concurrent": 0}, {"max_concurrent": "Auto"}, {"writer_threads": 1.5}, {"chunk_size": 100},
    {"dram_budget": 10}, {"storage": "tape"}, {"when_busy": "wait"}, {"keep_every": 0}, {"max_history": True},
    {"soft_cow": "yes"}, {"capture_rng": None}, {"eager": "w"}, {"device_reserve": -1}, {"device_reserve": "lots"},
    {"copy_engine": object()}, {"distributed": 1}, {"replicated": "all"},
])
def test_each_bad_value_is_refused_by_its_group(kw):
    with pytest.raises(ConfigError) as exc:
        Options().updated(**kw)
    assert next(iter(kw)) in str(exc.value)


def test_options_are_frozen_and_groups_are_typed():
    opts = Options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.engine = EngineOptions()  # type: ignore[misc]
    with pytest.raises(ConfigError, match="Options.snapshot"):
        Options(snapshot=HistoryOptions())  # type: ignore[arg-type]
    assert SnapshotOptions(eager=["a", "b"]).eager == ("a", "b")


def test_options_must_be_an_options(tmp_path):
    with pytest.raises(ConfigError, match="pccheck.Options"):
        pccheck.Checkpointer(_arrays(), tmp_path, options={"max_concurrent": 1})


def test_engine_options_resolve_auto_from_values():
    e = EngineOptions(writer_threads=4)
    assert not e.resolved
    r = e.with_values({"max_concurrent": 2, "writer_threads": 9, "chunk_size": MiB})
    assert r.resolved and (r.max_concurrent, r.writer_threads, r.chunk_size) == (2, 4, MiB)
