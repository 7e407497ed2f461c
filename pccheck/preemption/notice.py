"""Where a preemption notice comes from: a signal (:class:`SignalNotice`) or a cloud's metadata
endpoint (:class:`UrlNotice`). Both only call ``on_notice(cause)``, which sets a flag and wakes
the flush thread; neither ever does I/O on the signal's behalf.

Invariant (signals): the handler that runs in the main thread does almost nothing: the first
time it records the cause and wakes the flush thread. Once the flush has ended, the flush thread
re-delivers the signal to the process (:meth:`SignalNotice.chain`), and the same handler, in
the main thread, then runs the handler that was installed before ours: a Python callable is
called with the signal and frame; the default action (``SIG_DFL``, or a handler installed
outside Python) is restored and the signal raised again, so a default SIGTERM ends the process;
``SIG_IGN`` does nothing. A second signal during the flush starts no second flush.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import urllib.error
import urllib.request
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit

from .. import shutdown
from ..errors import ConfigError

__all__ = ["SignalNotice", "UrlNotice", "is_notice", "check_url", "AWS_METADATA_HOST"]

log = logging.getLogger("pccheck")

AWS_METADATA_HOST = "169.254.169.254"
REQUEST_TIMEOUT_S = 2.0  # one poll of the notice URL: a metadata service answers in milliseconds


class SignalNotice:
    """Handlers for ``signals`` that call ``on_notice("signal <NAME>", signum)`` (installed from the main
    thread only, as Python requires), chaining the handlers they replace."""

    def __init__(self, signals: Iterable[int], on_notice: Callable[[str, int], None]) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("on_preemption installs signal handlers, which Python allows only in the main "
                              "thread: call it there (or pass signals=() and use notice_url= or flush())")
        self._on_notice = on_notice
        self._previous: dict[int, Any] = {}
        self._chaining: set[int] = set()  # signals whose flush has ended: the previous handler runs
        try:
            for sig in signals:
                sig = signal.Signals(sig)
                if sig in self._previous:
                    continue
                self._previous[sig] = signal.signal(sig, self._handle)
        except (ValueError, OSError, TypeError) as exc:
            self.restore()
            raise ConfigError(f"cannot handle signal {sig!r}: {exc}; pass catchable signals such as "
                              f"signal.SIGTERM, signal.SIGUSR1") from None

    @property
    def signals(self) -> tuple[int, ...]:
        return tuple(self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        if signum in self._chaining:
            self._run_previous(signum, frame)
        else:
            self._on_notice(f"signal {signal.Signals(signum).name}", signum)

    def _run_previous(self, signum: int, frame: Any) -> None:
        prev = self._previous.get(signum)
        if prev is signal.SIG_IGN:
            return
        if callable(prev):
            prev(signum, frame)
            return
        # SIG_DFL, or a handler installed outside Python (getsignal gave None): the default action
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    def chain(self, signum: int | None) -> None:
        """After the flush: the previous handler of ``signum`` runs (in the main thread, through
        this handler); with None, the previous handlers run for signals from now on."""
        for sig in self._previous:
            self._chaining.add(sig)
        if signum is not None:
            os.kill(os.getpid(), signum)

    def restore(self) -> None:
        """Puts the previous handlers back where ours is still installed (main thread only;
        elsewhere ours stays and forwards every signal to them)."""
        self._chaining.update(self._previous)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)


def is_notice(status: int, body: bytes) -> bool:
    """Whether a metadata endpoint's answer is a preemption notice: 200, except GCE's
    ``preempted`` answering 200 with "FALSE" (404 is AWS's "no notice")."""
    return status == 200 and body.strip().upper() != b"FALSE"


def check_url(url: Any, poll_s: Any) -> None:
    """ConfigError unless ``url`` is an http(s) URL and ``poll_s`` a positive number."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"notice_url must be an http(s) URL (the metadata service's notice), got {url!r}")
    if not (isinstance(poll_s, (int, float)) and poll_s > 0):
        raise ConfigError(f"poll_s must be a positive number of seconds, got {poll_s!r}")


class UrlNotice:
    """Polls ``url`` every ``poll_s`` seconds on a thread of pccheck's until it answers with a
    notice (:func:`is_notice`), then calls ``on_notice("notice <url>")`` once and stops."""

    def __init__(self, url: str, poll_s: float, on_notice: Callable[[str], None]) -> None:
        check_url(url, poll_s)
        parts = urlsplit(url)
        self.url, self.poll_s, self._on_notice = url, float(poll_s), on_notice
        self._aws = parts.hostname == AWS_METADATA_HOST
        self._stop = threading.Event()
        self.polls = 0
        self._thread = shutdown.thread(self._run, "pccheck-preempt-notice")

    def _headers(self) -> dict[str, str]:
        # GCE's metadata server answers only requests that carry this header; others ignore it.
        headers = {"Metadata-Flavor": "Google"}
        if self._aws:  # IMDSv2 (IMDSv1 may be disabled): a session token first; without one, v1
            try:
                req = urllib.request.Request(f"http://{AWS_METADATA_HOST}/latest/api/token", method="PUT",
                                             headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
                with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                    headers["X-aws-ec2-metadata-token"] = r.read(4096).decode("ascii", "replace").strip()
            except (OSError, ValueError):
                pass
        return headers

    def poll(self) -> bool:
        """One request: True if the answer is a notice."""
        self.polls += 1
        try:
            req = urllib.request.Request(self.url, headers=self._headers())
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                return is_notice(r.status, r.read(4096))
        except urllib.error.HTTPError as exc:  # 404: no notice (and any other status: not one either)
            return is_notice(exc.code, b"")
        except (OSError, ValueError) as exc:
            log.debug("pccheck: polling the preemption notice %s failed: %s", self.url, exc)
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.poll():
                log.warning("pccheck: preemption notice from %s", self.url)
                self._on_notice(f"notice {self.url}")
                return
            self._stop.wait(self.poll_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(REQUEST_TIMEOUT_S * 3 + 1)
