"""Incremental checkpoints (``incremental=True``, FORMAT.md §14): only changed arrays are written,
the rest referenced; every byte checked on load; cells never overwritten while referenced."""

from __future__ import annotations

import json
import os
import random
import struct
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import pccheck
from conftest import assert_state_equal
from pccheck.commands.cli import app
from pccheck.native import _native
from pccheck.persist.recovery import read_manifest, read_store, slot_base

BLOCK = 4096
STORE = "store-000001.pcc"
KW = dict(interval=1, writer_threads=2, chunk_size=64 << 10)
KEYS = (12345, 2**61 - 3)


def manifest_of_latest(d: Path, store: str = STORE):
    image = read_store(d / store)
    slot = image.word_slot
    with open(d / store, "rb", buffering=0) as f:
        return image, slot, read_manifest(image, slot, f.fileno())


def fp(a: np.ndarray, keys=KEYS) -> tuple[int, int]:
    return _native.fingerprint(a.ctypes.data, a.nbytes, a.itemsize, list(a.shape), list(a.strides), *keys)


# -- the fingerprint -----------------------------------------------------------------------------


def test_fingerprint_sees_every_single_bit_flip_and_ignores_layout():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, 10_007, dtype=np.uint8)  # not a multiple of the 56-byte block
    h = fp(a)
    assert fp(a.copy()) == h
    for pos in [0, 1, 55, 56, 57, 10_000, 10_006] + list(rng.integers(0, a.size, 40)):
        b = a.copy()
        b[pos] ^= 1 << int(rng.integers(0, 8))
        assert fp(b) != h, pos
    assert fp(a, (7, 9)) != h  # another key, another value
    # a strided view hashes its logical (C-order) bytes: equal to its contiguous copy's
    m = rng.standard_normal((64, 33))
    for view in (m.T, m[::3, ::-2], m[:, 5]):
        assert fp(view) == fp(np.ascontiguousarray(view))
    # length counts: zero bytes of different lengths differ; the empty array has a value
    assert fp(np.zeros(8, np.uint8)) != fp(np.zeros(9, np.uint8))
    assert fp(np.zeros(0, np.float32)) == fp(np.zeros((0, 3), np.float64))
    with pytest.raises(ValueError, match="keys"):
        fp(a, (0, 5))


def test_native_job_refuses_extents_that_do_not_tile_the_stream_or_leave_the_slots(tmp_path):
    path = str(tmp_path / "s.pcc")
    _native.create_store(path, 3, 4 * BLOCK, 1)
    store = _native.Store(path, "mmap")
    store.init(0, 1)
    eng = _native.Engine(BLOCK, 2, 1)
    try:
        h = store.header
        base = h["slots_offset"]
        src = np.zeros(BLOCK, np.uint8)
        s = [(src.ctypes.data, 0, BLOCK, 1, [BLOCK], [1])]
        for bad in ([(0, BLOCK, base + 1)],                       # not block-aligned
                    [(0, BLOCK, 0)],                              # the header, not a slot
                    [(0, BLOCK, base + 3 * 4 * BLOCK)],           # beyond the last slot
                    [(0, 2 * BLOCK, base + 3 * BLOCK)],           # across a slot's end
                    [(BLOCK, BLOCK, base)]):                      # does not start at 0
            with pytest.raises(ValueError):
                eng.begin(store, 0, s, BLOCK, extents=bad)
        job = eng.begin(store, 0, s, BLOCK, extents=[(0, BLOCK, base + 2 * 4 * BLOCK)])
        job.copy()
        assert job.wait() and job.error == 0
    finally:
        eng.close()
        store.close()


# -- bytes written and referenced, bit-exact loads ------------------------------------------------


def lora_like(step: int) -> dict[str, np.ndarray]:
    """A frozen base (never changes), an adapter that changes every step, a buffer that changes
    every third step, and arrays of awkward sizes and dtypes."""
    rng = np.random.default_rng(3)
    return {
        "base": rng.standard_normal((256, 512)).astype(np.float32),        # 512 KiB
        "adapter": np.full((8, 512), step, dtype=np.float32),
        "buf": np.arange(1000, dtype=np.int16) + step // 3,
        "odd": np.frombuffer(bytes(range(251)) * 3, dtype=np.uint8).copy(),  # 753 bytes
        "empty": np.zeros((0, 4), np.float64),
        "scalar": np.array(step, dtype=np.int64),
    }


def _fill(state: dict[str, np.ndarray], step: int) -> None:
    """``state`` takes ``lora_like(step)``'s values in place (the Checkpointer reads these arrays)."""
    for k, v in lora_like(step).items():
        state[k][...] = v


