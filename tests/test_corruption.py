"""Random on-disk corruption of a real store: load_latest never returns wrong bytes.

A store is built once by a real Checkpointer (3 slots, 5 checkpoints whose contents are a pure
function of the step). Every case copies the pristine file, damages it, and calls load_latest.
The contract checked for every case:

* it raises a PCCheckError subclass and nothing else, or
* it returns a checkpoint whose step was written and whose arrays equal expected(step) exactly.

On top of that each flip case is checked against an exact oracle derived from FORMAT.md: which
bytes are covered by which checksum, the CHECK_ADDR rule, and the newest-counter fallback scan.

PCCHECK_CORRUPTION_CASES scales the number of random flip / truncation cases (default 1000 / 300).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import pccheck
from pccheck.native import _native
from pccheck.persist.recovery import read_manifest, read_store

# --------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------

BLOCK = 4096
STORE_NAME = "store-000001.pcc"
STEPS = (1, 2, 3, 4, 5)
HEADER_CRC_SPAN = (0, 128)  # bytes [0,124) + their crc at [124,128)
WORD = (128, 136)  # CHECK_ADDR, outside the header crc
META_SPAN = 128  # a meta record's bytes [0,124) + crc at [124,128)
N_FLIP_CASES = max(200, int(os.environ.get("PCCHECK_CORRUPTION_CASES", "1000")))
N_TRUNC_CASES = max(30, N_FLIP_CASES * 3 // 10)

REC_DTYPE = np.dtype([("a", "<i4"), ("b", "<f8"), ("c", "S3")])


def expected(step: int) -> dict[str, np.ndarray]:
    """The state saved at ``step``: mixed dtypes, ~100 KiB, a pure function of the step."""
    rng = np.random.default_rng(1000 + step)
    rec = np.zeros(60, dtype=REC_DTYPE)
    rec["a"] = rng.integers(-2**31, 2**31, size=60, dtype=np.int32)
    rec["b"] = rng.standard_normal(60)
    rec["c"] = [bytes(rng.integers(65, 91, size=3, dtype=np.uint8)) for _ in range(60)]
    return {
        "w": rng.standard_normal((96, 200)).astype(np.float32),        # 76800 B
        "ids": rng.integers(-2**62, 2**62, size=2000, dtype=np.int64),  # 16000 B
        "mask": rng.integers(0, 256, size=(3, 1001), dtype=np.uint8),  # 3003 B
        "h": rng.standard_normal(777).astype(np.float16),              # 1554 B
        "rec": rec,                                                      # 900 B, structured
        "empty": np.zeros((0, 5), dtype=np.complex64),                   # zero-size
    }


def same_bytes(got: np.ndarray, want: np.ndarray) -> bool:
    return (got.dtype == want.dtype and got.shape == want.shape
            and np.ascontiguousarray(got).tobytes() == want.tobytes())


def check_restored(r: pccheck.Restored) -> None:
    """The one thing load_latest may never do: return bytes that were not written."""
    assert r.step in STEPS, f"returned step {r.step} was never written"
    want = expected(r.step)
    assert sorted(r.state) == sorted(want), f"step {r.step}: names {sorted(r.state)}"
    for name, arr in want.items():
        assert same_bytes(r.state[name], arr), f"step {r.step}: array {name!r} differs"
    assert r.metadata == {"tag": "corruption", "step": r.step}


def load_outcome(directory: Path, *, zero_copy: bool = False):
    """('ok', Restored) or ('error', exc); any non-PCCheckError propagates and fails the test."""
    try:
        r = pccheck.load_latest(directory, zero_copy=zero_copy)
    except pccheck.PCCheckError as exc:
        return "error", exc
    check_restored(r)
    return "ok", r


class Pristine:
    """The pristine store bytes and where every checksummed region lies."""

    def __init__(self, data: bytes, path: Path) -> None:
        self.data = data
        self.size = len(data)
        image = read_store(path)
        self.header = image.header
        self.word = image.check_word
        self.num_slots = image.header["num_slots"]
        self.latest_slot = _native.word_slot(self.word)
        self.meta = {}  # slot -> meta dict
        self.regions = {}  # slot -> {"meta": (a,b), "manifest": (a,b), "arrays": [(a,b), ...]}
        self.slot_range = {}
        with open(path, "rb") as f:
            for st in image.slots:
                assert st.meta is not None, f"slot {st.slot} unexpectedly {st.problem}"
                s = st.slot
                base = image.header["slots_offset"] + s * image.header["slot_capacity"]
                man = read_manifest(image, s, f.fileno())
                self.meta[s] = st.meta
                self.slot_range[s] = (base, base + image.header["slot_capacity"])
                self.regions[s] = {
                    "meta": ((1 + s) * BLOCK, (1 + s) * BLOCK + META_SPAN),
                    "manifest": (base + st.meta["manifest_offset"],
                                 base + st.meta["manifest_offset"] + st.meta["manifest_len"]),
                    "arrays": [(base + e.offset, base + e.offset + e.nbytes) for e in man.arrays if e.nbytes],
                }

    def small_regions(self) -> list[tuple[int, int]]:
        """The tiny metadata regions a uniform flip would almost never hit."""
        out = [HEADER_CRC_SPAN, WORD, WORD]
        for s in range(self.num_slots):
            out += [self.regions[s]["meta"], self.regions[s]["manifest"]]
        return out

    def oracle(self, damaged: bytes) -> int | None:
        """The slot load_latest must return for a same-size damaged file, or None (must raise).

        Every checksum is crc32c over at most a few hundred KiB, and at most 8 bytes differ, so
        a damaged region fails its check (an undetected error has probability ~2**-32).
        """
        a, b = HEADER_CRC_SPAN
        if damaged[a:b] != self.data[a:b]:
            return None  # header checksum fails: the only store file is unusable

        def intact(a: int, b: int) -> bool:
            return damaged[a:b] == self.data[a:b]

        meta_ok = {s: intact(*self.regions[s]["meta"]) for s in self.meta}
        slot_ok = {s: meta_ok[s] and intact(*self.regions[s]["manifest"])
                   and all(intact(*r) for r in self.regions[s]["arrays"]) for s in self.meta}
        word = struct.unpack_from("<Q", damaged, WORD[0])[0]
        ws, wc = word & 0xFF, word >> 8
        if word and ws in self.meta and meta_ok[ws] and self.meta[ws]["counter"] == wc and slot_ok[ws]:
            return ws
        valid = [s for s in self.meta if slot_ok[s]]
        return max(valid, key=lambda s: self.meta[s]["counter"]) if valid else None


def flip(data: bytearray, pos: int, rng: random.Random) -> None:
    data[pos] ^= rng.randrange(1, 256)


def write_store(directory: Path, data: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / STORE_NAME).write_bytes(data)


# --------------------------------------------------------------------------------------------
# the store
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Pristine:
    directory = tmp_path_factory.mktemp("pristine")
    state = {k: v.copy() for k, v in expected(0).items()}
    ck = pccheck.Checkpointer(state, directory, interval=1, max_concurrent=2, chunk_size=16 << 10,
                              metadata={"tag": "corruption"})
    try:
        for step in STEPS:
            for name, arr in expected(step).items():
                state[name][...] = arr  # in place: the Checkpointer reads the mapping each time
            assert ck.maybe_checkpoint(step, metadata={"step": step})
            ck.wait()  # deterministic slot contents: the last three steps, one per slot
    finally:
        ck.close()
    path = directory / STORE_NAME
    p = Pristine(path.read_bytes(), path)
    # The fixture is what every case's oracle rests on: check it is what we think it is.
    assert p.num_slots == 3
    assert sorted(m["step"] for m in p.meta.values()) == [3, 4, 5]
    assert all(m["counter"] == m["step"] for m in p.meta.values())
    assert p.meta[p.latest_slot]["step"] == 5
    assert len(p.regions[p.latest_slot]["arrays"]) == 5  # "empty" has no bytes
    r = pccheck.load_latest(directory)
    assert r.step == 5 and r.slot == p.latest_slot
    check_restored(r)
    assert p.oracle(p.data) == p.latest_slot
    return p


# --------------------------------------------------------------------------------------------
# random byte flips
# --------------------------------------------------------------------------------------------


def test_random_flips(pristine: Pristine, tmp_path: Path, capsys) -> None:
    """N cases of 1..8 random byte flips; half biased to the header, word, metas and manifests."""
    p = pristine
    small = p.small_regions()
    outcomes: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    failures = []
    for seed in range(N_FLIP_CASES):
        rng = random.Random(seed)
        kind = ("uniform", "uniform", "targeted", "targeted", "mixed")[seed % 5]
        kinds[kind] += 1
        data = bytearray(p.data)
        for _ in range(rng.randint(1, 8)):
            if kind == "targeted" or (kind == "mixed" and rng.random() < 0.5):
                a, b = rng.choice(small)
                pos = rng.randrange(a, b)
            else:
                pos = rng.randrange(p.size)
            flip(data, pos, rng)
        want = p.oracle(bytes(data))
        d = tmp_path / f"case{seed}"
        write_store(d, bytes(data))
        what, res = load_outcome(d, zero_copy=seed % 3 == 0)  # also exercise the mmap path
        if what == "error":
            outcomes["error"] += 1
            if want is not None:
                failures.append(f"seed {seed}: raised {res!r}, oracle says slot {want} "
                                f"(step {p.meta[want]['step']})")
            elif not isinstance(res, pccheck.NoCheckpointError):
                failures.append(f"seed {seed}: raised {type(res).__name__}, want NoCheckpointError")
        else:
            outcomes["latest" if res.step == 5 else "older"] += 1
            if want is None or res.slot != want:
                failures.append(f"seed {seed}: returned slot {res.slot} step {res.step}, oracle "
                                f"says {'an error' if want is None else f'slot {want}'}")
        del res
        shutil.rmtree(d)
    with capsys.disabled():
        print(f"\n[corruption] {N_FLIP_CASES} flip cases {dict(kinds)}: {dict(outcomes)}")
    assert not failures, "\n".join(failures[:20])
    assert sum(outcomes.values()) == N_FLIP_CASES >= 200
    # The distribution must actually exercise all three outcomes.
    assert outcomes["latest"] > 0 and outcomes["older"] > 0 and outcomes["error"] > 0, outcomes


def test_flips_in_other_slots_data_keep_latest(pristine: Pristine, tmp_path: Path, caplog) -> None:
    """Damage confined to the array data of slots CHECK_ADDR does not name: latest, silently."""
    p = pristine
    others = [s for s in p.meta if s != p.latest_slot]
    for seed in range(40):
        rng = random.Random(10_000 + seed)
        data = bytearray(p.data)
        for _ in range(rng.randint(1, 8)):
            a, b = rng.choice([r for s in others for r in p.regions[s]["arrays"]])
            flip(data, rng.randrange(a, b), rng)
        d = tmp_path / f"c{seed}"
        write_store(d, bytes(data))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pccheck"):
            what, r = load_outcome(d)
        assert what == "ok", f"seed {seed}: {r!r}"
        assert r.step == 5 and r.slot == p.latest_slot
        assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize("array_index", range(5))
@pytest.mark.parametrize("zero_copy", [False, True])
def test_flip_in_latest_data_falls_back(pristine: Pristine, tmp_path: Path, caplog, array_index,
                                        zero_copy) -> None:
    """A flip in the CHECK_ADDR slot's array data: fall back to step 4, with a warning."""
    p = pristine
    a, b = p.regions[p.latest_slot]["arrays"][array_index]
    rng = random.Random(array_index)
    for pos in (a, b - 1, rng.randrange(a, b)):
        data = bytearray(p.data)
        flip(data, pos, rng)
        d = tmp_path / f"p{pos}"
        write_store(d, bytes(data))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pccheck"):
            what, r = load_outcome(d, zero_copy=zero_copy)
        assert what == "ok", r
        assert r.step == 4 and r.counter == 4 and r.slot != p.latest_slot
        warnings = [rec for rec in caplog.records
                    if rec.name == "pccheck" and rec.levelno == logging.WARNING]
        assert warnings, "fell back without a warning"
        msg = warnings[0].getMessage()
        assert "falling back" in msg and "checksum mismatch" in msg, msg


