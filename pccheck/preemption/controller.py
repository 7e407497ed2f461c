"""The Checkpointer's preemption side: what ``on_preemption``, ``flush`` and ``preempted`` stand
on. It owns the notice sources (notice.py), the step gate (gate.py) and the flush thread.

Threads: a notice (a signal handler, or the URL poller) only records its cause and writes one
byte into a pipe (async-signal-safe; no lock a handler could find taken by the code it
interrupted). The waiter thread, a thread of pccheck's (``shutdown.thread``), reads it and runs
the flush (flush.py) there; then, for a signal, it re-delivers the signal so that the previous
handler runs (notice.SignalNotice.chain). ``Checkpointer.flush()`` runs a flush on a thread of
pccheck's as well and waits for it.

Invariant (exit): ``close`` (the Checkpointer's close, and the exit hook registered at
``install``, which runs before the Checkpointer's own since it is newer) waits for a flush in
progress (bounded by its deadline) and stops the waiter and the poller before the tier stack
is torn down; a notice after that starts nothing.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from typing import Any, Callable, Sequence

from .. import shutdown
from ..errors import ConfigError
from .flush import Notice, run_flush
from .gate import StepGate
from .notice import SignalNotice, UrlNotice, check_url
from .result import FlushResult

__all__ = ["Preemption", "headroom"]

log = logging.getLogger("pccheck")


def headroom(grace_s: float) -> float:
    """Seconds of ``grace_s`` kept free at its end, for the previous handler and the exit: 5 %,
    at most 1 s."""
    return min(1.0, 0.05 * grace_s)


class Preemption:
    """The preemption side of one Checkpointer over ``stack`` (a TierStack)."""

    def __init__(self, stack: Any) -> None:
        self._stack = stack
        self.gate = StepGate()
        self.preempted = False
        self.last: FlushResult | None = None
        self._grace: float | None = None
        self._signals: SignalNotice | None = None
        self._url: UrlNotice | None = None
        self._pipe: tuple[int, int] | None = None
        self._waiter: threading.Thread | None = None
        self._notice: Notice | None = None
        self._flush_lock = threading.Lock()  # one flush at a time
        self._count = 0
        self._closed = False
        self._forget: Callable[[], None] | None = None

    # -- installing ------------------------------------------------------------------------------

    def install(self, grace_s: float, signals: Sequence[int], notice_url: str | None, poll_s: float) -> None:
        if self._grace is not None:
            raise ConfigError("on_preemption was already called on this Checkpointer")
        if self._closed:
            raise ConfigError("this Checkpointer is closed")
        if not (isinstance(grace_s, (int, float)) and math.isfinite(grace_s) and grace_s > 0):
            raise ConfigError(f"grace_s must be a positive number of seconds, got {grace_s!r}")
        if not signals and notice_url is None:
            raise ConfigError("on_preemption needs signals or a notice_url (or call flush() yourself)")
        if notice_url is not None:
            check_url(notice_url, poll_s)
        # the handlers first: they are refused outside the main thread, before anything is started
        self._signals = SignalNotice(signals, self._on_notice) if signals else None
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe, self._grace = (r, w), float(grace_s)
        self._waiter = shutdown.thread(self._wait, "pccheck-preempt")
        self._url = UrlNotice(notice_url, poll_s, self._on_notice) if notice_url is not None else None
        # newer than the Checkpointer's own exit hook: runs first (shutdown.py: newest first)
        self._forget = shutdown.on_exit(self.close)
        log.info("pccheck: flushing on %s within %.1f s", ", ".join(
            [signal.Signals(s).name for s in (self._signals.signals if self._signals else ())]
            + ([notice_url] if notice_url else [])), self._grace)

    def _on_notice(self, cause: str, signum: int | None = None) -> None:
        """A signal handler's (or the poller's) whole work: record, and wake the waiter."""
        if self._notice is not None or self._closed or self._pipe is None:
            return  # a second notice during (or after) the flush: no second flush
        self._notice = Notice(cause, time.monotonic(), time.time(), signum)
        self.preempted = True
        try:
            os.write(self._pipe[1], b"n")
        except OSError:
            pass

    def _wait(self) -> None:
        assert self._pipe is not None and self._grace is not None
        if os.read(self._pipe[0], 1) != b"n" or self._notice is None:
            return  # closed
        notice = self._notice
        log.warning("pccheck: preemption notice (%s): flushing within %.1f s", notice.cause, self._grace)
        try:
            self._run(notice, notice.t0 + self._grace - headroom(self._grace))
        except BaseException:  # noqa: BLE001 - the previous handler must still run
            log.exception("pccheck: the preemption flush failed")
        finally:
            if self._signals is not None:
                self._signals.chain(notice.signum)

    def _run(self, notice: Notice, deadline: float, serve: Callable[[int], bool] | None = None) -> FlushResult:
        with self._flush_lock:
            self._count += 1
            try:
                result = run_flush(self._stack, self.gate, notice, deadline, self._count, serve)
            finally:
                self.gate.end()
            self.last = result
            self._stack.flushed = result.as_dict()
            return result

    # -- on demand -------------------------------------------------------------------------------

    def flush(self, timeout: float | None, take: Callable[[int], bool]) -> FlushResult:
        """A flush now, on a thread of pccheck's; ``take(step)`` takes a disk checkpoint of the
        live state as ``step`` when the caller is the training thread (between its calls)."""
        if self._closed:
            raise ConfigError("this Checkpointer is closed")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
            raise ConfigError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
        notice = Notice("flush()", time.monotonic(), time.time())
        deadline = math.inf if timeout is None else notice.t0 + timeout
        trainer = self.gate.trainer in (None, threading.get_ident())
        box: list[Any] = []

        def run() -> None:
            try:
                box.append(self._run(notice, deadline, take if trainer else None))
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                box.append(exc)
        shutdown.thread(run, "pccheck-flush").join()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    # -- the end ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for a flush in progress, stops the notice sources; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._forget is not None:
            self._forget()
        if self._url is not None:
            self._url.stop()
        if self._pipe is not None:
            try:
                os.write(self._pipe[1], b"c")
            except OSError:
                pass
        if self._waiter is not None and self._waiter is not threading.current_thread():
            self._waiter.join(None if self._grace is None else self._grace + 5.0)
        if self._signals is not None:
            self._signals.restore()
        with self._flush_lock:  # a flush() in progress ends before the stack closes
            pass
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None
