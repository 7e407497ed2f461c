"""Staging for ``dcp.async_save``: a copy of the state_dict in reused shared host buffers.

DCP's default stager allocates fresh host memory for every save (first touch is slow, and host
memory grows per save: pytorch #170163). :class:`StagingPool` keeps at most ``limit``
buffers, each a set of shared-memory CPU tensors shaped like the state_dict's tensors (a
DTensor's local shard), allocated and touched once and reused while the state_dict keeps its
shapes.

Each buffer carries a *lease*: a one-byte shared tensor, 1 while a save uses it. The staged
state_dict holds it under the key :data:`LEASE_KEY`; the Writer drops that key from its plan (it
is never saved) and clears the lease once the save's data is in pccheck's DRAM chunks, in
whichever process writes (a PROCESS-mode daemon sees the same shared byte). ``stage`` reuses only
a buffer whose lease is 0.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import PCCheckError

__all__ = ["StagingPool", "LEASE_KEY", "ORDER_KEY", "release_lease", "staged_order"]

log = logging.getLogger("pccheck")

LEASE_KEY = "_pccheck_dcp_lease"
# The save's place in the order of stage calls (an int): upload threads may reach write_data in
# another order, and a save that arrives after a later-staged one started is not written.
ORDER_KEY = "_pccheck_dcp_order"
_WAIT_S = 600.0


@dataclass
class _Buffer:
    signature: tuple
    tensors: list[Any]  # shared-memory CPU tensors, in traversal order
    lease: Any          # uint8[1] shared tensor: 1 while a save uses this buffer


def _is_dtensor(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def _leaves(x: Any, out: list[Any]) -> None:
    import torch

    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            _leaves(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _leaves(v, out)


def _local(t: Any) -> Any:
    return t.to_local() if _is_dtensor(t) else t


def _rebuild(x: Any, buf: list[Any], pos: list[int]) -> Any:
    """``x`` with each tensor replaced by its staged copy (DTensors rewrapped, same placements);
    other values deep-copied (they are small and may change between saves: the lr)."""
    import torch

    if isinstance(x, torch.Tensor):
        dst = buf[pos[0]]
        pos[0] += 1
        dst.copy_(_local(x).detach())
        if _is_dtensor(x):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(dst, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                      stride=x.stride())
        return dst
    if isinstance(x, dict):
        return {k: _rebuild(v, buf, pos) for k, v in x.items()}
    if isinstance(x, list):
        return [_rebuild(v, buf, pos) for v in x]
    if isinstance(x, tuple):
        return tuple(_rebuild(v, buf, pos) for v in x)
    return copy.deepcopy(x)


class StagingPool:
    """At most ``limit`` staging buffers, reused across saves (see the module docstring)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, int(limit))
        self._buffers: list[_Buffer] = []
        self._lock = threading.Lock()
        self._order = 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` in a free buffer (waiting for one while ``limit`` are in use)."""
        import torch

        tensors: list[Any] = []
        _leaves(state_dict, tensors)
        sig = tuple((tuple(_local(t).shape), _local(t).dtype) for t in tensors)
        buf = self._take(sig, tensors)
        try:
            staged = _rebuild(state_dict, buf.tensors, [0])
        except BaseException:
            buf.lease.fill_(0)
            raise
        staged[LEASE_KEY] = buf.lease
        with self._lock:
            self._order += 1
            staged[ORDER_KEY] = self._order
        assert isinstance(buf.lease, torch.Tensor)
        return staged

    def _take(self, sig: tuple, tensors: list[Any]) -> _Buffer:
        deadline = time.monotonic() + _WAIT_S
        while True:
            with self._lock:
                # a buffer of another shape (the optimizer's state appeared) is dropped once free
                self._buffers = [b for b in self._buffers if b.signature == sig or int(b.lease.item())]
                for b in self._buffers:
                    if not int(b.lease.item()):
                        b.lease.fill_(1)
                        return b
                if len(self._buffers) < self.limit:
                    b = self._allocate(sig, tensors)
                    self._buffers.append(b)
                    return b
            if time.monotonic() > deadline:
                raise PCCheckError(f"no staging buffer came back in {_WAIT_S:.0f} s ({self.limit} in use): a save "
                                   "failed before writing, or more saves are in flight than max_concurrent; "
                                   "wait for the earlier async_save futures")
            time.sleep(0.002)

    @staticmethod
    def _allocate(sig: tuple, tensors: list[Any]) -> _Buffer:
        import torch

        out = [torch.empty(_local(t).shape, dtype=_local(t).dtype, device="cpu").share_memory_() for t in tensors]
        for t in out:  # touch every page once, here, not inside a save
            t.zero_()
        lease = torch.ones(1, dtype=torch.uint8).share_memory_()
        return _Buffer(sig, out, lease)

    def close(self) -> None:
        """Forgets every buffer (a save still using one keeps it alive through its tensors)."""
        with self._lock:
            self._buffers = []


def staged_order(state_dict: Any) -> int | None:
    """The stage-call order a staged state_dict carries (None if it was not staged)."""
    v = state_dict.get(ORDER_KEY) if isinstance(state_dict, dict) else None
    return v if isinstance(v, int) else None


def release_lease(state_dict: Any) -> None:
    """Clears the staging lease a staged state_dict carries (no-op for one that was not staged)."""
    lease = state_dict.get(LEASE_KEY) if isinstance(state_dict, dict) else None
    if lease is not None:
        lease.fill_(0)
