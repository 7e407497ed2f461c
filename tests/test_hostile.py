"""The parsers treat store files as hostile input.

* ``_native.parse_header`` / ``_native.parse_meta``: fuzzed with arbitrary bytes and with valid
  records whose fields are then mutated and the crc recomputed (so the semantic checks, not just
  the checksum, are reached). Each result is compared with a small Python reference parser
  written from the format (FORMAT.md §2-3, format.h): ValueError exactly when the reference rejects, the same fields
  when it accepts. Nothing but ValueError may ever come out.
* ``parse_manifest``: fuzzed with arbitrary bytes, arbitrary JSON and structurally valid JSON with
  hostile fields. Only CorruptCheckpointError may come out, and whatever it accepts must satisfy
  the invariants recovery relies on (checked independently here).
* Crafted store files whose manifest / meta / header point outside the file or carry negative or
  overflowing sizes, with every crc recomputed: load_latest rejects them with a PCCheckError,
  falls back to a valid older slot if there is one, and never allocates more than the file's
  size (run in a subprocess under RLIMIT_AS).

Volume: PCCHECK_FUZZ_EXAMPLES (default 25000, `make test`; `make test-slow` runs 100000) generated
inputs in total across the fuzzers, split by fixed shares. Set it higher (e.g. 2000000) for a long
manual run.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pccheck
from pccheck import CorruptCheckpointError
from pccheck.native import _native
from pccheck.persist.layout import Manifest, parse_manifest

# --------------------------------------------------------------------------------------------
# shared helpers: a reference packer / parser for the two fixed records
# --------------------------------------------------------------------------------------------

BLOCK = 4096
U64 = 2**64 - 1
HEADER_MAGIC = b"PCCHECK\0"
META_MAGIC = b"PCCMETA\0"
HEADER_FMT = "<8sIIIIQQQIIQ"   # magic version block_size num_slots flags slot_capacity slots_offset
#                                generation world_size rank created_ns   (64 bytes)
META_FMT = "<8sIIQqQQQI4xQ"    # magic version slot counter step data_len manifest_offset
#                                manifest_len manifest_crc (pad) unix_ns  (72 bytes)
HEADER_FIELDS = ("version", "block_size", "num_slots", "flags", "slot_capacity", "slots_offset",
                 "generation", "world_size", "rank", "created_unix_ns")
META_FIELDS = ("version", "slot", "counter", "step", "data_len", "manifest_offset", "manifest_len",
               "manifest_crc", "unix_ns")

TOTAL_EXAMPLES = int(os.environ.get("PCCHECK_FUZZ_EXAMPLES", "25000"))
SHARES = {  # fraction of TOTAL_EXAMPLES per fuzzer (the cheap native ones get the most)
    "header_bytes": 0.20,
    "header_fields": 0.27,
    "meta_bytes": 0.16,
    "meta_fields": 0.27,
    "manifest_bytes": 0.05,
    "manifest_json": 0.01,
    "manifest_hostile": 0.04,
}
EXECUTED: Counter[str] = Counter()
# Why the native parsers said no (digits folded), per fuzzer: proves the semantic checks behind
# the checksum were reached, not just the checksum itself.
REASONS: dict[str, Counter[str]] = {}
ELAPSED: dict[str, float] = {}


def fuzz_settings(name: str) -> settings:
    return settings(max_examples=max(1, int(TOTAL_EXAMPLES * SHARES[name])), deadline=None,
                    database=None, derandomize=False, print_blob=True,
                    suppress_health_check=list(HealthCheck))


def run_fuzzer(name: str, fn, min_reasons: int = 0, must_accept: bool = False) -> None:
    """Runs a @given function and checks it really executed (about) its share of inputs, and
    (native parsers) that it saw at least ``min_reasons`` kinds of rejection (and acceptances)."""
    before = EXECUTED[name]
    t0 = time.perf_counter()
    fn()
    ELAPSED[name] = ELAPSED.get(name, 0.0) + time.perf_counter() - t0
    ran = EXECUTED[name] - before
    want = int(TOTAL_EXAMPLES * SHARES[name])
    assert ran >= 0.95 * want, f"{name}: only {ran} of {want} inputs were generated"
    if min_reasons and want >= 2000:  # too few examples may legitimately miss a rare check
        reasons = REASONS.get(name, Counter())
        assert reasons["ACCEPTED"] > 0 or not must_accept, f"{name}: nothing was accepted: {reasons}"
        rejected = [k for k in reasons if k not in ("ACCEPTED", "EMPTY")]
        assert len(rejected) >= min_reasons, f"{name}: only these rejections were reached: {reasons}"


def crc(b: bytes) -> int:
    return _native.crc32c(b)


def pack_header(f: dict, word: int = 0, *, fix_crc: bool = True) -> bytearray:
    b = bytearray(BLOCK)
    struct.pack_into(HEADER_FMT, b, 0, HEADER_MAGIC, *(f[k] for k in HEADER_FIELDS))
    if fix_crc:
        struct.pack_into("<I", b, 124, crc(bytes(b[:124])))
    struct.pack_into("<Q", b, 128, word)
    return b


def pack_meta(f: dict) -> bytearray:
    b = bytearray(BLOCK)
    struct.pack_into(META_FMT, b, 0, META_MAGIC, *(f[k] for k in META_FIELDS))
    struct.pack_into("<I", b, 124, crc(bytes(b[:124])))
    return b


def refix_crc(b: bytearray) -> bytearray:
    struct.pack_into("<I", b, 124, crc(bytes(b[:124])))
    return b


def ref_parse_header(b: bytes) -> dict | None:
    """FORMAT.md §2, independently: the header dict, or None if block 0 is invalid."""
    if len(b) < BLOCK or b[:8] != HEADER_MAGIC:
        return None
    if struct.unpack_from("<I", b, 124)[0] != crc(b[:124]):
        return None
    f = dict(zip(HEADER_FIELDS, struct.unpack_from(HEADER_FMT, b, 0)[1:]))
    n, cap, so = f["num_slots"], f["slot_capacity"], f["slots_offset"]
    ok = (f["version"] == 1 and f["block_size"] == BLOCK and 2 <= n <= 255
          and cap > 0 and cap % BLOCK == 0 and so == (1 + n) * BLOCK
          and f["world_size"] > 0 and f["rank"] < f["world_size"]
          and so + n * cap <= U64)  # Python ints: the exact "fits in 64 bits" condition
    if not ok:
        return None
    f["file_size"] = so + n * cap
    f["check_word"] = struct.unpack_from("<Q", b, 128)[0]
    return f


def ref_parse_meta(b: bytes, slot: int, cap: int):
    """FORMAT.md §3, independently: a dict, "empty" for an all-zero record, or None if invalid."""
    if len(b) < BLOCK:
        return None
    if not any(b[:BLOCK]):
        return "empty"
    if b[:8] != META_MAGIC or struct.unpack_from("<I", b, 124)[0] != crc(b[:124]):
        return None
    f = dict(zip(META_FIELDS, struct.unpack_from(META_FMT, b, 0)[1:]))
    ok = (f["version"] == 1 and f["slot"] == slot and 1 <= f["counter"] <= 2**56 - 1
          and f["manifest_offset"] % BLOCK == 0 and f["data_len"] <= f["manifest_offset"]
          and f["manifest_offset"] + f["manifest_len"] <= cap)
    if not ok:
        return None
    del f["version"]
    return f


def note(fuzzer: str, reason: str) -> None:
    REASONS.setdefault(fuzzer, Counter())[re.sub(r"\d+", "N", reason)] += 1


def check_native_header(b: bytes, fuzzer: str = "") -> None:
    want = ref_parse_header(b)
    try:
        got = _native.parse_header(b)
    except ValueError as exc:
        assert want is None, f"rejected a valid header ({exc}): {want}"
        assert str(exc), "ValueError without a reason"
        note(fuzzer, str(exc))
        return
    note(fuzzer, "ACCEPTED")
    assert want is not None, f"accepted an invalid header: {got}"
    assert got == want


def check_native_meta(b: bytes, slot: int, cap: int, fuzzer: str = "") -> None:
    want = ref_parse_meta(b, slot, cap)
    try:
        got = _native.parse_meta(b, slot, cap)
    except ValueError as exc:
        assert want is None, f"rejected a valid meta record ({exc}): {want}"
        assert str(exc), "ValueError without a reason"
        note(fuzzer, str(exc))
        return
    if got is None:
        assert want == "empty", f"called a non-empty record empty (reference: {want})"
        note(fuzzer, "EMPTY")
        return
    note(fuzzer, "ACCEPTED")
    assert want not in (None, "empty"), f"accepted an invalid meta record: {got}"
    assert got == want


# Values a hostile writer would pick, plus uniform ones.
U32_EDGE = [0, 1, 2, 3, 4, 254, 255, 256, 257, 4095, 4096, 4097, 2**16, 2**31 - 1, 2**31, 2**32 - 1]
U64_EDGE = [0, 1, 63, 64, 4095, 4096, 4097, 8192, 2**31, 2**32 - 1, 2**32, 2**32 + 4096, 2**56 - 1,
            2**56, 2**62, 2**63 - 4096, 2**63 - 1, 2**63, 2**64 - 4096, 2**64 - 1]


class Reader:
    """Decodes a hypothesis byte string into structured choices (one cheap draw per example;
    the bytes still shrink towards zero, i.e. towards the sane choices)."""

    def __init__(self, b: bytes) -> None:
        self.b, self.i = b, 0

    def take(self, n: int) -> int:
        chunk = self.b[self.i:self.i + n]
        self.i += n
        return int.from_bytes(chunk, "little")

    def u8(self) -> int:
        return self.take(1)

    def below(self, n: int) -> int:
        return self.take(4) % n

    def pick(self, seq):
        return seq[self.u8() % len(seq)]

    def chance(self, per256: int) -> bool:
        """True with probability per256/256 (a zero byte, the shrink target, says False)."""
        return self.u8() >= 256 - per256

    def u32(self) -> int:
        k = self.u8() % 3
        return self.pick(U32_EDGE) if k == 0 else self.take(4) if k == 1 else self.u8()

    def u64(self) -> int:
        k = self.u8() % 5
        if k == 0:
            return self.pick(U64_EDGE)
        if k == 1:
            return self.take(8)
        if k == 2:
            return self.take(3) * BLOCK  # up to 2**24 blocks
        if k == 3:
            return (self.take(8) % 2**52) * BLOCK
        return self.take(2)

    def patches(self, lo: int, hi: int, max_n: int) -> list[tuple[int, int]]:
        return [(lo + self.take(2) % (hi - lo), self.u8()) for _ in range(self.u8() % (max_n + 1))]


def apply(b: bytearray, ps) -> bytearray:
    for pos, val in ps:
        b[pos] = val
    return b


VALID_HEADER = {"version": 1, "block_size": BLOCK, "num_slots": 3, "flags": 0,
                "slot_capacity": 36 * BLOCK, "slots_offset": 4 * BLOCK, "generation": 1,
                "world_size": 1, "rank": 0, "created_unix_ns": 1_700_000_000_000_000_000}

# --------------------------------------------------------------------------------------------
# parse_header
# --------------------------------------------------------------------------------------------


def test_reference_parsers_agree_on_known_records() -> None:
    """The reference parsers are what the fuzzers judge by: check them on known records."""
    assert crc(b"123456789") == 0xE3069283  # the crc32c check value
    h = pack_header(VALID_HEADER, word=_native.make_word(7, 2))
    want = dict(VALID_HEADER, file_size=4 * BLOCK + 3 * 36 * BLOCK, check_word=(7 << 8) | 2)
    assert ref_parse_header(bytes(h)) == want == _native.parse_header(bytes(h))
    for bad in ({"num_slots": 1}, {"num_slots": 256, "slots_offset": 257 * BLOCK}, {"rank": 1},
                {"slot_capacity": 4097}, {"slots_offset": 3 * BLOCK}, {"version": 2}):
        b = bytes(pack_header({**VALID_HEADER, **bad}))
        assert ref_parse_header(b) is None
        with pytest.raises(ValueError):
            _native.parse_header(b)
    m = {"version": 1, "slot": 1, "counter": 5, "step": -3, "data_len": 8192, "manifest_offset": 8192,
         "manifest_len": 300, "manifest_crc": 0xDEADBEEF, "unix_ns": 12345}
    want_m = {k: v for k, v in m.items() if k != "version"}
    assert ref_parse_meta(bytes(pack_meta(m)), 1, 3 * BLOCK) == want_m == _native.parse_meta(
        bytes(pack_meta(m)), 1, 3 * BLOCK)
    assert ref_parse_meta(bytes(pack_meta(m)), 1, 2 * BLOCK) is None  # manifest past the slot
    assert ref_parse_meta(bytes(BLOCK), 0, BLOCK) == "empty"
    assert _native.parse_meta(bytes(BLOCK), 0, BLOCK) is None


def header_bytes_from(r: Reader) -> bytes:
    """Arbitrary-ish block 0 candidates: short junk, block-sized junk (with the magic and a
    matching crc or not), a valid header with random patches (crc recomputed or not)."""
    kind = r.u8() % 5
    if kind == 0:  # anything short
        return r.b[r.i:r.i + r.u8() + r.u8()]
    if kind == 1:
        b = bytearray(r.b[r.i:r.i + 128].ljust(128, b"\0"))
        r.i += 128
        if r.chance(128):
            b[:8] = HEADER_MAGIC
        b += bytes(BLOCK - 128 + r.pick([-1, 0, 0, 1, 100]))
        if len(b) >= BLOCK and r.chance(128):
            refix_crc(b)
        return bytes(b)
    b = pack_header(VALID_HEADER, word=r.u64())
    lo, hi = ((0, 128), (0, 72), (128, BLOCK))[kind - 2]
    apply(b, r.patches(lo, hi, 8))
    if kind == 3:
        refix_crc(b)
    return bytes(b) + bytes(r.u8() % 17)


@fuzz_settings("header_bytes")
@given(st.binary(min_size=0, max_size=320))
def _fuzz_header_bytes(seed: bytes) -> None:
    EXECUTED["header_bytes"] += 1
    check_native_header(header_bytes_from(Reader(seed)), "header_bytes")


def test_fuzz_parse_header_arbitrary_bytes() -> None:
    run_fuzzer("header_bytes", _fuzz_header_bytes, min_reasons=5)


def header_fields_from(r: Reader) -> dict:
    """A plausible header with some fields (each with probability 1/8) made hostile."""
    n = 2 + r.u8() % 254
    ws = 1 + r.take(2) % 1024
    f = {"version": 1, "block_size": BLOCK, "num_slots": n, "flags": r.u32(),
         "slot_capacity": (1 + r.take(3)) * BLOCK, "slots_offset": (1 + n) * BLOCK,
         "generation": r.u64(), "world_size": ws, "rank": r.below(ws), "created_unix_ns": r.u64()}
    for key in HEADER_FIELDS:
        if not r.chance(32):
            continue
        if key in ("version", "block_size", "flags", "world_size", "rank"):
            near = [f["world_size"], max(f["world_size"] - 1, 0)] if key == "rank" else [0, 1, 2, BLOCK]
            f[key] = r.pick(near) if r.chance(128) else r.u32()
        elif key == "num_slots":
            f[key] = r.pick([0, 1, 2, 255, 256, 2**31, 2**32 - 1]) if r.chance(128) else r.u32()
            if r.chance(128):  # keep slots_offset consistent so the later checks are reached
                f["slots_offset"] = (1 + f[key]) * BLOCK
        elif key == "slots_offset":
            so = (1 + f["num_slots"]) * BLOCK
            f[key] = r.pick([so - BLOCK, so + BLOCK, so - 1, so + 1, 0, U64]) if r.chance(128) else r.u64()
        elif key == "slot_capacity":
            n_, so = max(f["num_slots"], 1), f["slots_offset"]
            edge = (U64 - so) // n_  # the largest capacity whose geometry still fits in 64 bits
            f[key] = r.pick([edge // BLOCK * BLOCK, edge // BLOCK * BLOCK + BLOCK, max(edge // BLOCK * BLOCK - BLOCK, 0),
                             edge, 0, BLOCK - 1, BLOCK + 1, 2**63, 2**63 + BLOCK, U64 - 4095]
                            ) if r.chance(128) else r.u64()
        else:
            f[key] = r.u64()
    return f


@fuzz_settings("header_fields")
@given(st.binary(min_size=128, max_size=128))
def _fuzz_header_fields(seed: bytes) -> None:
    EXECUTED["header_fields"] += 1
    r = Reader(seed)
    f = header_fields_from(r)
    b = apply(pack_header(f, r.u64()), r.patches(136, BLOCK, 3))  # word and tail: outside the crc
    check_native_header(bytes(b) + bytes(r.u8() % 9), "header_fields")
    if r.chance(32):
        check_native_header(bytes(b[:BLOCK - 1]), "header_fields")  # one byte short: always rejected


def test_fuzz_parse_header_hostile_fields() -> None:
    # version, block size, slot count, capacity, slots offset, rank, 64-bit overflow, too short
    run_fuzzer("header_fields", _fuzz_header_fields, min_reasons=8, must_accept=True)


@pytest.mark.parametrize("bad", [
    {"num_slots": 0, "slots_offset": BLOCK},
    {"num_slots": 1, "slots_offset": 2 * BLOCK},
    {"num_slots": 256, "slots_offset": 257 * BLOCK},
    {"num_slots": 2**32 - 1, "slots_offset": 2**32 * BLOCK},
    {"slot_capacity": 0},
    {"slot_capacity": 4097},
    {"slot_capacity": 2**63},  # 3 slots of 2**63: past 2**64
    {"num_slots": 255, "slots_offset": 256 * BLOCK, "slot_capacity": (U64 - 256 * BLOCK) // 255 // BLOCK * BLOCK + BLOCK},
    {"slots_offset": 5 * BLOCK},
    {"slots_offset": 0},
    {"rank": 1},
    {"rank": 5, "world_size": 5},
    {"world_size": 0},
    {"block_size": 512},
    {"version": 0},
])
def test_parse_header_rejects_each_bad_field(bad: dict) -> None:
    b = bytes(pack_header({**VALID_HEADER, **bad}))
    with pytest.raises(ValueError):
        _native.parse_header(b)
    assert ref_parse_header(b) is None


def test_parse_header_accepts_the_largest_geometry() -> None:
    so = 256 * BLOCK
    cap = (U64 - so) // 255 // BLOCK * BLOCK
    h = _native.parse_header(bytes(pack_header({**VALID_HEADER, "num_slots": 255, "slots_offset": so,
                                                "slot_capacity": cap})))
    assert h["file_size"] == so + 255 * cap <= U64


# --------------------------------------------------------------------------------------------
# parse_meta
# --------------------------------------------------------------------------------------------

VALID_META = {"version": 1, "slot": 1, "counter": 9, "step": 90, "data_len": 8 * BLOCK,
              "manifest_offset": 8 * BLOCK, "manifest_len": 700, "manifest_crc": 0x12345678,
              "unix_ns": 1_700_000_000_000_000_000}


def meta_bytes_from(r: Reader) -> bytes:
    kind = r.u8() % 4
    if kind == 0:
        return r.b[r.i:r.i + r.u8() + r.u8()]
    if kind == 1:  # almost all zeros (must not be mistaken for "empty" unless it is)
        b = bytearray(BLOCK + r.pick([-1, 0, 0, 5]))
        apply(b, r.patches(0, len(b), 3))
        if r.chance(128) and len(b) >= 128:
            b[:8] = META_MAGIC
            if r.chance(128):
                refix_crc(b)
        return bytes(b)
    b = pack_meta(VALID_META)
    apply(b, r.patches(0, 128 if kind == 2 else BLOCK, 8))
    if r.chance(128):
        refix_crc(b)
    return bytes(b)


@fuzz_settings("meta_bytes")
@given(st.binary(min_size=0, max_size=160))
def _fuzz_meta_bytes(seed: bytes) -> None:
    EXECUTED["meta_bytes"] += 1
    r = Reader(seed)
    b = meta_bytes_from(r)
    slot = r.pick([0, 1, 2, 254, 255]) if r.chance(192) else r.take(4)
    cap = r.pick([0, 8 * BLOCK, 9 * BLOCK, 32 * BLOCK, U64]) if r.chance(128) else r.u64()
    check_native_meta(b, slot, cap, "meta_bytes")


def test_fuzz_parse_meta_arbitrary_bytes() -> None:
    run_fuzzer("meta_bytes", _fuzz_meta_bytes, min_reasons=5)
    if int(TOTAL_EXAMPLES * SHARES["meta_bytes"]) >= 2000:
        assert REASONS["meta_bytes"]["EMPTY"] > 0


def meta_case_from(r: Reader) -> tuple[dict, int, int]:
    """(fields, slot, slot_capacity): a plausible record with some fields made hostile."""
    cap = (1 + r.take(3) % 2**20) * BLOCK if not r.chance(64) else r.u64()
    slot = r.u8() % 255
    moff = r.take(3) % 2**20 * BLOCK
    f = {"version": 1, "slot": slot, "counter": 1 + r.take(7) % (2**56 - 1),
         "step": r.take(8) - 2**63, "data_len": r.take(8) % (moff + 1),
         "manifest_offset": moff, "manifest_len": r.take(3) % 2**20,
         "manifest_crc": r.u32(), "unix_ns": r.u64()}
    for key in META_FIELDS:
        if not r.chance(32):
            continue
        if key in ("version", "slot", "manifest_crc"):
            f[key] = r.pick([slot, slot + 1, 0, 1, 2]) if r.chance(128) else r.u32()
        elif key == "counter":
            f[key] = r.pick([0, 1, 2**56 - 1, 2**56, 2**63, U64]) if r.chance(128) else r.u64()
        elif key == "step":
            f[key] = r.pick([-(2**63), -1, 0, 2**63 - 1])
        elif key == "data_len":
            mo = f["manifest_offset"]
            f[key] = r.pick([mo, mo + 1, mo - 1 if mo else 0, U64]) if r.chance(128) else r.u64()
        elif key == "manifest_offset":
            near = [v for v in (cap, cap - BLOCK, cap + BLOCK, cap - 1, cap + 1, U64 - 4095) if 0 <= v <= U64]
            f[key] = r.pick(near) if r.chance(128) else r.u64()
        else:  # manifest_len, unix_ns
            rest = cap - f["manifest_offset"]
            near = [v % 2**64 for v in (rest, rest + 1, rest - 1, 2**64 - f["manifest_offset"], U64)]
            f[key] = r.pick(near) if key == "manifest_len" and r.chance(128) else r.u64()
    return f, slot, cap


@fuzz_settings("meta_fields")
@given(st.binary(min_size=128, max_size=128))
def _fuzz_meta_fields(seed: bytes) -> None:
    EXECUTED["meta_fields"] += 1
    r = Reader(seed)
    f, slot, cap = meta_case_from(r)
    b = bytes(apply(pack_meta(f), r.patches(128, BLOCK, 3)))  # bytes past the crc span carry nothing
    check_native_meta(b, slot, cap, "meta_fields")
    if r.chance(32):  # the same record read as another slot's is always rejected
        check_native_meta(b, (slot + 1) % 2**32, cap, "meta_fields")


def test_fuzz_parse_meta_hostile_fields() -> None:
    # version, slot, counter, alignment, data/manifest overlap, manifest past the slot
    run_fuzzer("meta_fields", _fuzz_meta_fields, min_reasons=6, must_accept=True)


@pytest.mark.parametrize("bad", [
    {"manifest_offset": 40 * BLOCK},                 # beyond the slot (capacity 32 blocks)
    {"manifest_offset": 32 * BLOCK, "manifest_len": 1},
    {"manifest_len": U64},                           # overflowing
    {"manifest_len": 2**64 - 8 * BLOCK},             # offset + len wraps to exactly 0
    {"manifest_len": 2**64 - 8 * BLOCK + 1},
    {"manifest_offset": 2**64 - BLOCK, "manifest_len": 2 * BLOCK},
    {"data_len": 8 * BLOCK + 1},                     # data overlaps the manifest
    {"data_len": U64},
    {"manifest_offset": 8 * BLOCK + 1},              # not block aligned
    {"counter": 0},
    {"counter": 2**56},
    {"counter": U64},
    {"slot": 2},                                     # sits in slot 1's block
    {"version": 2},
])
def test_parse_meta_rejects_each_bad_field(bad: dict) -> None:
    b = bytes(pack_meta({**VALID_META, **bad}))
    with pytest.raises(ValueError):
        _native.parse_meta(b, 1, 32 * BLOCK)
    assert ref_parse_meta(b, 1, 32 * BLOCK) is None


# --------------------------------------------------------------------------------------------
# parse_manifest
# --------------------------------------------------------------------------------------------

LIMIT = 1 << 20  # data_len_limit (the meta record's manifest_offset) used by the fuzzers


def check_manifest_result(raw: bytes, step: int, counter: int, limit: int):
    """Only CorruptCheckpointError; an accepted manifest satisfies what recovery relies on."""
    try:
        m = parse_manifest(raw, step=step, counter=counter, data_len_limit=limit)
    except CorruptCheckpointError as exc:
        assert str(exc)
        return None
    assert isinstance(m, Manifest)
    doc = json.loads(raw.decode("utf-8"))
    assert m.step == step == doc["step"] and m.counter == counter == doc["counter"]
    assert type(m.data_len) is int and 0 <= m.data_len <= limit
    assert isinstance(m.metadata, dict)
    assert len(m.arrays) == len(m.crcs) == len(doc["arrays"])
    assert len({e.name for e in m.arrays}) == len(m.arrays), "duplicate names accepted"
    end = 0
    for e, c, a in zip(m.arrays, m.crcs, doc["arrays"]):
        assert isinstance(e.name, str) and e.name == a["name"]
        assert isinstance(e.dtype, np.dtype) and not e.dtype.hasobject
        assert isinstance(e.shape, tuple) and len(e.shape) <= 64
        assert all(type(s) is int and s >= 0 for s in e.shape) and list(e.shape) == a["shape"]
        assert math.prod(e.shape) * e.dtype.itemsize == e.nbytes
        assert type(e.offset) is int and type(e.nbytes) is int
        assert end <= e.offset and e.offset + e.nbytes <= m.data_len, "overlap or out of the data region"
        end = e.offset + e.nbytes
        assert 0 <= c < 2**32 and f"{c:08x}" == a["crc32c"]
    return m


@fuzz_settings("manifest_bytes")
@given(st.one_of(st.binary(max_size=600),
                 st.binary(max_size=200).map(lambda b: b'{"format":1,"step":1,"counter":1,' + b)))
def _fuzz_manifest_bytes(raw: bytes) -> None:
    EXECUTED["manifest_bytes"] += 1
    check_manifest_result(raw, 1, 1, LIMIT)


def test_fuzz_parse_manifest_arbitrary_bytes() -> None:
    run_fuzzer("manifest_bytes", _fuzz_manifest_bytes)


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                         st.text(max_size=10))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda c: st.one_of(st.lists(c, max_size=4),
                                                             st.dictionaries(st.text(max_size=6), c, max_size=4)),
                           max_leaves=12)
MANIFEST_KEYS = ["format", "step", "counter", "data_len", "arrays", "metadata", "name", "dtype",
                 "shape", "offset", "nbytes", "crc32c"]


@fuzz_settings("manifest_json")
@given(st.recursive(JSON_SCALARS, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.sampled_from(MANIFEST_KEYS) | st.text(max_size=4), c, max_size=7)),
    max_leaves=25))
def _fuzz_manifest_json(doc) -> None:
    EXECUTED["manifest_json"] += 1
    check_manifest_result(json.dumps(doc).encode(), 1, 1, LIMIT)


def test_fuzz_parse_manifest_arbitrary_json() -> None:
    run_fuzzer("manifest_json", _fuzz_manifest_json)


GOOD_DESCRS = ["<f4", "<f8", ">f8", "<i8", "|u1", "|b1", "<c8", "<f2", "<U3", "|S5", "|V7", "<M8[s]",
               "<m8[ns]", [["a", "<i4"], ["b", "<f8"]], [["x", "<f8", [2, 3]], ["n", [["y", "|u1"]]]]]
HOSTILE_DESCRS = ["O", "|O", "<O", [["x", "|O"]], [["a", [["b", "O"]]]], "|V0", [], "<U0", "|S0",
                  "V9999999999999", "<f3", "f4f4", "", "<i" + "9" * 30, [["a", "<f8", [2**40, 2**40]]],
                  [["a", "<f8", [-1]]], [["a"]], [["a", "<f4"], ["a", "<f4"]], [[1, "<f4"]],
                  [["a", "<f4", "x"]], [["", "<f4"]], [[["a", "b"], "<f4"]], ["<f4"], [[]], [[[]]],
                  1, None, True, 1.5, {"descr": "<f4"}, "<M8[zz]", "<f4" * 2000, [["a", "<f4", 3, 4]]]
HOSTILE_INTS = [-1, -(2**63), -(2**64), 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**200, 10**300]


def json_descr_to_dtype(descr) -> np.dtype:
    """The dtype a JSON-decoded descr stands for (fields are lists in JSON, tuples in numpy)."""
    def conv(x):
        if isinstance(x, list):
            return [tuple(conv(i) if isinstance(i, list) and i and isinstance(i[0], list) else
                          (tuple(i) if isinstance(i, list) else i) for i in f) if isinstance(f, list) else f
                    for f in x]
        return x
    return np.lib.format.descr_to_dtype(conv(descr))


def hostile_int(sane: int) -> st.SearchStrategy:
    return st.one_of(st.just(sane), st.sampled_from(HOSTILE_INTS), st.integers(-(2**70), 2**70),
                     st.sampled_from([sane + 1, sane - 1, sane + 64, sane * 2, float(sane), str(sane), True, None]))


@st.composite
def hostile_manifest(draw) -> tuple[bytes, int, int, int]:
    """A structurally valid manifest (a consistent layout) with hostile values swapped in."""
    limit = draw(st.sampled_from([0, BLOCK, 16 * BLOCK, LIMIT]))
    step = draw(st.integers(-(2**63), 2**63 - 1))
    counter = draw(st.integers(1, 2**56 - 1))
    arrays, off = [], 0
    for i in range(draw(st.integers(0, 4))):
        descr = draw(st.sampled_from(GOOD_DESCRS))
        dt = json_descr_to_dtype(descr)
        shape = draw(st.lists(st.integers(0, 6), max_size=3))
        nbytes = math.prod(shape) * dt.itemsize
        off = (off + 63) // 64 * 64
        arrays.append({"name": draw(st.sampled_from(["a", "b", "c", "é", ""])) if draw(st.booleans()) else f"t{i}",
                       "dtype": descr, "shape": shape, "offset": off, "nbytes": nbytes,
                       "crc32c": f"{draw(st.integers(0, 2**32 - 1)):08x}"})
        off += nbytes
    data_len = min((off + BLOCK - 1) // BLOCK * BLOCK, limit) if draw(st.booleans()) else off
    doc = {"format": 1, "step": step, "counter": counter, "data_len": data_len, "arrays": arrays,
           "metadata": draw(st.dictionaries(st.text(max_size=5), JSON_SCALARS, max_size=3))}
    for _ in range(draw(st.integers(0, 3))):  # hostile edits
        target = draw(st.sampled_from(["doc", "array"] if arrays else ["doc"]))
        if target == "doc":
            key = draw(st.sampled_from(["format", "step", "counter", "data_len", "arrays", "metadata"]))
            doc[key] = draw(st.one_of(hostile_int(doc[key] if type(doc[key]) is int else 0), JSON_VALUES))
            continue
        a = draw(st.sampled_from(arrays))
        key = draw(st.sampled_from(["name", "dtype", "shape", "offset", "nbytes", "crc32c", "extra", "del"]))
        if key == "dtype":
            a["dtype"] = draw(st.one_of(st.sampled_from(HOSTILE_DESCRS + GOOD_DESCRS), JSON_VALUES))
        elif key == "shape":
            a["shape"] = draw(st.one_of(
                st.lists(st.one_of(st.integers(0, 8), st.sampled_from(HOSTILE_INTS + [0, 1.0, "2", None, True])),
                         max_size=6),
                st.lists(st.integers(0, 2), min_size=60, max_size=70),  # around the ndim limit
                st.lists(st.sampled_from([2**40, 2**62, 2**63 - 1, 2**63, 0]), min_size=1, max_size=4),
                JSON_VALUES))
            if draw(st.booleans()):  # keep nbytes consistent so the range checks are reached
                try:
                    a["nbytes"] = math.prod(a["shape"]) * json_descr_to_dtype(a["dtype"]).itemsize
                except Exception:
                    pass
        elif key in ("offset", "nbytes"):
            sane = a.get(key)
            a[key] = draw(hostile_int(sane if type(sane) is int else 0))
        elif key == "name":
            a["name"] = draw(st.one_of(st.sampled_from([arrays[0].get("name", "a"), "", None, 1, ["a"]]), st.text(max_size=5)))
        elif key == "crc32c":
            a["crc32c"] = draw(st.one_of(
                st.sampled_from(["DEADBEEF", "0000000", "000000000", "0x123456", "0000000g", "-0000001",
                                 " 1234567", "1234567\n", "１２３４５６７８", "٠١٢٣٤٥٦٧", 0, None, ["00000000"]]),
                st.text(min_size=8, max_size=8)))
        elif key == "extra":
            a[draw(st.text(max_size=4))] = draw(JSON_VALUES)
        else:
            a.pop(draw(st.sampled_from(["name", "dtype", "shape", "offset", "nbytes", "crc32c"])), None)
    raw = json.dumps(doc).encode() if draw(st.booleans()) else json.dumps(doc, ensure_ascii=False).encode()
    return raw, step, counter, limit


MANIFEST_ACCEPTED: Counter[str] = Counter()


@fuzz_settings("manifest_hostile")
@given(hostile_manifest())
def _fuzz_manifest_hostile(case) -> None:
    EXECUTED["manifest_hostile"] += 1
    raw, step, counter, limit = case
    m = check_manifest_result(raw, step, counter, limit)
    MANIFEST_ACCEPTED["accepted" if m is not None else "rejected"] += 1


def test_fuzz_parse_manifest_hostile_fields() -> None:
    run_fuzzer("manifest_hostile", _fuzz_manifest_hostile)
    # Both paths must be exercised, or the invariants above were never checked.
    assert MANIFEST_ACCEPTED["accepted"] > 0 and MANIFEST_ACCEPTED["rejected"] > 0, MANIFEST_ACCEPTED


def _manifest(arrays: list[dict], data_len: int = 2 * BLOCK, step: int = 1, counter: int = 1) -> bytes:
    return json.dumps({"format": 1, "step": step, "counter": counter, "data_len": data_len,
                       "arrays": arrays, "metadata": {}}, separators=(",", ":")).encode()


def _arr(name="a", dtype="<f8", shape=(4,), offset=0, nbytes=None, crc="00000000") -> dict:
    if nbytes is None:
        nbytes = math.prod(shape) * 8
    return {"name": name, "dtype": dtype, "shape": list(shape), "offset": offset, "nbytes": nbytes,
            "crc32c": crc}


@pytest.mark.parametrize("raw", [
    _manifest([_arr(nbytes=-1)]),
    _manifest([_arr(offset=-64)]),
    _manifest([_arr(shape=(-4,), nbytes=-32)]),
    _manifest([_arr(shape=(2**61 + 1,), nbytes=2**64 + 8)]),        # overflows 64 bits
    _manifest([_arr(shape=(2**32, 2**32), nbytes=2**67)]),
    _manifest([_arr(offset=2 * BLOCK)]),                              # beyond data_len
    _manifest([_arr(offset=2 * BLOCK - 16)]),                         # straddles data_len
    _manifest([_arr()], data_len=3 * BLOCK),                          # data_len beyond the limit
    _manifest([_arr()], data_len=-1),
    _manifest([_arr(), _arr("b", offset=16)]),                        # overlapping
    _manifest([_arr(), _arr("b", offset=0)]),
    _manifest([_arr(), _arr("a", offset=64)]),                        # duplicate names
    _manifest([_arr(dtype="O", nbytes=32)]),
    _manifest([_arr(dtype=[["x", "|O"]], nbytes=32)]),
    _manifest([_arr(dtype=[["a", [["b", [["c", "O"]]]]]], nbytes=32)]),
    _manifest([_arr(dtype=[[[[["deep"]]]]])]),
    _manifest([_arr(dtype="<f8" * 30000)]),
    _manifest([_arr(dtype="[" * 900 + "]" * 900)]),
    json.dumps({"format": 1, "step": 1, "counter": 1, "data_len": 0, "metadata": {},
                "arrays": [_arr(dtype=json.loads("[" * 900 + "]" * 900))]}).encode(),
    b"[" * 100_000 + b"]" * 100_000,                                     # deeper than recursion limit
    b'{"format":1,"step":1,"counter":1,"data_len":1' + b"9" * 5000 + b',"arrays":[],"metadata":{}}',
    _manifest([_arr(crc="DEADBEEF")]),
    _manifest([_arr(crc="deadbee")]),
    _manifest([_arr(crc="0x00dead")]),
    _manifest([_arr(crc="１２３４５６７８")]),
    _manifest([_arr(shape=[True, 4], nbytes=32)]),
    _manifest([_arr(shape=[4.0], nbytes=32)]),
    _manifest([_arr(shape=[1] * 65, nbytes=8)]),
    _manifest([_arr(offset=True)]),
    _manifest([], step=2),
    _manifest([], counter=2),
    b'{"format":1,"step":1,"counter":1,"data_len":0,"arrays":[],"metadata":{},"step":2}',
    b'\xef\xbb\xbf' + _manifest([]),
    _manifest([]).replace(b'"format":1', b'"format":NaN'),
    _manifest([]).replace(b'"step":1', b'"step":Infinity'),
    _manifest([]).replace(b'"step":1', b'"step":1.0'),
], ids=lambda raw: f"{len(raw)}B:" + raw[:40].decode("utf-8", "replace").replace('"', ""))
def test_parse_manifest_rejects(raw: bytes) -> None:
    assert raw.count(b"NaN") + raw.count(b"Infinity") + raw.count(b"1.0") <= 1
    with pytest.raises(CorruptCheckpointError):
        parse_manifest(raw, step=1, counter=1, data_len_limit=2 * BLOCK)


def test_parse_manifest_accepts_a_valid_one() -> None:
    m = parse_manifest(_manifest([_arr(), _arr("b", dtype="|u1", shape=(3, 5), offset=64, nbytes=15)]),
                       step=1, counter=1, data_len_limit=2 * BLOCK)
    assert [e.name for e in m.arrays] == ["a", "b"] and m.arrays[1].shape == (3, 5)


ZERO_SIZE_HOSTILE = [  # nbytes 0, so the size checks pass, yet numpy cannot build the array
    pytest.param("<f8", [2**63, 0], id="dim-2**63-times-0"),
    pytest.param("<f8", [0, 2**64], id="0-times-dim-2**64"),
    pytest.param("<f8", [2**62, 2**62, 0], id="dims-overflow-times-0"),
    pytest.param("|V0", [2**63], id="V0-dim-2**63"),
    pytest.param([], [2**70], id="empty-struct-dim-2**70"),
]


@pytest.mark.parametrize("descr,shape", ZERO_SIZE_HOSTILE)
def test_parse_manifest_only_accepts_representable_shapes(descr, shape) -> None:
    raw = _manifest([_arr(dtype=descr, shape=shape, nbytes=0)], data_len=0)
    try:
        m = parse_manifest(raw, step=1, counter=1, data_len_limit=0)
    except CorruptCheckpointError:
        return
    e = m.arrays[0]
    try:
        np.empty(e.shape, dtype=e.dtype)
    except (ValueError, OverflowError, MemoryError) as exc:
        raise AssertionError(f"accepted shape {e.shape} of {e.dtype} that numpy rejects: {exc}") from None


# --------------------------------------------------------------------------------------------
# crafted store files
# --------------------------------------------------------------------------------------------

CAP = 8 * BLOCK  # slot capacity of the crafted stores: data up to 7 blocks, manifest in the 8th


def older_arrays() -> dict[str, np.ndarray]:
    return {"a": np.arange(100, dtype="<f8"), "b": np.arange(10, dtype="<i4") * -3}


def hostile_arrays() -> dict[str, np.ndarray]:
    return {"a": np.arange(100, dtype="<f8") * 2, "b": np.arange(10, dtype="<i4")}


def slot_image(arrays: dict[str, np.ndarray], step: int, counter: int, slot: int, *, doc_edit=None,
               meta_edit: dict | None = None, cap: int = CAP) -> tuple[bytes, bytes]:
    """(meta block, slot bytes) of one checkpoint, written from scratch by these helpers."""
    data = bytearray()
    entries = []
    for name, arr in arrays.items():
        data += bytes((-len(data)) % 64)
        raw = np.ascontiguousarray(arr).tobytes()
        entries.append({"name": name, "dtype": np.lib.format.dtype_to_descr(arr.dtype),
                        "shape": list(arr.shape), "offset": len(data), "nbytes": len(raw),
                        "crc32c": f"{crc(raw):08x}"})
        data += raw
    data_len = (len(data) + BLOCK - 1) // BLOCK * BLOCK
    doc = {"format": 1, "step": step, "counter": counter, "data_len": data_len, "arrays": entries,
           "metadata": {"crafted": True}}
    if doc_edit:
        doc_edit(doc)
    manifest = json.dumps(doc).encode()
    meta = {"version": 1, "slot": slot, "counter": counter, "step": step, "data_len": data_len,
            "manifest_offset": data_len, "manifest_len": len(manifest), "manifest_crc": crc(manifest),
            "unix_ns": 1}
    meta.update(meta_edit or {})
    body = bytearray(min(cap, data_len + BLOCK))  # the rest of the slot is sparse zeros
    body[:len(data)] = data
    body[data_len:data_len + len(manifest)] = manifest
    return bytes(pack_meta(meta)), bytes(body)


def write_crafted_store(path: Path, slots: dict[int, tuple[bytes, bytes]], word: int, *,
                        num_slots: int = 3, cap: int = CAP, header_edit: dict | None = None,
                        file_size: int | None = None) -> None:
    hdr = {**VALID_HEADER, "num_slots": num_slots, "slots_offset": (1 + num_slots) * BLOCK,
           "slot_capacity": cap, **(header_edit or {})}
    so = (1 + num_slots) * BLOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(file_size if file_size is not None else so + num_slots * cap)  # sparse
        f.write(pack_header(hdr, word))
        for s, (meta, body) in slots.items():
            f.seek((1 + s) * BLOCK)
            f.write(meta)
            f.seek(so + s * cap)
            f.write(body)


def set_array(i: int, **kv):
    def edit(doc):
        doc["arrays"][i].update(kv)
    return edit


def set_doc(**kv):
    def edit(doc):
        doc.update(kv)
    return edit


# name -> (doc_edit, meta_edit, store-level kwargs)
HOSTILE_SLOTS = {
    "offset-beyond-data_len": (set_array(1, offset=CAP), None),
    "offset-beyond-file-end": (set_array(1, offset=2**40), None),
    "offset-negative": (set_array(0, offset=-64), None),
    "nbytes-negative": (set_array(0, nbytes=-1), None),
    "nbytes-overflowing": (set_array(0, shape=[2**61 + 1], nbytes=2**64 + 8), None),
    "shape-product-huge": (set_array(0, shape=[2**40, 2**40], nbytes=2**83), None),
    "nbytes-past-data_len": (set_array(1, nbytes=CAP, shape=[CAP // 4]), None),
    "data_len-past-manifest": (set_doc(data_len=2 * CAP), None),
    "data_len-negative": (set_doc(data_len=-BLOCK), None),
    "data_len-2**64": (set_doc(data_len=2**64), None),
    "arrays-overlap": (set_array(1, offset=8), None),
    "object-dtype": (set_array(0, dtype="|O"), None),
    "step-disagrees-with-meta": (set_doc(step=-5), None),
    "meta-manifest_offset-beyond-slot": (None, {"manifest_offset": CAP + BLOCK}),
    "meta-manifest_len-overflowing": (None, {"manifest_len": U64}),
    "meta-manifest-end-wraps": (None, {"manifest_len": 2**64 - BLOCK}),
    "meta-data_len-over-manifest": (None, {"data_len": 2 * BLOCK}),
    "meta-counter-zero": (None, {"counter": 0}),
    "meta-slot-mismatch": (None, {"slot": 0}),
    "meta-manifest_crc-wrong": (None, {"manifest_crc": 0}),
    "meta-manifest_len-short": (None, {"manifest_len": 10}),
    # The size checks all pass (nbytes 0), but numpy cannot represent the shape: see the report.
    "zero-bytes-dim-2**63": (set_array(0, shape=[2**63, 0], nbytes=0), None),
    "zero-itemsize-dim-2**63": (set_array(0, dtype="|V0", shape=[2**63], nbytes=0), None),
}


def build_crafted(root: Path) -> dict[str, tuple[Path, str]]:
    """Every crafted store: name -> (directory, expected outcome "none" | "older")."""
    cases = {}
    older = slot_image(older_arrays(), 10, 1, 0)
    for name, (doc_edit, meta_edit) in HOSTILE_SLOTS.items():
        for variant in ("alone", "with-older"):
            d = root / f"{name}.{variant}"
            bad = slot_image(hostile_arrays(), 20, 2, 1, doc_edit=doc_edit, meta_edit=meta_edit)
            slots = {1: bad, **({0: older} if variant == "with-older" else {})}
            write_crafted_store(d / "store-000001.pcc", slots, _native.make_word(2, 1))
            cases[f"{name}.{variant}"] = (d, "older" if variant == "with-older" else "none")
    # The untouched pair: proves the crafting helpers write stores pccheck accepts.
    d = root / "control"
    write_crafted_store(d / "store-000001.pcc", {0: older, 1: slot_image(hostile_arrays(), 20, 2, 1)},
                        _native.make_word(2, 1))
    cases["control"] = (d, "newest")
    # Header geometry lies about the file (crc recomputed).
    for name, edit in {"header-capacity-beyond-file": {"slot_capacity": 2**40},
                       "header-255-slots-small-file": {"num_slots": 255, "slots_offset": 256 * BLOCK},
                       "header-geometry-overflows": {"slot_capacity": 2**63}}.items():
        d = root / name
        write_crafted_store(d / "store-000001.pcc", {0: older}, _native.make_word(1, 0), header_edit=edit)
        cases[name] = (d, "none")
    # A manifest of 900 MiB inside a (sparse) 1 GiB slot: it fits the geometry, so only the
    # reader's own cap keeps recovery from reading it into memory.
    gib = 1 << 30
    d = root / "manifest-900MiB-in-sparse-slot"
    big = slot_image(hostile_arrays(), 20, 2, 1, cap=gib, meta_edit={"manifest_len": 900 << 20})
    write_crafted_store(d / "store-000001.pcc", {1: big}, _native.make_word(2, 1), cap=gib)
    cases["manifest-900MiB-in-sparse-slot"] = (d, "none")
    return cases


RUNNER = textwrap.dedent("""
    import json, resource, sys, time
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import pccheck
    out = {}
    for name, d in json.loads(sys.argv[2]).items():
        t0 = time.perf_counter()
        try:
            r = pccheck.load_latest(d)
            res = {"kind": "ok", "step": r.step,
                   "state": {k: [str(v.dtype), list(v.shape), v.tobytes().hex()] for k, v in r.state.items()}}
        except pccheck.PCCheckError as exc:
            res = {"kind": "pccheck", "type": type(exc).__name__, "msg": str(exc)[:300]}
        except BaseException as exc:
            res = {"kind": "other", "type": type(exc).__name__, "msg": str(exc)[:300]}
        res["secs"] = time.perf_counter() - t0
        out[name] = res
    # VmHWM, not ru_maxrss: the latter inherits the parent's peak across fork/exec.
    out["__maxrss_kib__"] = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")))
    print(json.dumps(out))
