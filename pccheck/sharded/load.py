"""Resharded load: a sharded checkpoint of W ranks into a job of W' ranks, any W' >= 1.

Every loading rank finds the same newest complete set (``index.find_sets``: the directory must be
visible to every loading rank), then builds each tensor it needs: for a model entry the layout of
the model's own tensor (a DTensor: the box its placements give this rank; a plain tensor: the
whole), for optimizer state the layout of its parameter (same global shape) or the whole. Each
saved chunk that overlaps that box is read once, checked against its crc32c, and its overlap
put in place.

Where the model's tensor, or the optimizer's current state tensor, already has the layout being
built, the chunks are read straight into its memory: a load then holds no second
copy of the state and faults in no fresh pages (the first touch of fresh memory costs as much as
the read on these machines). Every shape is checked before the first byte is read, so a wrong
model (a ConfigError) leaves it untouched. A set that fails (a damaged chunk on any rank: the
ranks vote after building) may have been partly read into those tensors; the group then falls
back together to the next older set, which writes every one of them again. Only if no set
loads are they left holding parts of a damaged one, and the NoCheckpointError says so. The
optimizer's hyperparameters, the RNGs and the extra state are applied after the vote only.

Per-rank state (RNG, extra_state) comes from the saved rank of the same number; a loading rank
beyond the saved world size takes rank 0's extra state and keeps its own RNG state.
"""

from __future__ import annotations

import logging
from pathlib import Path
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..arrays import TORCH_ONLY, torch_dtype
from ..errors import ConfigError, CorruptCheckpointError, NoCheckpointError
from ..persist.recovery import Restored
from .dtensor import Destination, destination, destination_box, is_dtensor
from .geometry import Box, numel, overlap
from .index import CheckpointSet, Chunk, Member, TensorInfo, check_visible, find_sets

__all__ = ["Decode", "load_sharded", "newest_is_sharded", "build_state", "needed_arrays"]

# How a tree's top level becomes the nested state: ``decode(top, arrays, as_tensor, as_shard)``.
# The tree encoding belongs to the layer above (pccheck.state.torch_state.nested_state), so the
# caller hands it down.
Decode = Callable[[Mapping[str, Any], Mapping[str, Any], Callable[[str], Any], Callable[[str], Any]], dict[str, Any]]

log = logging.getLogger("pccheck")


def newest_is_sharded(path: Path) -> bool:
    """True if the newest complete set under ``path`` was written as shards (FORMAT.md §9)."""
    sets = find_sets(path)
    return bool(sets) and sets[0].sharded


def load_sharded(path: Path | str, group: Any, state: Any, map_location: Any = None, *, decode: Decode,
                 sets: list[Any] | None = None) -> Restored:
    """Loads the newest complete set that every loading rank can build; with ``state`` (a
    :class:`pccheck.state.torch_state.TorchState`) puts it in place. ``group``: the loading job's
    :class:`pccheck.group.distributed.Group`, or None for one process. ``decode``: the tree's
    decoding (:data:`Decode`). Collective in a group: every rank reaches each vote, whatever it met
    (a ConfigError on any rank is raised on all). ``sets``: the candidates, newest first, the same
    on every rank, when they are not the local sets under ``path`` (the remote tier's
    :class:`pccheck.tiers.remote.sharded.RemoteSet`: the CheckpointSet interface, every rank
    reaching every member's data)."""
    rank = group.rank if group is not None else 0
    problems: list[str] = []
    touched = False  # a failed set's chunks were read into the model's or optimizer's tensors
    for cand in (sets if sets is not None else _candidates(Path(path), group)):
        built, why = None, None
        try:
            if sets is None:
                check_visible(Path(path), cand.world_size)
            built = _build(cand, rank, state, map_location, decode)
        except CorruptCheckpointError as exc:
            why = ("corrupt", str(exc))
        except ConfigError as exc:
            why = ("config", str(exc))
        finally:
            cand.close()
        touched = touched or cand.bytes_read > 0
        failed = _failures(group, why)
        if failed:
            problems.append(f"step {cand.step}: {'; '.join(failed)}")
            log.warning("pccheck: sharded checkpoint of step %d cannot be loaded (%s); trying an older one",
                        cand.step, "; ".join(failed))
            continue
        assert built is not None
        nested, member = built
        if state is not None:
            if rank >= cand.world_size:
                nested.pop("rng", None)  # no saved rank of this number: this rank keeps its own streams
            state.apply(nested)
        nested["step"] = cand.step
        if cand.world_size != (group.world_size if group is not None else 1):
            log.info("pccheck: resharded step %d from %d ranks to %d; this rank read %d bytes", cand.step,
                     cand.world_size, group.world_size if group is not None else 1, cand.bytes_read)
        man = member.manifest
        return Restored(cand.step, nested, man.metadata, man.counter, member.image.generation, member.slot,
                        member.image.path, {}, man.tree, man.epoch, bytes_read=cand.bytes_read, tier=cand.tier)
    detail = f" ({'; '.join(problems)})" if problems else ""
    partly = (" The model's and optimizer's tensors may hold parts of a damaged checkpoint: initialise them again "
              "before training from scratch." if touched and state is not None else "")
    raise NoCheckpointError(f"no sharded checkpoint under {path} could be loaded{detail}.{partly}")


