"""One rank of a :mod:`bench.modes.sharded` job: ``python bench/modes/sharded_child.py SPEC`` (one JSON object).

The workload: ``blocks`` x ``Linear(d, d, bias=False)``, each block and the root wrapped with FSDP2
``fully_shard`` on a CPU mesh of ``world`` ranks, AdamW (its state made by one step), d chosen so that
parameters + both moments hold ``nbytes`` over the whole job. **The GPU is emulated**: a training
step is ``optimizer.step()`` over the rank's shards with the gradients set once (no forward: on 2
CPUs the gloo all-gathers of a 1 GiB model would time the interconnect, not the checkpoint).

Roles (``spec["role"]``):

``save``  ``saves`` checkpoints (pccheck's once its pool is faulted in: ``_pool_touched``), each: a
          step, the save call (``block_s``: until the call returns, plus pccheck's copy-on-write
          wait inside the next step), the next step, then wait until it
          is durable (``durable_s``: from the call). Systems: ``pccheck`` (``Checkpointer``, N = 2),
          ``pccheck_dcp`` (``dcp.async_save`` with ``pccheck.dcp.Writer``), ``dcp_fs``
          (``dcp.async_save`` with ``FileSystemWriter``, a directory per save).
``floor`` no model: the raw read of exactly the bytes this loading rank's pccheck load reads
          (``spec["ranges"]``, from the parent), cold, by each of a few raw methods
          (``FLOOR_METHODS``): the physical floor of that load (``load_s``: the fastest).
``load``  the newest checkpoint of the system into a fresh model of ``world`` ranks (the parent made
          its files cold): ``load_s``. ``pccheck``: ``load_latest``; ``pccheck_dcp`` /
          ``dcp_fs``: ``dcp.load`` with ``pccheck.dcp.Reader`` / ``FileSystemReader`` into
          ``get_state_dict``'s dicts, then ``set_state_dict``.

Prints one JSON line per rank (its timings), or ``{"error": ...}`` with exit status 1.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def block_width(nbytes: int, blocks: int) -> int:
    """d such that ``blocks`` x d^2 float32 parameters and AdamW's two moments hold ``nbytes``."""
    return max(8, int((nbytes / (12 * blocks)) ** 0.5))


def build(spec: dict[str, Any]) -> tuple[Any, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    d = block_width(spec["nbytes"], spec["blocks"])
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(spec["blocks"])])
    mesh = init_device_mesh("cpu", (spec["world"],))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.step()  # AdamW's state exists from here on
    return model, opt


def _sync() -> None:
    """Every rank starts the timed call together."""
    import torch.distributed as dist

    dist.barrier()


def save(spec: dict[str, Any], model: Any, opt: Any) -> dict[str, Any]:
    system, root = spec["system"], Path(spec["dir"])
    runs = []
    if system == "pccheck":
        import pccheck

        ck = pccheck.Checkpointer(model, opt, path=root, interval=1, max_concurrent=2)
        pool_s = _pool_touched(ck)
        for i in range(1, spec["saves"] + 1):
            opt.step()
            _sync()
            t0 = time.perf_counter()
            ck.checkpoint(i)
            call = time.perf_counter() - t0
            opt.step()  # waits (soft copy-on-write) for what is not copied yet
            ck.wait()
            durable = time.perf_counter() - t0
            stats = ck.stats().as_dict()["checkpoints"][-1]
            runs.append({"call_s": call, "block_s": call + stats["cow_wait_s"], "durable_s": durable,
                         **{k: stats[k] for k in ("prepare_s", "cow_wait_s", "backpressure_s", "copy_s")}})
        ck.close()
        return {"runs": runs, "pool_touched_s": pool_s}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    for i in range(1, spec["saves"] + 1):
        opt.step()
        msd, osd = get_state_dict(model, opt)
        writer = _writer(system, root, i)
        _sync()
        t0 = time.perf_counter()
        fut = dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer)
        call = time.perf_counter() - t0
        opt.step()
        fut.result()
        durable = time.perf_counter() - t0
        runs.append({"call_s": call, "block_s": call, "durable_s": durable})
    return {"runs": runs}


def _pool_touched(ck: Any, timeout: float = 120.0) -> float:
    """Seconds waited, after the Checkpointer is built, until it is ready (``Checkpointer.wait_ready``:
    the store open and its DRAM chunk pool faulted in).

    The constructor opens the store and starts the pool's first touch on a native thread, off the
    training thread (engine.cpp); a training job runs its first ``interval`` steps meanwhile. This
    bench has no such steps (its saves follow one another at once), so without this wait its first
    two saves would wait for the prefaulter (back-pressure 1.1-1.9 s and 0.2-0.4 s on the 2-vCPU
    runs), which no later checkpoint of a job pays. Untimed."""
    t0 = time.perf_counter()
    if not ck.wait_ready(timeout):
        raise RuntimeError(f"the Checkpointer was not ready within {timeout:g} s")
    return time.perf_counter() - t0