def test_flip_in_word_to_older_slot_is_honoured_or_ignored(pristine: Pristine, tmp_path: Path) -> None:
    """CHECK_ADDR rewritten to name an older slot with its true counter: that (valid) slot loads.
    Rewritten to nonsense (wrong counter, slot out of range, zero): the scan finds the newest."""
    p = pristine
    older = next(s for s in p.meta if p.meta[s]["step"] == 4)
    cases = {
        _native.make_word(4, older): 4,
        _native.make_word(5, older): 5,   # counter does not match that slot's record
        _native.make_word(5, 7): 5,       # slot out of range
        _native.make_word(99, p.latest_slot): 5,
        0: 5,
        2**64 - 1: 5,
    }
    for word, want_step in cases.items():
        data = bytearray(p.data)
        struct.pack_into("<Q", data, WORD[0], word)
        d = tmp_path / f"w{word}"
        write_store(d, bytes(data))
        what, r = load_outcome(d)
        assert what == "ok", r
        assert r.step == want_step, f"word {word:#x}: got step {r.step}"


# --------------------------------------------------------------------------------------------
# truncation, empty and foreign files
# --------------------------------------------------------------------------------------------


def test_truncation(pristine: Pristine, tmp_path: Path, capsys) -> None:
    p = pristine
    rng = random.Random(4242)
    lengths = {0, 1, 8, 127, 128, 135, 136, BLOCK - 1, BLOCK, BLOCK + 1, p.header["slots_offset"],
               p.size - 1, p.size - BLOCK}
    for s in p.meta:
        lengths |= {p.regions[s]["manifest"][0], p.regions[s]["manifest"][1] - 1, p.slot_range[s][0]}
    while len(lengths) < N_TRUNC_CASES:
        lengths.add(rng.randrange(p.size))
    outcomes: Counter[str] = Counter()
    for n in sorted(lengths):
        d = tmp_path / f"t{n}"
        write_store(d, p.data[:n])
        what, res = load_outcome(d, zero_copy=n % 2 == 1)
        outcomes[what if what == "error" else ("latest" if res.step == 5 else "older")] += 1
        # The geometry in the header says how long the file must be; a shorter one is rejected.
        assert what == "error", f"truncated to {n}: returned step {res.step}"
        assert isinstance(res, pccheck.NoCheckpointError), repr(res)
        del res
        shutil.rmtree(d)
    with capsys.disabled():
        print(f"\n[corruption] {len(lengths)} truncations: {dict(outcomes)}")
    # Growing the file (garbage appended past the geometry) is harmless.
    for extra in (1, BLOCK, 3 * BLOCK + 5):
        d = tmp_path / f"grow{extra}"
        write_store(d, p.data + os.urandom(extra))
        what, r = load_outcome(d)
        assert what == "ok" and r.step == 5, r


