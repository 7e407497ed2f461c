"""The ways of checkpointing that bench.incremental compares inside its loop, one class each, and
:func:`make_row`, which builds one by its row name."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.harness.systems import make_loop_system, torch_save_durable
from bench.harness.workloads import Workload

__all__ = ["Row", "make_row"]


class Row:
    """One way of checkpointing inside the loop: ``checkpoint(step)`` after each update, ``drain()``,
    then ``records()`` (per checkpoint of the window) and ``close()``."""

    def __init__(self) -> None:
        self.durable_s: dict[int, float] = {}

    def checkpoint(self, step: int) -> None:
        """Checkpoint after ``step``."""

    def drain(self) -> None:
        """Wait for everything in flight."""

    def records(self, first: int) -> dict[str, list[float]]:
        """Per-checkpoint figures of the checkpoints of steps >= ``first``."""
        return {"durable_s": [v for s, v in self.durable_s.items() if s >= first]}

    def close(self) -> None:
        """Release files and threads."""


class _Pccheck(Row):
    def __init__(self, state: Any, opt: Any, path: Path, incremental: bool) -> None:
        import pccheck

        super().__init__()
        self.ck = pccheck.Checkpointer(state, opt, path, interval=1, max_concurrent=2, incremental=incremental)

    def checkpoint(self, step: int) -> None:
        self.ck.maybe_checkpoint(step)

    def drain(self) -> None:
        self.ck.wait()

    def records(self, first: int) -> dict[str, list[float]]:
        cs = [c for c in self.ck.stats().checkpoints if c.step >= first and c.outcome == "committed"]
        return {"durable_s": [c.persist_s for c in cs], "blocked_s": [c.blocked_s for c in cs],
                "library_bytes_written": [c.bytes_written for c in cs],
                "bytes_referenced": [c.bytes_referenced for c in cs], "fingerprint_s": [c.fingerprint_s for c in cs]}

    def close(self) -> None:
        self.ck.close()


class _Dcp(Row):
    """bench.harness.systems' ``dcp_async`` loop system, with its call-to-durable record."""

    def __init__(self, wl: Workload, path: Path) -> None:
        super().__init__()
        self.sys = make_loop_system("dcp_async", wl, path, 1, None, lag=True)

    def checkpoint(self, step: int) -> None:
        self.sys.checkpoint(step)

    def drain(self) -> None:
        self.sys.drain()

    def records(self, first: int) -> dict[str, list[float]]:
        lag = self.sys._lag  # the Lag the system was made with (lag=True)
        return {"durable_s": [lag.done[s] - lag.calls[s] for s in lag.calls if s >= first and s in lag.done]}

    def close(self) -> None:
        self.sys.close()


class _AdapterSave(Row):
    """PEFT-style: the trainable parameters and the optimizer state, ``torch.save`` + ``fsync``; the
    previous file is removed once the new one is durable."""

    def __init__(self, wl: Workload, path: Path) -> None:
        super().__init__()
        self.wl, self.dir, self.prev = wl, path, None
        path.mkdir(parents=True, exist_ok=True)

    def checkpoint(self, step: int) -> None:
        t0 = time.perf_counter()
        out = self.dir / f"adapter-{step}.pt"
        adapters = {n: p.detach() for n, p in self.wl.model.named_parameters() if p.requires_grad}
        torch_save_durable({"adapters": adapters, "optimizer": self.wl.optimizer.state_dict()}, out)
        self.durable_s[step] = time.perf_counter() - t0
        if self.prev is not None:
            self.prev.unlink()
        self.prev = out


def _adapters(wl: Workload) -> Any:
    """The adapters alone as a module (a ParameterDict of the same Parameter objects)."""
    import torch

    return torch.nn.ParameterDict({n.replace(".", "_"): p for n, p in wl.model.named_parameters() if p.requires_grad})


def make_row(name: str, wl: Workload, path: Path) -> Row:
    if name == "none":
        return Row()
    if name in ("pccheck_incremental", "full_params_incremental"):
        return _Pccheck(wl.model, wl.optimizer, path, True)
    if name in ("pccheck_full", "full_params_full"):
        return _Pccheck(wl.model, wl.optimizer, path, False)
    if name == "pccheck_adapters":
        return _Pccheck(_adapters(wl), wl.optimizer, path, False)
    if name == "dcp_async":
        return _Dcp(wl, path)
    if name == "peft_torch_save":
        return _AdapterSave(wl, path)
    raise ValueError(f"unknown row {name!r}")