def _writer(system: str, root: Path, i: int) -> Any:
    if system == "pccheck_dcp":
        import pccheck.dcp

        return pccheck.dcp.Writer(root)
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(root / f"save-{i}")


def load(spec: dict[str, Any], model: Any, opt: Any) -> dict[str, Any]:
    system, root = spec["system"], Path(spec["dir"])
    import torch.distributed.checkpoint.state_dict  # imports are not part of a load: every system's come first
    import pccheck
    import pccheck.dcp  # noqa: F401
    _sync()
    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    if system == "pccheck":
        r = pccheck.load_latest(root, model=model, optimizer=opt)
        extra = {"step": r.step, "bytes_read": r.bytes_read}
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        if system == "pccheck_dcp":
            reader: Any = pccheck.dcp.Reader(root)
        else:
            from torch.distributed.checkpoint import FileSystemReader

            reader = FileSystemReader(sorted(root.glob("save-*"), key=lambda p: int(p.name[5:]))[-1])
        dcp.load(sd, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return {"load_s": time.perf_counter() - t0, **extra}


# The raw read methods of the floor: (name, threads, piece). Each reads exactly this rank's byte
# ranges, buffered, the threads taking the ranges in file order, in pieces of at most ``piece``
# bytes. No one method is fastest on every disk: on the 2-vCPU VM's virtio disk,
# 4 threads x 8 MiB (once the floor's only method) went out as 0.7-1.0 MB requests
# (/sys/block/vda/stat), 2-3x as many as the loads' (pccheck 2.5-2.8 MB, DCP 1.9-2.5 MB), and took
# 1.2-1.4 s where 2 threads took 0.8-0.9 s (a posix_fadvise WILLNEED of every range first went out
# as 0.8-1.0 MB requests too: not a method here). The floor is the fastest of them.
FLOOR_METHODS: tuple[tuple[str, int, int], ...] = (
    ("1 thread, whole ranges", 1, 64 << 20),
    ("2 threads x 8 MiB", 2, 8 << 20),
    ("4 threads x 8 MiB", 4, 8 << 20),
)


def _raw_read(ranges: list[tuple[str, int, int]], threads: int, piece: int) -> tuple[float, int]:
    """Seconds to read ``ranges`` (see FLOOR_METHODS) into buffers touched beforehand (no checksum,
    no copy, no tensors), timed from a barrier of the loading ranks; the bytes read."""
    import itertools
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor

    fds = {p: os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in sorted({p for p, _, _ in ranges})}
    bufs = [memoryview(bytearray(b"\1" * piece)) for _ in range(threads)]  # touched already
    local, handed = threading.local(), itertools.count()

    def read(r: tuple[str, int, int]) -> int:
        path, offset, nbytes = r
        if not hasattr(local, "buf"):
            local.buf = bufs[next(handed)]
        done = 0
        while done < nbytes:
            n = os.preadv(fds[path], [local.buf[:min(piece, nbytes - done)]], offset + done)
            if n <= 0:
                raise OSError(f"{path}: short read at {offset + done}")
            done += n
        return done

    try:
        with ThreadPoolExecutor(threads) as pool:
            _sync()
            t0 = time.perf_counter()
            total = sum(pool.map(read, ranges))  # the executor's queue is FIFO: file order
            elapsed = time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
    return elapsed, total


def floor(spec: dict[str, Any]) -> dict[str, Any]:
    """The raw read of exactly the byte ranges ``spec["ranges"]`` (this loading rank's chunks, in
    file order) by each of FLOOR_METHODS in turn, the checkpoint made cold before each (rank 0,
    by the parent's ``make_cold``, while the others wait): ``load_s`` the fastest method's
    seconds, ``methods`` every method's."""
    from bench.modes.sharded import make_cold

    ranges = [(str(p), int(o), int(n)) for p, o, n in spec["ranges"]]
    methods, total = {}, 0
    for name, threads, piece in FLOOR_METHODS:
        if spec["rank"] == 0:
            make_cold(Path(spec["dir"]))
        _sync()
        methods[name], total = _raw_read(ranges, threads, piece)
    return {"load_s": min(methods.values()), "methods": methods, "bytes_read": total}


def main(spec: dict[str, Any]) -> int:
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{spec['init']}", rank=spec["rank"],
                                world_size=spec["world"])
        if spec["role"] == "floor":
            out = floor(spec)
        else:
            model, opt = build(spec)
            out = save(spec, model, opt) if spec["role"] == "save" else load(spec, model, opt)
        dist.destroy_process_group()
        print(json.dumps({"rank": spec["rank"], **out}), flush=True)
        return 0
    except Exception as exc:  # reported to the parent, which marks the system failed and goes on
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    sys.path[:1] = _spec["path_first"]  # not bench/ (this script's folder): the parent's pccheck first
    sys.path.append(_spec["root"])
    sys.exit(main(_spec))
