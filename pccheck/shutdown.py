"""Ending pccheck's background work before the interpreter ends.

A daemon thread that is still inside native code when CPython finalizes (a read or a crc32c in
pccheck's core, torch's ``copy_``, a socket receive) is ended by ``pthread_exit`` the moment it
takes the GIL back. That forced unwind runs through C++ destructors that may not throw (pybind11's
``gil_scoped_release``), and the process aborts: "terminate called without an active exception",
SIGABRT, exit 134. Under torchrun that is a failed worker, and the elastic agent restarts the job.

    Invariant: no thread pccheck started is alive when the interpreter finalizes. Every one is
    started by :func:`thread`. Every owner that may outlive the script (a Checkpointer, a lazy
    restore) registers how to stop its work with :func:`on_exit`. At exit the stoppers run,
    newest first, and then every pccheck thread still alive is joined.

The hook runs at the start of the interpreter's thread shutdown, before it joins non-daemon
threads, because ``concurrent.futures`` pools (the commit threads, the upload senders) still take
work only until then. So a Checkpointer left open is closed at exit as ``close()`` would close it:
its checkpoints in flight commit, and a remote upload finishes within ``remote.close_timeout``.
``os._exit`` and a fatal signal end the process without running any of this, which is safe: no
thread is interrupted by the interpreter, the kernel ends them all at once, and the commit protocol
keeps the last committed checkpoint loadable.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

# Imported first so that its exit hook (which shuts the pools down) is registered before ours:
# threading runs these hooks newest first, so ours runs while the pools still take work.
import concurrent.futures.thread  # noqa: F401

__all__ = ["thread", "on_exit", "run_exit_hooks"]

log = logging.getLogger("pccheck")

# How long the exit hook waits for one thread of pccheck's after its owner was told to stop. Each
# owner's stop bounds its own work (a lazy load stops between arrays, a Checkpointer's close waits
# for its commits and for ``remote.close_timeout``); this bounds a thread whose owner never was
# registered, so an exit can never hang forever on one.
JOIN_S = 60.0

_lock = threading.Lock()
_threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_stoppers: dict[int, Callable[[], Callable[[], None] | None]] = {}  # key -> a (weak) reference
_next_key = 0


def thread(target: Callable[..., Any], name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
    """Starts ``target(*args)`` on a daemon thread that the exit hook joins, and returns it."""
    t = threading.Thread(target=target, args=args, name=name, daemon=True)
    with _lock:
        _threads.add(t)
    t.start()
    return t


def on_exit(stop: Callable[[], None]) -> Callable[[], None]:
    """Registers ``stop`` to run at interpreter exit (before pccheck's threads are joined), and
    returns a function that unregisters it (call that once the owner stopped on its own). A bound
    method is held weakly: an owner that was garbage-collected is not stopped."""
    global _next_key
    ref: Callable[[], Callable[[], None] | None]
    if hasattr(stop, "__self__") and hasattr(stop, "__func__"):
        ref = weakref.WeakMethod(stop)  # type: ignore[arg-type]
    else:
        ref = lambda: stop  # noqa: E731 - a plain function: held strongly
    with _lock:
        key, _next_key = _next_key, _next_key + 1
        _stoppers[key] = ref

    def forget() -> None:
        with _lock:
            _stoppers.pop(key, None)
    return forget


def run_exit_hooks() -> None:
    """Stops every registered owner (newest first) and joins every thread of pccheck's still
    alive. Called once at interpreter exit; safe to call earlier (then it stops everything)."""
    with _lock:
        stoppers = [ref for _, ref in sorted(_stoppers.items(), reverse=True)]
        _stoppers.clear()
    for ref in stoppers:
        stop = ref()
        if stop is None:
            continue
        try:
            stop()
        except BaseException as exc:  # noqa: BLE001 - every owner gets its turn; the script's own exit code stands
            log.error("pccheck: stopping %s at exit failed: %s", getattr(stop, "__qualname__", stop), exc)
    deadline = time.monotonic() + JOIN_S
    with _lock:
        alive = [t for t in _threads if t.is_alive() and t is not threading.current_thread()]
    for t in alive:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            log.error("pccheck: thread %s still running at exit after %.0f s", t.name, JOIN_S)


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads, and its parent's owners are not its own."""
    global _lock
    _lock = threading.Lock()
    _stoppers.clear()
    _threads.clear()


os.register_at_fork(after_in_child=_forget_in_child)

# threading's own hook list runs before the non-daemon threads are joined (concurrent.futures
# registers there for the same reason); atexit runs only after that join, when pools refuse work.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(run_exit_hooks)
else:  # pragma: no cover - every CPython pccheck supports has it (3.9+)
    import atexit

    atexit.register(run_exit_hooks)
