"""DTensors as pccheck sees them: which local box a rank holds, whether it stores it, and how a
resharded load builds a destination tensor.

Only public DTensor API is used (``placements``, ``device_mesh``, ``to_local``, ``from_local``,
``DeviceMesh.get_coordinate``); the box arithmetic is :mod:`pccheck.sharded.geometry`'s.
Supported placements: ``Shard(d)`` and ``Replicate()``. Anything else (``Partial``: pending
reductions, not a value; strided shards) is refused when the Checkpointer is built, before a byte
is written.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConfigError
from .geometry import Box, full_box, local_box

__all__ = ["is_dtensor", "has_dtensors", "check_placements", "LocalPart", "local_part", "Destination",
           "destination", "destination_box", "global_rank"]


def is_dtensor(x: Any) -> bool:
    """True for a DTensor (never imports torch.distributed itself)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(x, mod.DTensor)


def has_dtensors(model: Any) -> bool:
    """True if any parameter or buffer of ``model`` is a DTensor (FSDP2, tensor parallel)."""
    return any(is_dtensor(t) for t in (*model.parameters(), *model.buffers()))


def global_rank() -> int:
    """This process's rank in the default group (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _shard_dims(dt: Any, where: str) -> list[int | None]:
    from torch.distributed.tensor import Replicate, Shard

    dims: list[int | None] = []
    for p in dt.placements:
        if type(p) is Shard:  # exactly Shard: subclasses (strided shards) cut differently
            dims.append(p.dim % max(dt.ndim, 1))
        elif isinstance(p, Replicate):
            dims.append(None)
        else:
            raise ConfigError(
                f"{where}: a DTensor placed as {p} cannot be checkpointed; pccheck stores Shard(d) and "
                "Replicate() placements (a Partial tensor holds pending reductions, not values: redistribute "
                "it to Shard or Replicate first)")
    return dims


def check_placements(model: Any) -> None:
    """ConfigError naming the first parameter or buffer with a placement pccheck cannot store."""
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if is_dtensor(t):
            _shard_dims(t, f"model {name!r}")


@dataclass(frozen=True)
class LocalPart:
    """What this rank holds of a DTensor, and whether it is the one that stores it."""

    local: Any   # the local shard (a torch.Tensor sharing the DTensor's memory)
    box: Box     # where it lies in the global tensor
    stores: bool  # the lowest rank holding this box (coordinate 0 on every Replicate() dim)


def local_part(dt: Any, where: str) -> LocalPart:
    """The local shard of DTensor ``dt`` and its box; ConfigError if the layout is not one
    pccheck can describe (the computed box must match the local tensor's shape)."""
    dims = _shard_dims(dt, where)
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise ConfigError(f"{where}: this rank is not part of the DTensor's device mesh")
    local = dt.to_local()
    box = local_box(tuple(dt.shape), tuple(mesh.shape), coord, dims)
    if tuple(local.shape) != box.sizes:
        raise ConfigError(f"{where}: local shard of shape {tuple(local.shape)} does not match the {box.sizes} that "
                          f"placements {dt.placements} give; pccheck cannot describe this layout")
    stores = all(c == 0 for c, d in zip(coord, dims) if d is None)
    return LocalPart(local, box, stores)


@dataclass(frozen=True)
class Destination:
    """Where a resharded load puts one tensor: the box this rank needs, a local buffer of that
    box, and how to turn the filled buffer into the tensor ``load_state_dict`` expects."""

    box: Box
    local: Any
    wrap: Callable[[Any], Any]


def destination_box(like: Any, global_shape: tuple[int, ...]) -> Box:
    """The box of a global tensor of ``global_shape`` that :func:`destination` lays out as
    ``like`` on this rank (nothing allocated)."""
    if is_dtensor(like) and tuple(like.shape) == tuple(global_shape):
        coord = like.device_mesh.get_coordinate()
        if coord is None:
            raise ConfigError("destination DTensor: this rank is not part of its device mesh")
        return local_box(global_shape, tuple(like.device_mesh.shape), coord, _shard_dims(like, "destination"))
    return full_box(global_shape)


def destination(like: Any, dtype: Any, global_shape: tuple[int, ...], reuse: Any = None) -> Destination:
    """A destination laid out as ``like`` (a DTensor: its mesh and placements; anything else: a
    plain tensor holding the whole ``global_shape``). Its buffer is ``reuse``'s own memory (the
    model's or optimizer's current tensor) when that has exactly this layout and dtype and is
    contiguous, so a load writes the state where it will live (no second copy in memory, no
    fresh pages to fault in); else fresh memory."""
    import torch

    if is_dtensor(like) and tuple(like.shape) == tuple(global_shape):
        from torch.distributed.tensor import DTensor

        mesh, placements = like.device_mesh, like.placements
        box = destination_box(like, global_shape)
        local = None
        if (is_dtensor(reuse) and reuse.dtype == dtype and tuple(reuse.shape) == tuple(global_shape)
                and reuse.device_mesh == mesh and tuple(reuse.placements) == tuple(placements)):
            own = reuse.to_local().detach()
            local = own if tuple(own.shape) == box.sizes and own.is_contiguous() else None
        if local is None:
            local = torch.empty(box.sizes, dtype=dtype, device=like.to_local().device)
        stride = torch.empty(global_shape, dtype=dtype, device="meta").stride()

        def wrap(t: Any) -> Any:
            return DTensor.from_local(t, mesh, placements, run_check=False, shape=torch.Size(global_shape),
                                      stride=stride)
        return Destination(box, local, wrap)
    if (isinstance(reuse, torch.Tensor) and not is_dtensor(reuse) and reuse.dtype == dtype
            and tuple(reuse.shape) == tuple(global_shape) and reuse.is_contiguous()):
        return Destination(full_box(global_shape), reuse.detach(), lambda t: t)
    device = like.device if isinstance(like, torch.Tensor) and not is_dtensor(like) else "cpu"
    return Destination(full_box(global_shape), torch.empty(global_shape, dtype=dtype, device=device), lambda t: t)