""")
AS_LIMIT = 1 << 30  # address space for the whole interpreter: far below the sizes the files claim


@pytest.fixture(scope="module")
def crafted_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("crafted")
    cases = build_crafted(root)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(AS_LIMIT),
                           json.dumps({k: str(d) for k, (d, _) in cases.items()})],
                          capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert proc.returncode == 0, f"runner died ({proc.returncode}): {proc.stderr[-3000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return cases, results


def _expected_state(arrays: dict[str, np.ndarray]) -> dict:
    return {k: [str(v.dtype), list(v.shape), v.tobytes().hex()] for k, v in arrays.items()}


CRAFTED_IDS = ([f"{n}.{v}" for n in HOSTILE_SLOTS for v in ("alone", "with-older")] + ["control"]
               + ["header-capacity-beyond-file", "header-255-slots-small-file", "header-geometry-overflows",
                  "manifest-900MiB-in-sparse-slot"])


@pytest.mark.parametrize("case", CRAFTED_IDS)
def test_crafted_store_is_rejected(crafted_results, case: str) -> None:
    cases, results = crafted_results
    _, want = cases[case]
    got = results[case]
    assert got["kind"] != "other", f"{got['type']} escaped load_latest: {got['msg']}"
    assert got["secs"] < 5, f"took {got['secs']:.1f}s"
    if want == "none":
        assert got["kind"] == "pccheck" and got["type"] == "NoCheckpointError", got
    elif want == "older":
        assert got["kind"] == "ok" and got["step"] == 10, got
        assert got["state"] == _expected_state(older_arrays())
    else:
        assert got["kind"] == "ok" and got["step"] == 20, got
        assert got["state"] == _expected_state(hostile_arrays())


def test_crafted_stores_stay_in_memory_bounds(crafted_results) -> None:
    """The whole run fit under RLIMIT_AS (1 GiB) and its peak RSS stayed small."""
    _, results = crafted_results
    assert results["__maxrss_kib__"] < 400 * 1024, results["__maxrss_kib__"]


def test_zero_size_hostile_shape_repro(tmp_path: Path) -> None:
    """Regression: a zero-byte array with a shape numpy cannot represent made load_latest raise a
    bare ValueError instead of falling back to the older valid slot."""
    write_crafted_store(tmp_path / "store-000001.pcc",
                        {0: slot_image(older_arrays(), 10, 1, 0),
                         1: slot_image(hostile_arrays(), 20, 2, 1,
                                       doc_edit=set_array(0, shape=[2**63, 0], nbytes=0))},
                        _native.make_word(2, 1))
    r = pccheck.load_latest(tmp_path)
    assert r.step == 10


# --------------------------------------------------------------------------------------------
# volume
# --------------------------------------------------------------------------------------------


def test_zz_fuzz_volume(capsys) -> None:
    """Reports how many inputs the fuzzers ran; with all of them run, at least the target."""
    total = sum(EXECUTED.values())
    with capsys.disabled():
        secs = sum(ELAPSED.values())
        print(f"\n[hostile] {total} fuzz inputs in {secs:.1f}s: "
              + ", ".join(f"{k}={EXECUTED[k]} ({ELAPSED.get(k, 0):.1f}s)" for k in SHARES)
              + f"; manifests {dict(MANIFEST_ACCEPTED)}")
        for k, v in sorted(REASONS.items()):
            print(f"[hostile] {k}: {dict(v.most_common())}")
    if set(EXECUTED) != set(SHARES):
        pytest.skip("not every fuzzer ran in this session")
    assert total >= 0.95 * TOTAL_EXAMPLES