def test_only_changed_arrays_are_written_and_loads_are_bit_exact(tmp_path):
    d = tmp_path / "ck"
    state = lora_like(0)
    with pccheck.Checkpointer(state, d, incremental=True, max_concurrent=1, **KW) as ck:
        for step in range(1, 8):
            _fill(state, step)
            ck.checkpoint(step)
            ck.wait()
            assert_state_equal(pccheck.load_latest(d).state, lora_like(step))
        stats = list(ck.stats().checkpoints)
    total = sum(v.nbytes for v in lora_like(0).values())
    assert stats[0].bytes_written == total and stats[0].bytes_referenced == 0
    changed = {s.step: s.bytes_written for s in stats[1:]}
    ad, buf, sc = lora_like(0)["adapter"].nbytes, 2000, 8
    for step, written in changed.items():
        assert written == ad + sc + (buf if step % 3 == 0 else 0), (step, written)
    assert all(s.bytes_written + s.bytes_referenced == total for s in stats)
    assert all(s.fingerprint_s > 0 for s in stats)
    summary = pccheck.load_latest(d)
    assert summary.step == 7
    # the manifest names a cell per array: the base stays in the first checkpoint's slot (0)
    # while the adapter alternates between the two slots; step 6 (slot 1) references slot 0
    image, slot, man = manifest_of_latest(d)
    names = [e.name for e in man.arrays]
    assert slot == 0 and man.cells.cells[names.index("base")] == 0 and man.cells.cells[names.index("adapter")] == 0
    with open(d / STORE, "rb", buffering=0) as f:
        prev = read_manifest(image, 1, f.fileno())
    assert prev.step == 6 and prev.references(1)
    assert prev.cells.cells[names.index("base")] == 0 and prev.cells.cells[names.index("adapter")] == 1
    assert all(e.offset % BLOCK == 0 for e in man.arrays)


def test_an_array_that_keeps_changing_is_written_unfingerprinted_while_its_crc32c_change(tmp_path):
    """Full-parameter training: an array that changed at its last two fingerprinted checkpoints is
    written without a fingerprint (no cost, always safe) while the crc32c of its writes differ;
    once two writes have equal crc32c it is fingerprinted again and referenced from the checkpoint
    after. Every load is bit-exact."""
    d = tmp_path / "ck"
    state = {"w": np.zeros(50_000), "frozen": np.arange(30_000, dtype=np.float64)}
    stop = 40
    fingerprinted, written = {}, {}
    with pccheck.Checkpointer(state, d, incremental=True, max_concurrent=1, **KW) as ck:
        for step in range(1, stop + 6):
            if step <= stop:
                state["w"][...] = step
            ck.checkpoint(step)
            ck.wait()
            _, _, man = manifest_of_latest(d)
            names = [e.name for e in man.arrays]
            fingerprinted[step] = man.cells.fps[names.index("w")] is not None
            assert man.cells.fps[names.index("frozen")] is not None  # an unchanging array: every time
            written[step] = ck.stats().checkpoints[-1].bytes_written
            if step % 7 == 0:
                r = pccheck.load_latest(d)
                assert r.step == step and np.all(r.state["w"] == min(step, stop))
                assert np.array_equal(r.state["frozen"], np.arange(30_000, dtype=np.float64))
    assert [s for s in range(1, stop + 1) if fingerprinted[s]] == [1, 2, 3]  # then the crc32c speak
    assert written[stop] == state["w"].nbytes  # written while changing, the frozen one referenced
    # stop + 1: written, crc32c equal to stop's; stop + 2: fingerprinted, written (its base has no
    # fingerprint); stop + 3 on: referenced
    assert [written[s] for s in range(stop + 1, stop + 6)] == [state["w"].nbytes] * 2 + [0] * 3, written
    assert np.all(pccheck.load_latest(d).state["w"] == stop)


def test_a_mapping_that_does_not_change_writes_nothing(tmp_path):
    state = {"a": np.arange(100_000, dtype=np.float64)}
    with pccheck.Checkpointer(state, tmp_path / "ck", incremental=True, **KW) as ck:
        for step in range(1, 5):
            ck.checkpoint(step)
            ck.wait()
        st = list(ck.stats().checkpoints)
    assert [s.bytes_written for s in st] == [800_000, 0, 0, 0]
    r = pccheck.load_latest(tmp_path / "ck")
    assert r.step == 4 and np.array_equal(r.state["a"], state["a"])