def _candidates(path: Path, group: Any) -> list[CheckpointSet]:
    """The complete sets, newest first; in a group, only those every rank found."""
    sets = find_sets(path)
    if group is not None:
        import torch.distributed as dist

        everyone: list[Any] = [None] * group.world_size
        dist.all_gather_object(everyone, [(s.epoch, s.step, s.world_size) for s in sets], group=group.pg)
        common = set.intersection(*(set(map(tuple, keys)) for keys in everyone))
        sets = [s for s in sets if (s.epoch, s.step, s.world_size) in common]
    return sets


def _failures(group: Any, why: tuple[str, str] | None) -> list[str]:
    """Every rank's damage found in the candidate (empty: all built it); a ConfigError any rank
    met (a wrong model, a directory it cannot see) is raised on every rank."""
    everyone: list[Any] = [why]
    if group is not None:
        import torch.distributed as dist

        everyone = [None] * group.world_size
        dist.all_gather_object(everyone, why, group=group.pg)
    config = [(r, w[1]) for r, w in enumerate(everyone) if w and w[0] == "config"]
    if config:
        r, msg = config[0]
        raise ConfigError(msg if group is None or r == group.rank else f"rank {r}: {msg}")
    return [f"rank {r}: {w[1]}" if group is not None else w[1] for r, w in enumerate(everyone) if w]


def _wanted(tree: Mapping[str, Any], state: Any) -> dict[str, Any]:
    """The top level of a tree that a load builds: without the shards section (not state), and
    without the optimizer's when there is no optimizer to put it into (not read at all)."""
    wanted = {k: v for k, v in tree.items() if k != "shards"}
    if state is not None and state.optimizer is None:
        wanted.pop("optimizer", None)
    return wanted


def needed_arrays(cand: CheckpointSet, rank: int, state: Any) -> set[tuple[int, str]]:
    """(member rank, array) of every saved chunk :func:`build_state` reads for ``rank``: what a
    loader holding only some members' arrays (the memory tier: its own slot) must fetch first.
    Nothing is allocated or read; a tree naming a tensor no shards section lists raises."""
    if not cand.sharded:
        return set()
    tree = cand.members[rank if rank < cand.world_size else 0].manifest.tree
    tensors, layouts = cand.tensors(), _Layouts(state)
    fqns = list(tensors) if "model" not in tree else _shard_leaves(_wanted(tree, state))
    out = set()
    for fqn in fqns:
        info = tensors.get(fqn)
        if info is None:
            raise CorruptCheckpointError(f"the tree names tensor {fqn!r}, which no rank's shards section lists")
        box = destination_box(layouts.like(fqn, info.shape), info.shape)
        out |= {(c.rank, c.array) for c in info.chunks if (ov := overlap(c.box, box)) is not None and numel(ov)}
    return out


def build_state(cand: CheckpointSet, rank: int, state: Any, map_location: Any,
                decode: Decode) -> tuple[dict[str, Any], Any]:
    """The nested state of ``cand`` as ``rank`` needs it (tensors built, possibly into the
    model's and optimizer's own memory; nothing applied), and the member whose tree it follows."""
    return _build(cand, rank, state, map_location, decode)


