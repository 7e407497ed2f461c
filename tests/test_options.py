"""pccheck.Options: grouped, frozen, validated once; one options object per storage tier with the
same three fields (every, keep_last, keep_every); the 0.1.0 keyword spellings keep working."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import pccheck
from pccheck import ConfigError, DiskOptions, EngineOptions, HistoryOptions, Options, SnapshotOptions

MiB = 1 << 20


def _arrays():
    return {"w": np.arange(4096, dtype=np.float32)}


def test_keywords_and_options_build_the_same_checkpointer(tmp_path):
    opts = Options(engine=EngineOptions(max_concurrent=1, writer_threads=1, chunk_size=MiB),
                   disk=DiskOptions(keep_every=2))
    with pccheck.Checkpointer(_arrays(), tmp_path / "a", options=opts) as a, \
            pccheck.Checkpointer(_arrays(), tmp_path / "b", max_concurrent=1, writer_threads=1, chunk_size=MiB,
                                 disk=DiskOptions(keep_every=2)) as b:
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
    assert "'max_concurent'" in msg and "max_concurrent" in msg and "disk" in msg and "keep_every" in msg
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


# -- the storage tiers: one options object each, the same three fields ---------------------------


def test_every_tier_has_every_keep_last_and_keep_every():
    for cls in (pccheck.DiskOptions, pccheck.MemoryOptions, pccheck.RemoteOptions):
        names = [f.name for f in dataclasses.fields(cls)]
        i = names.index("every")
        assert names[i:i + 3] == ["every", "keep_last", "keep_every"], (cls, names)
    opts = Options()
    assert (opts.disk.every, opts.disk.keep_last, opts.disk.keep_every) == (10, 0, None)
    assert (opts.memory.every, opts.memory.keep_last, opts.memory.keep_every) == (None, 0, None)
    assert (opts.remote.url, opts.remote.every, opts.remote.keep_last, opts.remote.keep_every) == (None, 1, None, None)


def test_tiers_as_keywords_and_in_options(tmp_path):
    disk = pccheck.DiskOptions(every=3, keep_every=6)
    url = "s3://bucket/run"
    opts = Options(disk=disk, remote=pccheck.RemoteOptions(url=url, every=6))
    assert Options().updated(disk=disk, remote=pccheck.RemoteOptions(url=url, every=6)) == opts
    assert Options().updated(remote=url).remote == pccheck.RemoteOptions(url=url)  # the URL alone
    assert Options(remote=url).remote.url == url and Options().updated(remote=None).remote.url is None
    # a tier object first, the older flat keyword over it
    assert Options().updated(disk=disk, interval=5).disk == pccheck.DiskOptions(every=5, keep_every=6)
    with pccheck.Checkpointer(_arrays(), tmp_path, disk=disk) as ck:
        assert ck.options.disk == disk and ck.interval == 3
        ck.maybe_checkpoint(2)
        ck.maybe_checkpoint(3)
        ck.wait()
        assert ck.last_durable_step == 3
    for kw, what in (({"disk": 5}, "disk= must be a pccheck.DiskOptions"),
                     ({"memory": {"every": 1}}, "memory= must be a pccheck.MemoryOptions"),
                     ({"remote": 3}, "s3:// URL")):
        with pytest.raises(ConfigError, match=what):
            Options().updated(**kw)
    with pytest.raises(ConfigError, match="Options.disk must be a DiskOptions"):
        Options(disk=pccheck.MemoryOptions())  # type: ignore[arg-type]


def test_disk_every_auto_is_the_online_tuned_policy(tmp_path):
    with pccheck.Checkpointer(_arrays(), tmp_path / "a", disk=pccheck.DiskOptions(every="auto")) as ck:
        assert isinstance(ck._policy, pccheck.OnlineTuned) and ck.interval == 10
    with pccheck.Checkpointer(_arrays(), tmp_path / "b", interval="auto") as ck:  # the older spelling
        assert isinstance(ck._policy, pccheck.OnlineTuned)
    with pccheck.Checkpointer(_arrays(), tmp_path / "c", disk=pccheck.DiskOptions(every=4)) as ck:
        assert isinstance(ck._policy, pccheck.FixedInterval) and ck.interval == 4


def test_misspelt_tier_fields_list_the_valid_ones():
    for cls, bad in ((pccheck.DiskOptions, "evry"), (pccheck.MemoryOptions, "interval"),
                     (pccheck.RemoteOptions, "keep")):
        with pytest.raises(ConfigError) as exc:
            cls(**{bad: 1})
        msg = str(exc.value)
        assert repr(bad) in msg and "every, keep_last, keep_every" in msg, msg
    with pytest.raises(ConfigError) as exc:
        Options().updated(evry=3)
    msg = str(exc.value)
    assert "'evry'" in msg and "disk, " in msg and "older spellings:" in msg and "remote_every" in msg
    with pytest.raises(ConfigError, match="older spelling of 'every'"):
        pccheck.DiskOptions(every=2, interval=3)


def test_older_spellings_are_silent_renames_except_where_the_meaning_changed():
    import warnings

    renames = dict(interval=5, memory_interval=2, memory_dir="/dev/shm/x", replicas=1, remote="s3://b/p",
                   remote_keep_last=3, remote_keep_every=7, remote_part_size=16 * MiB, remote_concurrency=2,
                   remote_close_timeout=9.0, remote_every=1, keep_every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opts = Options().updated(**renames)
        assert set(Options.keyword_names()) >= set(renames) | {"max_history", "disk", "memory", "remote"}
    assert opts.disk == pccheck.DiskOptions(every=5, keep_last=None)  # keep_every=1: each commit, all kept
    assert opts.memory == pccheck.MemoryOptions(every=2, dir="/dev/shm/x")
    assert opts.remote == pccheck.RemoteOptions(url="s3://b/p", keep_last=3, keep_every=7, part_size=16 * MiB,
                                                concurrency=2, close_timeout=9.0)
    assert opts.remote.remote == "s3://b/p" and opts.memory.memory_interval == 2 and opts.disk.interval == 5
    # the three that counted commits keep counting (a legacy mode of the tier) and say so
    for kw in ({"keep_every": 10}, {"max_history": 4}, {"remote_every": 3}):
        with pytest.warns(DeprecationWarning, match="0.1.0|no copies") as rec:
            o = Options().updated(**kw)
        assert "DiskOptions" in str(rec[0].message) or "RemoteOptions" in str(rec[0].message)
        assert o.disk.keep_last == 0 and o.disk.keep_every is None and o.remote.every == 1
    # what the README showed in 0.1.0 still builds the same options, with the same meaning
    with pytest.warns(DeprecationWarning):
        opts = Options(engine=EngineOptions(max_concurrent=2, writer_threads=4),
                       history=HistoryOptions(keep_every=100, max_history=20))
    with pytest.warns(DeprecationWarning):
        assert opts == Options().updated(max_concurrent=2, writer_threads=4, keep_every=100, max_history=20)
    assert opts.history == HistoryOptions(keep_every=100, max_history=20) == opts.disk.legacy_history
    assert (opts.disk.keep_last, opts.disk.keep_every) == (0, None)


@pytest.mark.parametrize("kw", [
    {"disk": {"every": 0}}, {"disk": {"every": "sometimes"}}, {"disk": {"keep_last": -1}},
    {"disk": {"keep_every": 0}}, {"memory": {"every": 0}}, {"memory": {"keep_last": 2}},
    {"memory": {"replicas": 2}}, {"remote": {"every": 0}}, {"remote": {"keep_last": -1}},
    {"remote": {"url": "http://x"}}, {"remote": {"part_size": 1 << 20}}, {"remote": {"concurrency": 0}},
    {"remote": {"close_timeout": -1}},
])
def test_each_bad_tier_value_is_refused(kw):
    (tier, fields_), = kw.items()
    cls = {"disk": pccheck.DiskOptions, "memory": pccheck.MemoryOptions, "remote": pccheck.RemoteOptions}[tier]
    with pytest.raises(ConfigError, match=tier):
        cls(**fields_)


def test_api_page_documents_every_exported_option_and_policy():
    from pathlib import Path

    api = (Path(__file__).resolve().parent.parent / "docs" / "api.md")
    if not api.is_file():
        pytest.skip("no source tree beside the tests")
    text = api.read_text()
    for name in ("Options", "EngineOptions", "SnapshotOptions", "GroupOptions", "DiskOptions", "MemoryOptions",
                 "RemoteOptions", "FixedInterval", "OnlineTuned"):
        assert name in pccheck.__all__ and f"::: pccheck.{name}\n" in text, name