def test_neighbouring_changed_arrays_of_one_slot_share_an_extent():
    """The write plan's extents (incremental._stream): changed arrays next to each other in one slot
    go out as one extent (large O_DIRECT writes, as a full checkpoint's); a gap (an unchanged array
    between them) or another slot starts a new one; the stream stays tiled in order."""
    from pccheck.orchestrator.incremental import _stream
    from pccheck.persist.layout import plan

    arrays = {k: np.zeros(n, np.uint8) for k, n in (("a", 5000), ("b", 100), ("c", 9000), ("d", 1))}
    layout = plan(arrays, BLOCK)
    base = lambda s: 1_000_000 * BLOCK + s * 100 * BLOCK  # noqa: E731  (slot s's data region)
    runs = [(e.nbytes + BLOCK - 1) // BLOCK * BLOCK for e in layout.entries]

    _, ext = _stream(layout, [0, 1, 2, 3], [0, 0, 0, 0], base)
    assert ext == [(0, sum(runs), base(0))]
    _, ext = _stream(layout, [0, 2, 3], [1, 1, 1, 1], base)  # b unchanged: a gap in the file
    assert ext == [(0, runs[0], base(1)), (runs[0], runs[2] + runs[3], base(1) + layout.entries[2].offset)]
    _, ext = _stream(layout, [0, 1, 2], [0, 2, 2, 0], base)  # a's cell is another slot
    assert ext == [(0, runs[0], base(0)), (runs[0], runs[1] + runs[2], base(2) + layout.entries[1].offset)]


def test_full_parameter_checkpoints_round_trip_through_merged_extents(tmp_path):
    """Every array changes at every step (full-parameter training): the checkpoints written through
    merged extents load bit for bit."""
    rng = np.random.default_rng(3)
    state = {f"w{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate((70_000, 3, 40_000, 1025))}
    with pccheck.Checkpointer(state, tmp_path / "ck", incremental=True, **KW) as ck:
        for step in range(1, 7):
            for v in state.values():
                v += 1
            ck.checkpoint(step)
            ck.wait()
        st = list(ck.stats().checkpoints)
    assert all(s.bytes_referenced == 0 for s in st)
    r = pccheck.load_latest(tmp_path / "ck")
    assert r.step == 6
    for k, v in state.items():
        assert np.array_equal(r.state[k], v), k


def test_many_in_flight_never_overwrite_a_referenced_cell(tmp_path):
    """max_concurrent=3, interval 1, no waits: random subsets change each step. Every step's
    bytes are a pure function of the step, so each checkpoint that ends up newest is checked."""
    def at(step: int) -> dict[str, np.ndarray]:
        out = {}
        for i in range(6):
            version = step - step % (i + 1)  # array i changes every i+1 steps
            out[f"a{i}"] = np.random.default_rng(100 * i + version).standard_normal(3000 + 700 * i)
        return out

    d = tmp_path / "ck"
    state = at(0)
    with pccheck.Checkpointer(state, d, incremental=True, max_concurrent=3, **KW) as ck:
        for step in range(1, 41):
            for k, v in at(step).items():
                state[k][...] = v
            ck.checkpoint(step)
            if step % 10 == 0:
                ck.wait()
                assert_state_equal(pccheck.load_latest(d).state, at(step))
        ck.wait()
        stats = list(ck.stats().checkpoints)
    assert all(s.outcome in ("committed", "superseded") for s in stats)
    assert sum(s.bytes_referenced for s in stats) > 0
    assert_state_equal(pccheck.load_latest(d).state, at(40))


def test_store_size_stays_constant_over_a_long_run(tmp_path):
    d = tmp_path / "ck"
    state = lora_like(0)
    with pccheck.Checkpointer(state, d, incremental=True, max_concurrent=2, **KW) as ck:
        ck.checkpoint(0)
        ck.wait()
        files = sorted(os.listdir(d))
        size = os.path.getsize(d / STORE)
        for step in range(1, 61):
            state["adapter"][...] = step
            ck.maybe_checkpoint(step)
        ck.wait()
    assert sorted(os.listdir(d)) == files and os.path.getsize(d / STORE) == size
    # N + 1 = 3 slots of the block-aligned state, as a full store has
    assert read_store(d / STORE).header["num_slots"] == 3
    assert_state_equal(pccheck.load_latest(d).state, {**lora_like(0), "adapter": np.full((8, 512), 60, np.float32)})


# -- PyTorch: frozen backbone, in-place changes ----------------------------------------------------


def _lora_model(seed: int = 0):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64),
                                torch.nn.Linear(64, 4, bias=False), torch.nn.Linear(4, 64, bias=False))
    for p in list(model[0].parameters()) + list(model[2].parameters()):
        p.requires_grad_(False)  # the frozen backbone
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def _train(model, opt, steps: range, ck=None):
    import torch

    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 64, generator=g)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ck is not None:
            ck.maybe_checkpoint(step)