def _build(cand: CheckpointSet, rank: int, state: Any, map_location: Any,
           decode: Decode) -> tuple[dict[str, Any], Any]:
    """The nested state of ``cand`` as this rank needs it (tensors built, nothing applied), and
    the member whose tree it follows."""
    import torch

    member = cand.members[rank if rank < cand.world_size else 0]
    tree = member.manifest.tree
    tensors = cand.tensors() if cand.sharded else {}
    layouts = _Layouts(state)

    def as_tensor(name: str) -> Any:  # this member's own array: per-rank state, or a whole tensor
        entry = member.entries[name][0]
        t = torch.from_numpy(cand.read(member.rank, name))
        t = t.view(torch_dtype(entry.torch_dtype)) if entry.torch_dtype else t
        like = layouts.like(name, tuple(t.shape))
        if is_dtensor(like):  # an unsharded checkpoint going into a sharded model: this rank's box
            dest = destination(like, t.dtype, tuple(t.shape))
            dest.local.copy_(t[dest.box.slices()])
            return dest.wrap(dest.local)
        return t.to(map_location) if map_location is not None else t

    def place(fqns: list[str]) -> dict[str, Destination]:
        """Every destination, before a byte is read: a wrong shape raises here, model untouched."""
        dests, owners = {}, set()
        for fqn in fqns:
            info = tensors.get(fqn)
            if info is None:
                raise CorruptCheckpointError(f"the tree names tensor {fqn!r}, which no rank's shards section lists")
            like = layouts.like(fqn, info.shape)
            dest = destination(like, torch_dtype(info.dtype), info.shape, layouts.current(fqn))
            if dest.local.numel() and dest.local.data_ptr() in owners:  # tied tensors: one fill per memory
                dest = destination(like, torch_dtype(info.dtype), info.shape)
            owners.add(dest.local.data_ptr())
            dests[fqn] = dest
        return dests

    def build(fqns: list[str]) -> dict[str, Any]:
        """Every tensor of ``fqns``, its chunks read in file order (see _read_all)."""
        dests = place(fqns)
        _read_all(cand, _plan(cand, tensors, dests))
        out = {fqn: dest.wrap(dest.local) for fqn, dest in dests.items()}
        return {f: t.to(map_location) for f, t in out.items()} if map_location is not None and state is None else out

    if "model" not in tree:  # written by pccheck.dcp.Writer: a flat set of tensors, no model tree
        if state is not None:
            raise ConfigError("this checkpoint was written through pccheck.dcp.Writer (no model tree): load it "
                              "with torch.distributed.checkpoint.load(..., storage_reader=pccheck.dcp.Reader(path)), "
                              "or with pccheck.load_latest(path) without model=")
        return build(list(tensors)), member
    wanted = _wanted(tree, state)
    built = build(sorted(_shard_leaves(wanted)))  # every tensor the tree refers to, before the rest
    nested = decode(wanted, _MemberArrays(cand, member), as_tensor, built.__getitem__)
    return nested, member


# Threads reading one rank's chunks. Invariant: they take the chunks in file order (member by
# member, front to back), so the disk sees a few neighbouring requests of one stream at a time:
# buffered reads then run at the device's sequential rate (the page cache's readahead follows
# each file), where chunks taken tensor by tensor scatter over both member files
# (1.4-1.8 s cold against 0.7-0.8 s for the same bytes read in order).
READ_THREADS = 4


@dataclass(frozen=True)
class _Read:
    """One saved chunk this rank reads, and the destination its overlap goes into."""

    position: tuple[int, int]  # (member rank, file offset): the order reads are handed out in
    info: TensorInfo
    chunk: Chunk
    part: Box                  # the overlap of the chunk and the destination's box
    dest: Destination


def _plan(cand: CheckpointSet, tensors: Mapping[str, TensorInfo], dests: Mapping[str, Destination]) -> list[_Read]:
    """Every chunk read that fills ``dests``, in file order; CorruptCheckpointError, before a byte
    is read, if the saved chunks leave part of a destination box uncovered."""
    reads = []
    for fqn, dest in dests.items():
        info, covered = tensors[fqn], 0
        for chunk in info.chunks:
            ov = overlap(chunk.box, dest.box)
            if ov is None or numel(ov) == 0:
                continue
            reads.append(_Read(cand.position(chunk.rank, chunk.array), info, chunk, ov, dest))
            covered += numel(ov)
        if covered < numel(dest.box):
            raise CorruptCheckpointError(f"tensor {fqn!r}: the saved chunks cover {covered} of the "
                                         f"{numel(dest.box)} elements this rank needs (a rank's shards are missing)")
    reads.sort(key=lambda r: r.position)
    return reads