def test_zero_length_file(tmp_path: Path) -> None:
    write_store(tmp_path, b"")
    with pytest.raises(pccheck.NoCheckpointError):
        pccheck.load_latest(tmp_path)
    with pytest.raises(pccheck.NoCheckpointError):
        pccheck.load_latest(tmp_path, zero_copy=True)


@pytest.mark.parametrize("size", [1, 100, BLOCK - 1, BLOCK, BLOCK * 5 + 3, 446_464, 1 << 20])
def test_random_bytes_file(tmp_path: Path, size: int) -> None:
    rng = random.Random(size)
    write_store(tmp_path, rng.randbytes(size))
    with pytest.raises(pccheck.NoCheckpointError):
        pccheck.load_latest(tmp_path)


def test_random_bytes_after_a_valid_header(pristine: Pristine, tmp_path: Path) -> None:
    """A valid header (geometry, word) over garbage: every meta record fails, nothing loads."""
    rng = random.Random(7)
    write_store(tmp_path, pristine.data[:BLOCK] + rng.randbytes(pristine.size - BLOCK))
    with pytest.raises(pccheck.NoCheckpointError):
        pccheck.load_latest(tmp_path)


def test_directory_named_like_a_store(tmp_path: Path) -> None:
    (tmp_path / STORE_NAME).mkdir()
    with pytest.raises(pccheck.NoCheckpointError):
        pccheck.load_latest(tmp_path)


def test_garbage_newer_generation_falls_back_to_older(pristine: Pristine, tmp_path: Path,
                                                      caplog) -> None:
    """store-000002.pcc is random bytes: the valid store-000001.pcc still loads, with a warning."""
    write_store(tmp_path, pristine.data)
    (tmp_path / "store-000002.pcc").write_bytes(random.Random(2).randbytes(3 * BLOCK))
    with caplog.at_level(logging.WARNING, logger="pccheck"):
        what, r = load_outcome(tmp_path)
    assert what == "ok" and r.step == 5 and r.generation == 1, r
    assert any("store-000002.pcc" in rec.getMessage() for rec in caplog.records), caplog.text
