"""Stores written by pccheck 0.1.0 (manifest format 1) still load, and format 2 keeps pccheck's
own fields (tree, epoch) apart from the user's metadata (FORMAT.md §5)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

import pccheck
from pccheck.persist.layout import parse_manifest
from pccheck.persist.recovery import read_manifest, read_store, store_files

FIXTURES = Path(__file__).parent / "fixtures"


def _model():
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    return m, opt, torch.optim.lr_scheduler.StepLR(opt, 2)


def test_a_store_written_by_0_1_0_loads_in_place(tmp_path):
    """tests/fixtures/store-v0.1.0.tar.gz: a Linear+BatchNorm model with SGD momentum and a
    scheduler, checkpointed at step 7 by pccheck 0.1.0 (tree in metadata["pccheck.state"])."""
    with tarfile.open(FIXTURES / "store-v0.1.0.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    expected = json.loads((FIXTURES / "store-v0.1.0.expected.json").read_text())
    path = tmp_path / "v010"
    image = read_store(store_files(path)[0][1])
    with open(image.path, "rb") as f:
        raw_formats = {json.loads(_raw_manifest(image, s, f))["format"] for s in range(2) if image.slots[s].meta}
    assert raw_formats == {1}

    m, opt, sched = _model()
    r = pccheck.load_latest(path, model=m, optimizer=opt, extra_state={"sched": sched})
    assert r.step == 7
    assert r.metadata == {"note": "written by pccheck 0.1.0", "loss": 0.5}  # the reserved key is gone
    for k, v in m.state_dict().items():
        assert v.tolist() == expected[k], k
    assert [opt.state[p]["momentum_buffer"].tolist() for p in m.parameters()] == expected["momentum"]
    assert sched.last_epoch == expected["sched_last_epoch"]

    # ... and a new Checkpointer continues the old store with format 2 manifests
    with pccheck.Checkpointer(m, opt, path, extra_state={"sched": sched}, max_concurrent=1,
                              metadata={"pccheck.state": "a user's own key, no longer reserved"}) as ck:
        ck.checkpoint(8)
    m2, opt2, sched2 = _model()
    r2 = pccheck.load_latest(path, model=m2, optimizer=opt2, extra_state={"sched": sched2})
    assert r2.step == 8 and r2.metadata == {"pccheck.state": "a user's own key, no longer reserved"}
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))


def _raw_manifest(image, slot, f) -> bytes:
    meta = image.slots[slot].meta
    base = image.header["slots_offset"] + slot * image.header["slot_capacity"]
    f.seek(base + meta["manifest_offset"])
    return f.read(meta["manifest_len"])


def test_format_2_keeps_tree_and_user_metadata_apart(tmp_path):
    m, opt, sched = _model()
    m(torch.randn(5, 4)).sum().backward()
    opt.step()
    with pccheck.Checkpointer(m, opt, tmp_path, metadata={"run": "x"}, incremental=False) as ck:  # format 2
        ck.checkpoint(3)
    image = read_store(store_files(tmp_path)[0][1])
    slot = next(s.slot for s in image.slots if s.meta)
    with open(image.path, "rb") as f:
        doc = json.loads(_raw_manifest(image, slot, f))
        man = read_manifest(image, slot, f.fileno())
    assert doc["format"] == 2 and doc["metadata"] == {"run": "x"} and "tree" in doc and "epoch" not in doc
    assert man.tree == doc["tree"] and man.epoch is None and man.metadata == {"run": "x"}
    arrays = {"w": np.ones(8, np.float32)}
    with pccheck.Checkpointer(arrays, tmp_path / "arrays") as ck:
        ck.checkpoint(1)
    r = pccheck.load_latest(tmp_path / "arrays")
    assert r.tree is None and r.state["w"].tolist() == [1.0] * 8


def _manifest(fmt: int, metadata: dict, **own) -> bytes:
    return json.dumps({"format": fmt, "step": 1, "counter": 1, "data_len": 0, "arrays": [],
                       "metadata": metadata, **own}).encode()


def test_format_1_fields_are_moved_out_of_metadata():
    man = parse_manifest(_manifest(1, {"pccheck.state": {"d": 1}, "pccheck.epoch": 4, "u": 1}),
                         step=1, counter=1, data_len_limit=0)
    assert (man.tree, man.epoch, man.metadata) == ({"d": 1}, 4, {"u": 1})
    man = parse_manifest(_manifest(2, {"pccheck.epoch": 4}, epoch=2), step=1, counter=1, data_len_limit=0)
    assert (man.tree, man.epoch, man.metadata) == (None, 2, {"pccheck.epoch": 4})


@pytest.mark.parametrize("raw", [
    _manifest(2, {}, epoch=-1), _manifest(2, {}, epoch="3"), _manifest(2, {}, epoch=True),
    _manifest(1, {"pccheck.epoch": 1.5}), _manifest(4, {}), _manifest(0, {}),
])
def test_bad_own_fields_and_unknown_formats_are_corrupt(raw):
    with pytest.raises(pccheck.CorruptCheckpointError):
        parse_manifest(raw, step=1, counter=1, data_len_limit=0)


# -- the native field tables against FORMAT.md's tables ------------------------------------------

_FORMAT_MD = Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md"
_TYPES = {"u32": (4, False), "u64": (8, False), "i64": (8, True)}


def _format_table(section: str) -> dict[int, tuple[int, bool]]:
    """offset -> (size, signed) of the integer rows of the table under ``section`` in FORMAT.md,
    but the crc32c at 124 (the record's checksum) and the CHECK_ADDR word at 128 (§4: outside the
    header's crc, written only through the mapping), which are not record fields."""
    text = _FORMAT_MD.read_text()
    body = text[text.index(section):]
    body = body[:body.index("\n## ", 1)]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit() and cells[1] in _TYPES and int(cells[0]) not in (124, 128):
            rows[int(cells[0])] = _TYPES[cells[1]]
    return rows


@pytest.mark.skipif(not _FORMAT_MD.is_file(), reason="no source tree beside the tests")
@pytest.mark.parametrize("section,fields", [("## §2 Header", "header_fields"), ("## §3 Meta record", "meta_fields")])
def test_native_field_tables_match_format_md(section, fields):
    """The header and meta fields are defined once in the core (format.h's X-macros): pack, parse
    and the bindings use them. Their offsets and widths are the ones FORMAT.md specifies."""
    from pccheck.native import _native

    native = {off: (size, signed) for _, off, size, signed in getattr(_native, fields)()}
    assert native == _format_table(section)
    assert len({name for name, *_ in getattr(_native, fields)()}) == len(native)
