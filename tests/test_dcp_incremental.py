"""pccheck.dcp with incremental=True on local stores (FORMAT.md §14 with §9): a rank store keeps
the cells of the newest finished save while newer saves, not finished, reuse the other slots
(dcp_store.SetRetention's rule), so that save stays loadable bit for bit, every crc32c checked."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import pccheck  # noqa: E402
import pccheck.dcp  # noqa: E402
from pccheck.integrations import dcp as dcp_writer  # noqa: E402
from pccheck.integrations.dcp_store import SetRetention  # noqa: E402
from test_dcp import _quiet  # noqa: E402,F401  (_quiet: the autouse fixture)

N = 1 << 14  # float32 elements per array: 64 KiB


def _sd(a: float, b: float) -> dict:
    return {"a": torch.full((N,), a), "b": torch.full((N,), b)}


def _load(path, step: int) -> dict:
    out = _sd(0.0, 0.0)
    dcp.load(out, storage_reader=pccheck.dcp.Reader(path, step=step))
    return out


@pytest.mark.parametrize("hold,reopen", [(True, False), (True, True), (False, False)])
def test_the_finished_saves_cells_outlive_newer_unfinished_saves(tmp_path, monkeypatch, hold, reopen):
    """Save 2 (finished) references b in save 1's cell; saves 3 and 4 commit but are not finished
    (as when another rank failed), each changing b, and one of them lands in save 1's old slot.
    The held cells keep save 2 whole, also when the store is reopened between saves 2 and 3 (its
    finished slot is held on open). With the hold switched off (``hold=False``) a later save
    writes b into the cell save 2 reads it from, and loading save 2 fails its crc32c check."""
    if not hold:
        monkeypatch.setattr(SetRetention, "attach", lambda self, orch: setattr(self, "orch", orch))
    path = tmp_path / "ck"
    w = pccheck.dcp.Writer(path, incremental=True, max_concurrent=1)
    dcp.save(_sd(1, 1), storage_writer=w)
    dcp.save(_sd(2, 1), storage_writer=w)  # b referenced in save 1's cell
    if reopen:
        w.close()
        w = pccheck.dcp.Writer(path, incremental=True, max_concurrent=1)
    finished = w.__class__.finish
    monkeypatch.setattr(dcp_writer.Writer, "finish", lambda self, metadata, results: None)  # never finished
    dcp.save(_sd(3, 3), storage_writer=w)
    dcp.save(_sd(4, 4), storage_writer=w)
    monkeypatch.setattr(dcp_writer.Writer, "finish", finished)
    w.close()
    if hold:
        got = _load(path, 2)
        assert torch.equal(got["a"], _sd(2, 1)["a"]) and torch.equal(got["b"], _sd(2, 1)["b"])
        got = _load(path, 4)  # the newest commit is whole too
        assert torch.equal(got["b"], _sd(4, 4)["b"])
    else:
        with pytest.raises(CheckpointException, match="checksum|crc32c"):
            _load(path, 2)
