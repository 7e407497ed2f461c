"""Checkpoints a framework knows by a file name, kept in a pccheck store (FORMAT.md §10).

Frameworks such as Lightning and Accelerate name each checkpoint by a path (``…/epoch=1-step=50.ckpt``,
``last.ckpt``) and look for it on the file system. pccheck writes the state into its slot store
and leaves at that path a small JSON *pointer*: which store, which name. The name also goes into
the checkpoint's own metadata, so a pointer never trusts the store to still hold what it named:

- :class:`Pointers` leaves one at once (whole, not yet durable: :func:`write_pointer`) and makes
  it durable from a background thread (:func:`stage_durable`, renamed over it under its lock);
- :func:`read_pointer` reads one back (None for any other file, e.g. a torch.save checkpoint);
- :func:`load_named` loads the newest checkpoint of the store that carries the name and
  validates (every crc32c), falling back to an older one of the same name; with ``newest_if_gone``
  (``last.ckpt``: "the newest state") to the newest valid checkpoint of any name.

Invariant: a pointer is only a name. Whatever it says, what is loaded is a checkpoint the store
validated, and a pointer whose checkpoint is not (yet, or any more) in the store loads nothing
that could be mistaken for it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import CorruptCheckpointError, NoCheckpointError, PCCheckError
from ..options import Options
from ..orchestrator.options import EngineOptions
from ..persist.files import fsync_dir
from ..persist.layout import plan
from ..persist.recovery import Restored, load_newest, load_slot, read_manifest, scan
from ..state.torch_state import Snapshot
from ..tiers.base import TierContext
from ..tiers.stack import TierStack
from ..tuner.config import resolve_auto

__all__ = ["open_store", "Pointer", "Pointers", "pointer_bytes", "write_pointer", "stage_durable", "read_pointer",
           "load_named"]

log = logging.getLogger("pccheck")

POINTER_FORMAT = "pccheck-named"
POINTER_VERSION = 1
_MAX_POINTER = 64 << 10  # a pointer is a few hundred bytes; anything larger is another file


def open_store(path: Path, engine: EngineOptions, arrays: Mapping[str, Any],
               on_error: Callable[[PCCheckError], None]) -> TierStack:
    """The tier stack over the store at ``path`` that a plugin's named checkpoints go to (the
    same place every entry point gets its tiers from): the engine's "auto" fields take
    ``pccheck-tune``'s choice stored there, or the defaults. The store opens at the first save,
    sized for its manifest."""
    path.mkdir(parents=True, exist_ok=True)
    tuned = engine.with_values(resolve_auto(path, 1, engine.max_concurrent, engine.writer_threads,
                                            engine.chunk_size))
    # one store at `path`; the plugin names its saves. Full checkpoints: a named save is kept by its
    # slot (the pointer names it), which would not keep the cells of other slots an incremental
    # checkpoint references.
    options = Options().updated(distributed=False, incremental=False)
    ctx = TierContext(path, options, None, {}, None, None, on_error)
    return TierStack(ctx, tuned, plan(arrays), Snapshot(arrays, len(arrays), None), writes=True, prepared=True,
                     open_now=False)


@dataclass(frozen=True)
class Pointer:
    """What a pointer file says: the store directory and the checkpoint's name in it."""

    store: Path
    name: str
    step: int
    framework: str


def pointer_bytes(path: Path, store: Path, name: str, step: int, framework: str) -> bytes:
    """The pointer to leave at ``path`` naming checkpoint ``name`` (of ``step``) in ``store``."""
    path = Path(path)
    doc = {"format": POINTER_FORMAT, "version": POINTER_VERSION, "framework": framework, "name": name,
           "step": step, "store": os.path.relpath(Path(store).resolve(), path.parent.resolve()),
           "store_abs": str(Path(store).resolve())}
    return json.dumps(doc, indent=1).encode()