def test_frozen_backbone_with_a_trained_adapter_resumes_bit_exact(tmp_path):
    import torch

    d = tmp_path / "ck"
    model, opt = _lora_model()
    with pccheck.Checkpointer(model, opt, d, incremental=True, max_concurrent=2, **KW) as ck:
        _train(model, opt, range(1, 7), ck)
        ck.wait()
        stats = list(ck.stats().checkpoints)
    frozen = sum(p.numel() * 4 for p in list(model[0].parameters()) + list(model[2].parameters()))
    later = [s for s in stats if s.step > 2]  # from step 3 on a commit (the base) always precedes the plan
    assert later and all(s.bytes_referenced >= frozen for s in later)
    assert all(s.bytes_written < s.bytes_referenced for s in later)

    # uninterrupted reference run to step 10, and a run resumed from step 6
    ref, ref_opt = _lora_model()
    _train(ref, ref_opt, range(1, 11))
    res, res_opt = _lora_model(seed=99)  # other initial weights: everything must come from the store
    r = pccheck.load_latest(d, model=res, optimizer=res_opt)
    assert r.step == 6
    with pccheck.Checkpointer(res, res_opt, d, incremental=True, max_concurrent=2, **KW) as ck:
        _train(res, res_opt, range(7, 11), ck)
        ck.wait()
        first_after_reopen = ck.stats().checkpoints[0]
    assert first_after_reopen.bytes_referenced >= frozen  # the reopened store's cells are referenced
    for a, b in zip(ref.state_dict().values(), res.state_dict().values()):
        assert torch.equal(a, b)
    again, again_opt = _lora_model(seed=5)
    assert pccheck.load_latest(d, model=again, optimizer=again_opt).step == 10
    for a, b in zip(ref.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["data", "no_grad", "copy_", "ema"])
def test_an_in_place_change_to_a_frozen_tensor_is_captured(tmp_path, how):
    import torch

    d = tmp_path / "ck"
    model, opt = _lora_model()
    frozen = model[0].weight
    with pccheck.Checkpointer(model, opt, d, incremental=True, **KW) as ck:
        for step in (1, 2):
            _train(model, opt, range(step, step + 1), ck)
            ck.wait()
        before = ck.stats().checkpoints[-1].bytes_written  # the adapter and its optimizer state
        version = frozen._version
        if how == "data":
            frozen.data[3, 7] += 1.0
        elif how == "no_grad":
            with torch.no_grad():
                frozen[0].mul_(0.5)
        elif how == "copy_":
            with torch.no_grad():
                frozen.copy_(torch.full_like(frozen, 0.25))
        else:  # an EMA of the adapter into the frozen copy, as a teacher update does
            with torch.no_grad():
                frozen.lerp_(torch.zeros_like(frozen), 0.01)
        if how == "data":
            assert frozen._version == version  # .data changes do not move the version counter
        want = frozen.detach().clone()
        _train(model, opt, range(3, 4), ck)
        ck.wait()
        assert ck.stats().checkpoints[-1].bytes_written >= before + frozen.numel() * 4
    fresh, fresh_opt = _lora_model(seed=7)
    pccheck.load_latest(d, model=fresh, optimizer=fresh_opt)
    assert torch.equal(fresh[0].weight, want)


# -- damage, reopen, layout changes, retention ------------------------------------------------------


def _two_cells(d: Path) -> tuple[dict, dict]:
    """Step 1 writes a and b into its slot; step 2 changes a only (a new cell), references b."""
    s1 = {"a": np.arange(5000, dtype=np.float64), "b": np.arange(7000, dtype=np.int32)}
    state = {k: v.copy() for k, v in s1.items()}
    with pccheck.Checkpointer(state, d, incremental=True, max_concurrent=1, **KW) as ck:
        ck.checkpoint(1)
        ck.wait()
        state["a"] += 1
        ck.checkpoint(2)
        ck.wait()
    return s1, {k: v.copy() for k, v in state.items()}