def _read_all(cand: CheckpointSet, reads: list[_Read]) -> None:
    """Runs ``reads`` on up to READ_THREADS threads, handed out in list order (preadv, crc32c and
    the copies release the GIL, so the reads overlap); the first error is raised and the reads
    not started yet are dropped."""
    if len(reads) < 2:
        for r in reads:
            _fill(cand, r)
        return
    pool = ThreadPoolExecutor(max_workers=cand.read_threads or READ_THREADS, thread_name_prefix="pccheck-reshard")
    try:
        for _ in pool.map(lambda r: _fill(cand, r), reads):  # the executor's queue is FIFO: file order
            pass
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _shard_leaves(node: Any) -> set[str]:
    """The fqns of every ``{"S": fqn}`` leaf under ``node`` (a tree in torch_state's encoding)."""
    found: set[str] = set()
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, dict):
            if len(x) == 1 and isinstance(x.get("S"), str):
                found.add(x["S"])
            else:
                stack.extend(x.values())
    return found


class _MemberArrays(Mapping[str, Any]):
    """One member's arrays by name, each read (and crc-checked) when the tree asks for it."""

    def __init__(self, cand: CheckpointSet, member: Member) -> None:
        self.cand, self.member, self.names = cand, member, list(member.entries)

    def __getitem__(self, name: str) -> Any:
        if name not in self.member.entries:
            raise KeyError(name)
        return self.cand.read(self.member.rank, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class _Layouts:
    """The tensor each fqn goes into, whose layout the destination copies (FORMAT.md §9 fqns)."""

    def __init__(self, state: Any) -> None:
        self.model = state.model.state_dict() if state is not None else {}
        self.params = ([p for g in state.optimizer.param_groups for p in g["params"]]
                       if state is not None and state.optimizer is not None else [])
        self.opt_state = state.optimizer.state if state is not None and state.optimizer is not None else {}

    def current(self, fqn: str) -> Any:
        """The model's or optimizer's current tensor that ``fqn`` replaces on apply (a load may
        read into its memory: see the module docstring), or None."""
        head, _, rest = fqn.partition("/")
        if head == "model":
            return self.model.get(rest)
        parts = rest.split("/")
        if head == "optimizer" and len(parts) == 3 and parts[0] == "state" and parts[1].isdigit():
            i = int(parts[1])
            return self.opt_state.get(self.params[i], {}).get(parts[2]) if i < len(self.params) else None
        return None

    def like(self, fqn: str, shape: tuple[int, ...]) -> Any:
        """The tensor whose layout tensor ``fqn`` of global ``shape`` takes, or None (whole)."""
        head, _, rest = fqn.partition("/")
        if head == "model" and rest in self.model:
            like = self.model[rest]
            if tuple(like.shape) != shape:
                raise ConfigError(f"model tensor {rest!r}: the checkpoint holds shape {list(shape)}, the model "
                                  f"has {list(like.shape)}; load into a model built with the same shapes")
            return like
        parts = rest.split("/")
        if head == "optimizer" and len(parts) == 3 and parts[0] == "state" and parts[1].isdigit():
            i = int(parts[1])
            if i < len(self.params) and tuple(self.params[i].shape) == shape:
                return self.params[i]  # state shaped like its parameter is laid out like it
        return None


def _fill(cand: CheckpointSet, r: _Read) -> None:
    """Puts the overlap of one saved chunk into its destination. A chunk that lies wholly inside
    the box on a contiguous stretch of the buffer (a Shard(0) chunk going into a rank holding the
    same or more rows: the usual case) is read straight into it; any other is read into a buffer
    of its own and its overlap copied (the whole chunk is read either way: its crc32c covers all
    of it). Reads of one destination touch disjoint regions, so they may run concurrently."""
    import torch

    chunk, dest = r.chunk, r.dest
    region = dest.local.detach()[r.part.slices(dest.box.offsets)]
    if r.part == chunk.box and region.device.type == "cpu" and region.is_contiguous():
        cand.read(chunk.rank, chunk.array, into=region.view(-1).view(torch.uint8).numpy())
        return
    src = torch.from_numpy(cand.read(chunk.rank, chunk.array))
    if r.info.dtype in TORCH_ONLY:
        src = src.view(torch_dtype(r.info.dtype))
    region.copy_(src[r.part.slices(chunk.box.offsets)])