def write_pointer(path: Path, data: bytes) -> None:
    """Leaves the pointer ``data`` at ``path``. It appears whole (temporary name, rename) but not
    durably: the caller, which cannot wait for the disk, makes it durable later with
    :func:`stage_durable` (until then a power cut may lose it, or leave it empty)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def stage_durable(path: Path, data: bytes) -> Path:
    """A durable temporary copy of ``data`` beside ``path``, to be renamed over it (then the
    directory fsynced) by a caller that checks under its own lock that ``path`` should still be."""
    tmp = Path(path).with_name(f"{Path(path).name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


class Pointers:
    """The pointer files one plugin leaves: each visible at once, durable soon after.

    A framework looks for its file right after a save, so :meth:`leave` writes it whole at once;
    an fsync there would wait behind the checkpoint's own writes, so a background thread makes it
    durable. Invariant: a name the framework removed is never brought back, and a newer pointer
    of the same name is never replaced by an older one: pointers change only under :attr:`lock`.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pccheck-names")  # fsyncs, in order

    def leave(self, target: Path, data: bytes) -> None:
        """Leaves the pointer ``data`` at ``target`` now, and makes it durable in the background."""
        with self.lock:
            write_pointer(target, data)
        self._pool.submit(self._make_durable, target, data)

    def remove(self, target: Path) -> None:
        """Removes the pointer at ``target`` (a framework's retention)."""
        with self.lock:
            target.unlink(missing_ok=True)

    def flush(self) -> None:
        """Waits until every pointer left so far is durable (or failed, logged)."""
        self._pool.shutdown(wait=True)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pccheck-names")

    def _make_durable(self, target: Path, data: bytes) -> None:
        try:
            tmp = stage_durable(target, data)
            with self.lock:
                if not target.is_file() or target.read_bytes() != data:
                    tmp.unlink()
                    return
                os.replace(tmp, target)
            fsync_dir(target.parent)
        except OSError as exc:
            log.warning("pccheck: the checkpoint name %s is not durable yet: %s", target, exc)


def read_pointer(path: Path) -> Pointer | None:
    """The pointer at ``path``; None if the file is not one (FileNotFoundError if it is missing).
    A file that says it is a pointer but is malformed raises CorruptCheckpointError."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(_MAX_POINTER + 1)
    if len(head) > _MAX_POINTER or not head.lstrip().startswith(b"{"):
        return None
    try:
        doc = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
        return None
    name, step, rel, absolute = doc.get("name"), doc.get("step"), doc.get("store"), doc.get("store_abs")
    if (doc.get("version") != POINTER_VERSION or not isinstance(name, str) or not name
            or isinstance(step, bool) or not isinstance(step, int) or not isinstance(rel, str)
            or not isinstance(absolute, str)):
        raise CorruptCheckpointError(f"{path}: a malformed pccheck pointer (version {doc.get('version')!r}); "
                                     "it names no checkpoint this pccheck can load")
    # The store beside the pointer as it was written (the directory may have been moved whole),
    # else where it was.
    store = (path.parent / rel).resolve()
    if not store.is_dir():
        store = Path(absolute)
    return Pointer(store, name, step, str(doc.get("framework", "")))


def load_named(store: Path, name: str, key: str, *, newest_if_gone: bool = False) -> Restored:
    """The newest valid checkpoint in ``store`` whose metadata ``key`` object carries ``name``
    (every crc32c checked; a damaged one falls back to an older one of the same name). With
    ``newest_if_gone``, when none does, the newest valid checkpoint of the store (logged).
    Raises NoCheckpointError, saying why, when nothing fits."""
    problems: list[str] = []
    for found in scan(Path(store)):
        if found.image is None:
            problems.append(str(found.problem))
            continue
        image = found.image
        with open(image.path, "rb", buffering=0) as f:
            for st in sorted((s for s in image.slots if s.meta), key=lambda s: s.meta["counter"], reverse=True):
                try:
                    meta = read_manifest(image, st.slot, f.fileno()).metadata.get(key)
                    if not isinstance(meta, dict) or meta.get("name") != name:
                        continue
                    return load_slot(image, st.slot, fd=f.fileno())
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
    detail = f" ({'; '.join(problems)})" if problems else ""
    if newest_if_gone:
        try:
            r = load_newest(store)
        except NoCheckpointError as exc:
            raise NoCheckpointError(f"{store} holds no valid checkpoint named {name!r}{detail}, nor any other valid "
                                    f"one ({exc})") from None
        log.warning("pccheck: no valid checkpoint named %r in %s%s; loading the newest valid one (step %d)",
                    name, store, detail, r.step)
        return r
    raise NoCheckpointError(
        f"{store} holds no valid checkpoint named {name!r}{detail}: it was never committed (the run stopped "
        "before it was durable) or newer checkpoints have taken its slot (the store keeps max_concurrent + 1); "
        "load the last checkpoint instead, or keep fewer checkpoints in flight between the ones you keep")
