"""A store directory opened for writing: its lock, its generations and the native slot store.

Directory layout (FORMAT.md §1)::

    PATH/LOCK                 flock()ed by the one writer; holds its pid
    PATH/store-000001.pcc     a store generation: header, N+1 meta records, N+1 slots
    PATH/store-000002.pcc     a newer generation, made when the state outgrew the old slots

Reopening continues the newest generation's counter and never truncates it. A generation that
no longer fits gets a successor beside it; the old one stays loadable until the successor has a
committed checkpoint, and only then is deleted.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from pathlib import Path

from .. import shutdown
from ..errors import (CorruptCheckpointError, PathNotWritableError, StorageError, StoreLockedError,
                      storage_error_from_oserror)
from ..native import _native
from .recovery import (StoreImage, candidate_order, first_valid, load_slot, read_manifest, read_store,
                       store_files, was_validated)
from .files import LOCK, fsync_dir, store_name

__all__ = ["SlotStore", "STORAGE_CHOICES", "DEFAULT_SSD_MODE"]

log = logging.getLogger("pccheck")

BLOCK: int = _native.BLOCK
STORAGE_CHOICES = ("auto", "ssd", "odirect", "mmap", "pmem")
# Chosen by `python -m bench.persist` on these machines (bench/results/persist/latest.json, rows
# "pccheck" vs "pccheck_mmap": 3.2 vs 0.8 GB/s at 1 GiB):
# O_DIRECT pwrite of aligned chunks beats memcpy into a mapping + msync.
DEFAULT_SSD_MODE = "odirect"


class SlotStore:
    """The writer's side of a store directory. Not thread-safe except through ``native``; owned
    by the orchestrator, which decides when older generations are retired."""

    def __init__(self, path: Path, storage: str = "auto", world_size: int = 1, rank: int = 0, *,
                 hold_replaced: bool = False, populate: bool = False, validate_latest: bool = False) -> None:
        self.path = path
        # validate_latest: every byte of the continued-from checkpoint is checked at open, on the
        # caller's thread (an incremental store: later checkpoints reference its cells)
        self.validate_latest = validate_latest
        # populate: fault every page of each generation's mapping in on a thread of its own when it
        # opens, in mmap mode (a store on tmpfs: the memory tier), so no checkpoint pays the first
        # touch of its slot (native Store.populate says why)
        self.populate = populate
        self.storage = storage
        self.world_size = world_size
        self.rank = rank
        self.native: _native.Store | None = None
        self.file: Path | None = None  # the generation file open for writing
        self.generation = 0
        self._lock_fd = -1
        self._next_counter = 1
        # Set when a new generation was created beside older ones: they are deleted after the
        # new generation's first durable commit (retire_older_generations), not before.
        self.retire_pending = False
        # Distributed mode (pccheck.group.distributed): replaced slots are held for the coordinator,
        # not freed.
        self.hold_replaced = hold_replaced
        # Background validation of the slot a reopened store continues from (see _recover).
        self._guard_lock = threading.Lock()
        self._guarded: list[int] = []  # fallback slots kept from reuse, of generation _guarded_gen
        self._guarded_gen = 0
        self._verifier: threading.Thread | None = None
        # Whether every byte of the checkpoint the open generation continues from was checked
        # before the open returned (at the open, or earlier by this process's load); False while
        # the background validation (_verify) is the only check, with ``fallback`` kept from reuse.
        self.latest_checked = True
        self.fallback: tuple[int, ...] = ()
        try:
            path.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise PathNotWritableError(
                f"cannot create or write the checkpoint directory {path} ({exc.strerror or exc}); "
                "pass a writable path= or set PCCHECK_DIR") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise StoreLockedError(
                f"{path} is being written by another Checkpointer (pid {holder}); close it first, "
                "or give this one a different path") from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
        for stale in path.glob("store-*.pcc.tmp"):  # a crash during creation; never committed
            stale.unlink(missing_ok=True)

    # -- opening -------------------------------------------------------------------------------

    @property
    def header(self) -> dict:
        assert self.native is not None
        return self.native.header

    def fits(self, num_slots: int, slot_bytes: int) -> bool:
        """Whether the open generation has at least ``num_slots`` slots of ``slot_bytes``."""
        if self.native is None:
            return False
        h = self.native.header
        return h["num_slots"] >= num_slots and h["slot_capacity"] >= slot_bytes

    def open(self, num_slots: int, slot_bytes: int, protect: list[int] | tuple[int, ...] = ()) -> None:
        """Opens the newest generation if it fits, else creates a new one. ``protect``: slots of
        the newest generation that must not be reused (they hold a group's global checkpoint);
        ignored when a new generation is made."""
        files = store_files(self.path)
        if files:
            gen, file = files[0]
            self.generation = gen
            try:
                image = read_store(file)
                self._next_counter = max(self._next_counter, self._max_counter(image) + 1)
                h = image.header
                if (h["world_size"], h["rank"]) != (self.world_size, self.rank):
                    # Written by a job of another size (a resharded restart): a new generation for
                    # this job; the old one is retired like any older generation.
                    log.info("pccheck: %s belongs to rank %d of %d, this writer is rank %d of %d: new generation",
                             file, h["rank"], h["world_size"], self.rank, self.world_size)
                elif h["num_slots"] >= num_slots and h["slot_capacity"] >= slot_bytes:
                    self._attach(file, image, protect)
                    return
                else:
                    log.info("pccheck: %s has %d slots of %d bytes; need %d of %d: new generation",
                             file, h["num_slots"], h["slot_capacity"], num_slots, slot_bytes)
            except CorruptCheckpointError as exc:
                log.warning("pccheck: cannot reuse %s (%s); starting a new generation beside it", file, exc)
        self.new_generation(num_slots, slot_bytes)

    def new_generation(self, num_slots: int, slot_bytes: int) -> None:
        """Creates generation+1 (durably: create, fallocate, fsync, rename, fsync dir) and opens it."""
        if self.native is not None:
            self._next_counter = max(self._next_counter, _native.word_counter(self.native.check_word) + 1)
            self._close_native()
        gen = self.generation + 1
        final = self.path / store_name(gen)
        tmp = final.with_name(final.name + ".tmp")
        capacity = (slot_bytes + BLOCK - 1) // BLOCK * BLOCK
        try:
            _native.create_store(str(tmp), num_slots, capacity, gen, self.world_size, self.rank)
            os.rename(tmp, final)
            fsync_dir(self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise storage_error_from_oserror(
                exc, f"creating {final} ({num_slots} slots x {capacity} bytes)") from None
        self.generation = gen
        self.retire_pending = gen > 1
        self._attach(final, read_store(final), ())

    def _attach(self, file: Path, image: StoreImage, protect: list[int] | tuple[int, ...]) -> None:
        self.native = self._open_native(file)
        self.file = file
        word, fallback = self._recover(image)
        self.fallback = fallback
        try:
            self.native.init(word, self._next_counter, sorted(set(protect) | set(fallback)))
            self.native.set_hold_replaced(self.hold_replaced)
        except OSError as exc:
            raise storage_error_from_oserror(exc, f"opening {file}") from None
        if self.populate and self.native.mode == "mmap":
            shutdown.thread(_populate, "pccheck-populate", (self.native, file))
        if fallback:
            with self._guard_lock:
                self._guarded, self._guarded_gen = list(fallback), self.generation
            self._verifier = shutdown.thread(self._verify, "pccheck-verify", (image, _native.word_slot(word)))
        log.info("pccheck: writing to %s (mode %s, %d slots of %d bytes, next counter %d)", file,
                 self.native.mode, image.header["num_slots"], image.header["slot_capacity"],
                 self._next_counter)

    def _open_native(self, file: Path) -> "_native.Store":
        want = self.storage
        if want in ("auto", "pmem"):
            st = _native.Store(str(file), "pmem")
            if st.is_pmem:
                return st
            st.close()
            if want == "pmem":
                raise StorageError(errno.EINVAL, f"{file} is not on persistent memory (libpmem says so); "
                                   "use storage='ssd', or PMEM_IS_PMEM_FORCE=1 on a DAX/tmpfs file for tests")
        mode = DEFAULT_SSD_MODE if want in ("auto", "ssd") else want
        try:
            return _native.Store(str(file), mode)
        except OSError as exc:
            if exc.errno == errno.EINVAL and mode == "odirect" and want != "odirect":
                log.info("pccheck: %s does not support O_DIRECT (e.g. tmpfs); using mmap + msync", file)
                return _native.Store(str(file), "mmap")
            raise storage_error_from_oserror(exc, f"opening {file}") from None

    @staticmethod
    def _max_counter(image: StoreImage) -> int:
        counters = [st.meta["counter"] for st in image.slots if st.meta]
        return max(counters + [_native.word_counter(image.check_word)])

    def _recover(self, image: StoreImage) -> tuple[int, tuple[int, ...]]:
        """The CHECK_ADDR to continue from, and the fallback slots to keep from reuse while it is
        validated in the background.

        The word is the newest slot whose meta record and manifest check out (recovery's one
        rule, CHECK_ADDR's slot first; a word that differs is repaired). Its array data is not
        read here, on the caller's thread: if this process validated it already (load_latest),
        nothing is left to do; else :meth:`_verify` reads it in the background.

        Invariant: while the continued-from slot is unverified, the slot recovery would fall
        back to if it were damaged (the next one in candidate order) is never reused: it is
        protected in the native store until the data checks out or a newer checkpoint commits
        (:meth:`after_commit`), whichever comes first. The continued-from slot itself is the
        latest and is not reused before a newer checkpoint commits. So the guarded fallback
        leaves one slot fewer to write into; with two slots only (max_concurrent=1) none would be
        left, and in a group (hold_replaced) the coordinator owns the held list: then the data is
        validated here, synchronously, and a damaged latest is skipped by repairing the word. The
        data is also validated here when the word must be repaired (it does not name the slot
        chosen), since the repaired word is a commit barrier.
        """
        self.latest_checked = True  # until a checkpoint is found that is left to _verify
        with open(image.path, "rb", buffering=0) as f:
            full = self.hold_replaced or image.header["num_slots"] <= 2 or self.validate_latest
            found = first_valid(image, lambda slot: (load_slot(image, slot, fd=f.fileno()) if full
                                                     else read_manifest(image, slot, f.fileno())))
            if found is None:
                return 0, ()
            slot, man, problems = found
            word = _native.make_word(man.counter, slot)
            if not full and word != image.check_word and not was_validated(image, slot):
                # Invariant: a word written here is a commit barrier (it may reach the disk at
                # once), so it only ever names a slot whose every byte checked out. The word on
                # disk does not name this one (a crash before its commit's word was durable, or a
                # stale word): validate now, falling back as recovery would. Rare: a clean reopen
                # continues from the slot the word already names, validated in the background.
                found = first_valid(image, lambda s: load_slot(image, s, fd=f.fileno()))
                if found is None:
                    return 0, ()
                slot, man, problems = found
                word = _native.make_word(man.counter, slot)
                full = True
            if image.check_word and word != image.check_word:
                log.warning("pccheck: %s: CHECK_ADDR repaired to slot %d (step %d): %s", image.path, slot,
                            man.step, "; ".join(problems))
            if full or was_validated(image, slot):
                return word, ()
            self.latest_checked = False
            return word, self._fallback(image, slot, man.counter, f.fileno())

    @staticmethod
    def _fallback(image: StoreImage, latest: int, counter: int, fd: int) -> tuple[int, ...]:
        """The slot recovery falls back to if ``latest`` is damaged: the newest older one whose
        meta record and manifest check out. (A slot with a higher counter is a commit that never
        completed: its data is not trusted, and recovery passes it by when its crcs fail.)"""
        for s in candidate_order(image):
            if s == latest or image.slots[s].meta["counter"] > counter:
                continue
            try:
                read_manifest(image, s, fd)
                return (s,)
            except CorruptCheckpointError:
                continue
        return ()

    def _verify(self, image: StoreImage, slot: int) -> None:
        """Background: validates every byte of the slot the store continued from; releases the
        protected fallback if it checks out, else keeps it until a newer checkpoint commits."""
        try:
            with open(image.path, "rb", buffering=0) as f:
                load_slot(image, slot, fd=f.fileno())
        except Exception as exc:  # noqa: BLE001 - whatever it is, the fallback stays protected
            with self._guard_lock:
                guarded = list(self._guarded)
            if guarded:  # else a newer checkpoint committed first: the slot may be rewritten by now
                log.warning("pccheck: the latest checkpoint in %s (slot %d) is damaged or unreadable (%s); "
                            "slot(s) %s are kept from reuse until a new checkpoint commits", image.path, slot,
                            exc, guarded)
            return
        self._release_guarded(image.generation)

    def _release_guarded(self, generation: int) -> None:
        with self._guard_lock:
            guarded, self._guarded = self._guarded, []
            if self.native is not None and self.generation == generation == self._guarded_gen:
                for s in guarded:
                    self.native.release_slot(s)

    @property
    def verifying(self) -> bool:
        """Whether the background validation still runs (a guarded slot may free up soon)."""
        return self._verifier is not None and self._verifier.is_alive()

    def after_commit(self) -> None:
        """A newer checkpoint is durable: recovery no longer needs the protected fallback."""
        if self._guarded:
            self._release_guarded(self.generation)

    # -- retiring and closing ------------------------------------------------------------------

    def retire_older_generations(self) -> None:
        """Deletes generations older than the open one. Call only after it has a durable commit."""
        removed = False
        for gen, file in store_files(self.path):
            if gen < self.generation:
                file.unlink(missing_ok=True)
                removed = True
                log.info("pccheck: retired %s", file)
        if removed:
            fsync_dir(self.path)
        self.retire_pending = False

    # -- what the orchestrator and a group coordinator use ---------------------------------------

    @property
    def mode(self) -> str:
        """The write mode in use: "odirect", "mmap" or "pmem" ("closed" before open)."""
        return self.native.mode if self.native is not None else "closed"

    def take_held(self, generation: int) -> list[int]:
        """Replaced slots held since the last call (``hold_replaced``), if ``generation`` is still
        the open one (else none: slot numbers start over in a new generation)."""
        with self._guard_lock:  # a new generation swaps native under it
            if self.native is None or self.generation != generation:
                return []
            return list(self.native.take_held())

    def release_slot(self, slot: int, generation: int) -> None:
        """Frees a held slot of ``generation`` for reuse; a no-op once another generation is open
        (the slot number would name a slot of the new one)."""
        with self._guard_lock:
            if self.native is not None and self.generation == generation:
                self.native.release_slot(slot)

    def _close_native(self) -> None:
        with self._guard_lock:  # the verifier may be releasing a slot of this native store
            if self.native is not None:
                self.native.close()
                self.native = None

    def close(self) -> None:
        if self._verifier is not None:
            self._verifier.join()  # it reads the file and may release a slot of the native store
            self._verifier = None
        self._close_native()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1


def _populate(native: "_native.Store", file: Path) -> None:
    """Faults a store's whole mapping in (see SlotStore's ``populate``); stops at its close."""
    t0 = time.perf_counter()
    try:
        done = native.populate()
    except Exception as exc:  # noqa: BLE001 - an optimisation only: the writers fault pages in themselves
        log.warning("pccheck: populating %s failed: %s", file, exc)
        return
    log.info("pccheck: populated %s (%.1f MiB in %.2f s)", file, done / 2**20, time.perf_counter() - t0)