def _flip(d: Path, name: str) -> int:
    """Flips a byte of array ``name`` of the latest checkpoint, in the cell it references."""
    image, slot, man = manifest_of_latest(d)
    i = [e.name for e in man.arrays].index(name)
    cell = man.cell_of(i, slot)
    off = slot_base(image, cell) + man.arrays[i].offset + 17
    with open(d / STORE, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    return cell


def test_a_damaged_cell_only_the_latest_uses_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    d = tmp_path / "ck"
    s1, s2 = _two_cells(d)
    _flip(d, "a")
    r = pccheck.load_latest(d)
    assert r.step == 1 and "checksum mismatch" in caplog.text
    assert_state_equal(r.state, s1)


def test_a_damaged_cell_every_checkpoint_references_is_detected(tmp_path):
    d = tmp_path / "ck"
    _two_cells(d)
    _flip(d, "b")  # shared by steps 1 and 2: neither may load
    with pytest.raises(pccheck.NoCheckpointError, match="no valid checkpoint"):
        pccheck.load_latest(d)
    res = CliRunner().invoke(app, ["verify", str(d), "--json"])
    assert res.exit_code == 2, res.output
    assert all("checksum mismatch" in (s.get("problem") or "") for s in json.loads(res.stdout)["slots"]), res.stdout


def test_a_reopened_store_whose_latest_is_damaged_continues_from_the_previous_one(tmp_path):
    d = tmp_path / "ck"
    s1, _ = _two_cells(d)
    _flip(d, "a")
    state = {k: v.copy() for k, v in s1.items()}
    with pccheck.Checkpointer(state, d, incremental=True, max_concurrent=1, **KW) as ck:
        state["b"][0] = -1
        ck.checkpoint(3)
        ck.wait()
    r = pccheck.load_latest(d)
    assert r.step == 3
    assert_state_equal(r.state, state)


def _three_steps(d: Path) -> dict:
    """Steps 1-3 into 3 slots: the frozen base stays in slot 0's cell, which the latest (step 3)
    and its fallback (step 2) both reference, and slot 0 is the next checkpoint's own slot."""
    state = lora_like(0)
    with pccheck.Checkpointer(state, d, incremental=True, max_concurrent=2, **KW) as ck:
        for step in range(1, 4):
            _fill(state, step)
            ck.checkpoint(step)
            ck.wait()
    return state


def _cells_of(d: Path, slot: int) -> list[int]:
    image = read_store(d / STORE)
    with open(d / STORE, "rb", buffering=0) as f:
        man = read_manifest(image, slot, f.fileno())
    return [man.cell_of(i, slot) for i in range(len(man.arrays))]


def test_a_reopen_reads_no_array_data_and_its_first_checkpoint_writes_every_array(tmp_path):
    """Reopened with no load in this process before (3 slots): the latest is validated in the
    background and never referenced; the first checkpoint writes every array, into cells neither
    the latest nor the fallback kept for it names; the one after references again."""
    d = tmp_path / "ck"
    state = _three_steps(d)
    with pccheck.Checkpointer(state, d, incremental=True, max_concurrent=2, **KW) as ck:
        store = ck._orch.store
        assert not store.latest_checked and len(store.fallback) == 1
        latest_slot = manifest_of_latest(d)[1]
        kept = [set(cells) for cells in zip(_cells_of(d, latest_slot), _cells_of(d, store.fallback[0]))]
        _fill(state, 4)
        ck.checkpoint(4)
        ck.wait()
        first = ck.stats().checkpoints[-1]
        assert first.bytes_referenced == 0 and first.bytes_written == sum(v.nbytes for v in state.values())
        written = _cells_of(d, manifest_of_latest(d)[1])
        assert all(c not in k for c, k in zip(written, kept)), (written, kept)
        ck.checkpoint(5)
        ck.wait()
        assert ck.stats().checkpoints[-1].bytes_referenced >= state["base"].nbytes
    r = pccheck.load_latest(d)
    assert r.step == 5
    assert_state_equal(r.state, lora_like(4))


def test_a_reopen_whose_latest_is_damaged_keeps_its_fallback_through_a_failed_first_commit(tmp_path):
    """The latest's own adapter cell damaged before a reopen that reads no array data, then the
    frozen base changes and the first checkpoint's writes fail part way: they went to cells
    neither the latest nor its fallback names (the base's shared cell is in this checkpoint's own
    slot), so the fallback is still whole and loads; the next commit loads whole."""
    import errno

    d = tmp_path / "ck"
    state = _three_steps(d)
    _flip(d, "adapter")  # step 3 is damaged; step 2 is the fallback
    errors: list = []
    with pccheck.Checkpointer(state, d, incremental=True, max_concurrent=2, on_error=errors.append, **KW) as ck:
        assert not ck._orch.store.latest_checked
        state["base"] += 1
        _native.set_fault(_native.OP_PWRITE, 3, errno.EIO, True)  # after some of the base's bytes
        try:
            ck.checkpoint(4)
            ck.wait()
        finally:
            _native.clear_fault()
    assert errors, "the failed write is reported"
    r = pccheck.load_latest(d)
    assert r.step == 2
    assert_state_equal(r.state, lora_like(2))
    with pccheck.Checkpointer(state, d, incremental=True, max_concurrent=2, **KW) as ck:
        ck.checkpoint(5)
        ck.wait()
    r = pccheck.load_latest(d)
    assert r.step == 5
    assert_state_equal(r.state, state)


def test_a_new_layout_goes_to_a_new_generation(tmp_path):
    d = tmp_path / "ck"
    state = {"a": np.zeros(3000, np.float32)}
    with pccheck.Checkpointer(state, d, incremental=True, **KW) as ck:
        ck.checkpoint(1)
        ck.wait()
    grown = {"a": np.ones(3000, np.float32), "b": np.arange(10, dtype=np.int8)}
    with pccheck.Checkpointer(grown, d, incremental=True, **KW) as ck:
        ck.checkpoint(2)
        ck.wait()
        ck.checkpoint(3)
        ck.wait()
        assert ck.stats().checkpoints[-1].bytes_written == 0
    assert sorted(p.name for p in d.glob("store-*.pcc")) == ["store-000002.pcc"]
    assert_state_equal(pccheck.load_latest(d).state, grown)


def test_switching_a_full_store_to_incremental_and_back(tmp_path):
    d = tmp_path / "ck"
    state = {"a": np.arange(4000, dtype=np.float32), "b": np.ones(100, np.int64)}
    with pccheck.Checkpointer(state, d, **KW) as ck:
        ck.checkpoint(1)
    with pccheck.Checkpointer(state, d, incremental=True, **KW) as ck:
        for step in (2, 3):
            state["b"] += 1
            ck.checkpoint(step)
            ck.wait()
        assert ck.stats().checkpoints[-1].bytes_written == state["b"].nbytes
    assert_state_equal(pccheck.load_latest(d).state, state)
    with pccheck.Checkpointer(state, d, **KW) as ck:  # a full writer continues an incremental store
        state["a"][0] = 5
        ck.checkpoint(4)
    assert_state_equal(pccheck.load_latest(d).state, state)


def test_history_copies_read_through_references(tmp_path):
    from safetensors.numpy import load_file

    d = tmp_path / "ck"
    state = lora_like(0)
    with pccheck.Checkpointer(state, d, incremental=True, disk=pccheck.DiskOptions(every=1, keep_last=2),
                              **{k: v for k, v in KW.items() if k != "interval"}) as ck:
        for step in range(1, 6):
            _fill(state, step)
            ck.maybe_checkpoint(step)
            ck.wait()
    files = sorted((d / "history").glob("*.safetensors"))
    assert [f.name for f in files] == ["step-000004.safetensors", "step-000005.safetensors"]
    for f, step in zip(files, (4, 5)):
        got = load_file(f)
        for k, v in lora_like(step).items():
            assert got[k].tobytes() == v.tobytes(), (step, k)


def test_cli_reads_through_references(tmp_path):
    d = tmp_path / "ck"
    state = lora_like(0)
    with pccheck.Checkpointer(state, d, incremental=True, max_concurrent=2, **KW) as ck:
        for step in range(1, 5):
            _fill(state, step)
            ck.checkpoint(step)
            ck.wait()
    runner = CliRunner()
    res = runner.invoke(app, ["verify", str(d), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["latest"]["step"] == 4
    res = runner.invoke(app, ["inspect", str(d), "--json"])
    arrays = json.loads(res.stdout)["arrays"]
    assert all("cell" in a for a in arrays)
    out = tmp_path / "x.safetensors"
    res = runner.invoke(app, ["export", str(d), "--format", "safetensors", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    from safetensors.numpy import load_file

    got = load_file(out)
    for k, v in lora_like(4).items():
        assert got[k].tobytes() == v.tobytes(), k
    res = runner.invoke(app, ["ls", str(d), "--json"])
    assert res.exit_code == 0, res.output


def test_lazy_load_reads_through_references(tmp_path):
    import torch

    d = tmp_path / "ck"
    model, opt = _lora_model()
    with pccheck.Checkpointer(model, opt, d, incremental=True, **KW) as ck:
        _train(model, opt, range(1, 5), ck)
        ck.wait()
    fresh, fresh_opt = _lora_model(seed=3)
    r = pccheck.load_latest(d, model=fresh, optimizer=fresh_opt, lazy=True)
    r.wait() if hasattr(r, "wait") else None
    x = torch.randn(2, 64)
    assert torch.equal(fresh(x), model(x))
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)


# -- what is not supported yet is refused, naming what is --------------------------------------------


@pytest.mark.parametrize("kw, what", [
    (dict(spread_steps=2), "spread_steps"),
])
def test_unsupported_combinations_raise_config_error(tmp_path, kw, what):
    with pytest.raises(pccheck.ConfigError, match=f"{what}.*supported now: the disk tier"):
        pccheck.Checkpointer({"a": np.zeros(4)}, tmp_path / "ck", incremental=True, **kw)
    with pytest.raises(pccheck.ConfigError, match=what):
        pccheck.Options(disk=pccheck.DiskOptions(incremental=True)).updated(**kw)


def test_incremental_must_be_a_bool(tmp_path):
    with pytest.raises(pccheck.ConfigError, match="incremental"):
        pccheck.DiskOptions(incremental=1)
    assert pccheck.Options().disk.incremental is None  # the default: on where supported


def test_the_default_references_an_unchanged_array_of_host_state(tmp_path):
    """No incremental= given: host state taken whole is checkpointed incrementally (a frozen
    array is referenced, not written again), and loads bit for bit."""
    frozen, moving = np.arange(1 << 20, dtype=np.float32), np.zeros(1024, dtype=np.float32)
    with pccheck.Checkpointer({"frozen": frozen, "moving": moving}, tmp_path / "ck",
                              disk=pccheck.DiskOptions(every=1)) as ck:
        for step in (1, 2):
            moving[:] = step
            ck.maybe_checkpoint(step)
            ck.wait()
        last = ck.stats().as_dict()["checkpoints"][-1]
    assert last["bytes_referenced"] >= frozen.nbytes and last["bytes_written"] < frozen.nbytes
    got = pccheck.load_latest(tmp_path / "ck")
    assert got.step == 2 and np.array_equal(got.state["frozen"], frozen) and (got.state["moving"] == 2).all()


def test_the_default_is_off_where_incremental_is_not_supported(tmp_path, caplog):
    """No incremental= given, and state on a device (or spread steps, a device reserve, arrays so
    small that block alignment would grow the state): off, said in the log."""
    import dataclasses

    from pccheck.persist.layout import plan
    from pccheck.tiers.base import TierContext
    from pccheck.tiers.stack import _resolve_incremental

    host = plan({"host": np.zeros(4)})
    on_device = dataclasses.replace(host, infos=(dataclasses.replace(host.infos[0], device="cuda:0"),))
    ctx = TierContext(tmp_path, pccheck.Options(), None, {}, None, None, print)
    decided = _resolve_incremental(ctx, host).options
    assert decided.disk.incremental is True and decided.memory.incremental is False  # memory: when asked
    with caplog.at_level("INFO", logger="pccheck"):
        assert _resolve_incremental(ctx, on_device).options.disk.incremental is False
    assert "state on cuda:0" in caplog.text
    spread = dataclasses.replace(ctx, options=pccheck.Options().updated(spread_steps=2))
    assert _resolve_incremental(spread, host).options.disk.incremental is False
    assert _resolve_incremental(ctx, host, device_reserve=1 << 20).options.disk.incremental is False
    small = plan({f"a{i}": np.zeros(100, np.float32) for i in range(50)})  # 4 KiB cells for 400 bytes each
    with caplog.at_level("INFO", logger="pccheck"):
        assert _resolve_incremental(ctx, small).options.disk.incremental is False
    assert "50 arrays" in caplog.text
    explicit = dataclasses.replace(ctx, options=pccheck.Options().updated(incremental=False))
    assert _resolve_incremental(explicit, host).options.disk.incremental is False


def test_old_readers_refuse_a_referencing_manifest_cleanly(tmp_path):
    """Format 3: a reader that only knows formats 1 and 2 refuses the manifest ("unknown
    format") rather than reading another checkpoint's bytes from the slot."""
    from pccheck.persist import layout

    d = tmp_path / "ck"
    _two_cells(d)
    image, slot, man = manifest_of_latest(d)
    meta = image.slots[slot].meta
    with open(d / STORE, "rb") as f:
        f.seek(slot_base(image, slot) + meta["manifest_offset"])
        raw = f.read(meta["manifest_len"])
    assert json.loads(raw)["format"] == 3
    old = layout.READABLE_FORMATS
    try:
        layout.READABLE_FORMATS = (1, 2)
        with pytest.raises(pccheck.CorruptCheckpointError, match="unknown format"):
            layout.parse_manifest(raw, step=man.step, counter=man.counter, data_len_limit=meta["manifest_offset"])
    finally:
        layout.READABLE_FORMATS = old


@pytest.mark.parametrize("field, value, match", [
    ("cell", 200, "beyond"), ("cell", -1, "cell"), ("fp", "xyz", "fingerprint"), ("offset", 64, "block"),
])
def test_hostile_cell_fields_are_corrupt(tmp_path, field, value, match):
    from pccheck.persist.layout import parse_manifest
    from pccheck.persist.recovery import manifest_from

    d = tmp_path / "ck"
    _two_cells(d)
    image, slot, man = manifest_of_latest(d)
    meta = image.slots[slot].meta
    with open(d / STORE, "rb") as f:
        f.seek(slot_base(image, slot) + meta["manifest_offset"])
        doc = json.loads(f.read(meta["manifest_len"]))
    doc["arrays"][0][field] = value
    raw = json.dumps(doc).encode()
    with pytest.raises(pccheck.CorruptCheckpointError, match=match):
        m = parse_manifest(raw, step=man.step, counter=man.counter, data_len_limit=meta["manifest_offset"])
        fake = dict(meta, manifest_len=len(raw), manifest_crc=_native.crc32c(raw))
        slots = list(image.slots)
        slots[slot] = type(slots[slot])(slot, fake, None)
        manifest_from(type(image)(image.path, image.header, image.check_word, tuple(slots)), slot, raw)
        del m


def test_the_deferred_plan_sees_the_buffers_as_they_were_at_the_call(tmp_path):
    """With soft copy-on-write the fingerprint pass and the plan run on the commit thread; the
    buffers (which the next forward changes) are cloned at the call, so the checkpoint holds them
    as they were then, and the optimizer step waits for the pass (cow_wait)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    d = tmp_path / "ck"
    with pccheck.Checkpointer(model, opt, d, incremental=True, **KW) as ck:
        for step in range(1, 5):
            model(torch.randn(16, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
            ck.checkpoint(step)
            want = {k: v.clone() for k, v in model.state_dict().items()}
            model(torch.randn(16, 32) * 5).sum().backward()  # moves the running statistics
            opt.step()  # waits for the checkpoint's fingerprint pass and copy
            opt.zero_grad()
            ck.wait()
            fresh = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32))
            pccheck.load_latest(d, model=fresh)
            for k, v in fresh.state_dict().items():
                assert torch.equal(v, want[k]), (step, k)
        st = list(ck.stats().checkpoints)
    assert st[-1].bytes_referenced >= 32 * 32 * 4  # the frozen linear layer


def test_deferred_checkpoints_of_two_layouts_never_share_a_generation(tmp_path):
    """Two checkpoints started back to back with different layouts, each planned later on a commit
    thread: the second waits for the first and goes to a new generation (one layout per
    generation), and both load bit-exact in turn."""
    from pccheck.orchestrator.args import StartArgs
    from pccheck.orchestrator.copy_engine import CpuCopyEngine
    from pccheck.orchestrator.options import EngineOptions
    from pccheck.orchestrator.orchestrator import Orchestrator
    from pccheck.persist.layout import plan

    small = {"a": np.arange(3000, dtype=np.float32)}
    grown = {"a": np.arange(3000, dtype=np.float32) + 1, "b": np.arange(9000, dtype=np.int64)}
    errors: list = []
    orch = Orchestrator(tmp_path / "s", plan(small), EngineOptions(max_concurrent=2, writer_threads=1,
                                                                    chunk_size=1 << 16, storage="mmap"),
                        copy_engine=CpuCopyEngine(threads=1), on_error=errors.append, incremental=True)
    try:
        orch.start(1, small, {}, StartArgs(n_eager=0))
        orch.start(2, grown, {}, StartArgs(n_eager=0))
        orch.ensure_copied()
        orch.wait()
        assert [s.outcome for s in orch.stats] == ["committed", "committed"] and not errors
        orch.start(3, grown, {}, StartArgs(n_eager=0))
        orch.ensure_copied()
        orch.wait()
    finally:
        orch.close()
    assert [s.bytes_written for s in orch.stats] == [12000, 84000, 0]
    assert sorted(p.name for p in (tmp_path / "s").glob("store-*.pcc")) == ["store-000002.pcc"]
    assert_state_equal(pccheck.load_latest(tmp_path / "s").state, grown)
