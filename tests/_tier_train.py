"""One rank of a small DDP job run by torchrun, for the memory tier tests (two simulated nodes).

Usage: torchrun ... _tier_train.py BASE STEPS [--resume] [--final] [--sleep S] [--disk-interval K]
                                      [--keep-last K] [--replicas M] [--die-mid-send NODE:STEP] [--die-mid-serve NODE] [--fsdp]
                                      [--frozen] [--touch-frozen STEP] [--incremental]
Node n (torchrun's GROUP_RANK) keeps its disk store under BASE/node-n/disk and its memory tier
under BASE/node-n/mem (``MemoryOptions(every=1, keep_last=K, replicas=M)``, K from --keep-last,
default 0, M from --replicas, default 2). With
--single (python, no torchrun): one process, BASE/node-0, no replicas.
Prints "PID p", "START step tier" and "LOSS step value" lines, flushed. --fsdp: the model is
FSDP2 (``fully_shard`` on a CPU mesh of both ranks) with a buffer, instead of DDP; --final then
saves its full tensors (gathered). --frozen: a frozen base (two Linear layers, about 1 MiB,
requires_grad=False) before a small trained head; --touch-frozen STEP changes one frozen weight
through ``.data`` after that step's update (every rank alike). --incremental: ``incremental=True``
(the disk tier writes, the memory tier copies and sends, only changed arrays); at the end each rank
prints "WIRE <json>", the bytes pccheck's wire sent and received (wire.wire_bytes).
--digest: prints "DIGEST step sha256" of the model's and optimizer's state after each step's
checkpoint call, and "RESTORED step sha256" of the state a resume loaded.

Faults (either flag makes both nodes send in 4 KiB wire chunks, so a transfer has many chunks):
--die-mid-send NODE:STEP: the rank of NODE SIGKILLs itself after sending the first wire chunk
of its replica of STEP (prints "MIDSEND STEP" first). --die-mid-serve NODE: the rank of NODE
SIGKILLs itself after sending the first chunk of a replica it serves to a restoring peer (prints
"MIDSERVE"); a rank whose load_latest then fails prints "RESTOREFAILED <error type>" and
"UNTOUCHED <whether its model still holds its initial values>", and exits 3.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from _leave import leave


def _faults(argv: list[str], node: int) -> None:
    """Test instrumentation: the faults of the module docstring, patched into the memory tier."""
    from pccheck.tiers.memory import nearest, replicate, wire

    wire.WIRE_CHUNK = replicate.WIRE_CHUNK = 4096  # every node alike: the header's chunk count agrees
    if "--die-mid-send" in argv:
        who, step = map(int, argv[argv.index("--die-mid-send") + 1].split(":"))
        if node == who:
            sending: dict[str, int] = {}
            send, send_bytes = replicate.Replicator._send, replicate.send_bytes

            def _send(self, info, seq):  # noqa: ANN001, ANN202
                sending["step"] = info.step
                return send(self, info, seq)

            def _send_bytes(pg, dst, view, tag, timeout):  # noqa: ANN001, ANN202
                if sending.get("step") == step:
                    send_bytes(pg, dst, view[:wire.WIRE_CHUNK], tag, timeout)
                    print(f"MIDSEND {step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                send_bytes(pg, dst, view, tag, timeout)

            replicate.Replicator._send, replicate.send_bytes = _send, _send_bytes
    if "--die-mid-serve" in argv and node == int(argv[argv.index("--die-mid-serve") + 1]):
        serve = nearest.send_bytes

        def _serve(pg, dst, view, tag, timeout):  # noqa: ANN001, ANN202
            if view.nbytes > wire.WIRE_CHUNK:  # the replica's data, not its manifest
                serve(pg, dst, view[:wire.WIRE_CHUNK], tag, timeout)
                print("MIDSERVE", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            serve(pg, dst, view, tag, timeout)

        nearest.send_bytes = _serve


def _digest(model: torch.nn.Module, optim: torch.optim.Optimizer) -> str:
    """sha256 over every tensor of the model's and the optimizer's state, in order."""
    import hashlib

    h = hashlib.sha256()
    for v in [*model.state_dict().values(), *(t for s in optim.state_dict()["state"].values() for t in s.values())]:
        if isinstance(v, torch.Tensor):
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str]) -> None:
    import pccheck

    base, steps = argv[0], int(argv[1])
    pause = float(argv[argv.index("--sleep") + 1]) if "--sleep" in argv else 0.0
    disk_interval = int(argv[argv.index("--disk-interval") + 1]) if "--disk-interval" in argv else 4
    keep_last = int(argv[argv.index("--keep-last") + 1]) if "--keep-last" in argv else 0
    replicas = int(argv[argv.index("--replicas") + 1]) if "--replicas" in argv else 2
    single = "--single" in argv
    node = 0 if single else int(os.environ["GROUP_RANK"])
    disk, mem = f"{base}/node-{node}/disk", f"{base}/node-{node}/mem"
    print(f"PID {os.getpid()}", flush=True)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    if not single:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = 0 if single else dist.get_rank()
    torch.manual_seed(7)
    if "--frozen" in argv:  # a frozen base (about 1 MiB) and a trained head (about 33 KiB)
        model = torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                    torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(512, 16))
        for layer in (model[0], model[2]):
            layer.requires_grad_(False)
    else:
        model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                    torch.nn.Linear(128, 16))
    touch = int(argv[argv.index("--touch-frozen") + 1]) if "--touch-frozen" in argv else None
    fsdp = "--fsdp" in argv
    if fsdp:  # DTensor parameters (Shard(0)); the buffer and AdamW's steps are plain tensors: rank 0 stores them
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model.register_buffer("scale", torch.tensor([0.5, 2.0]))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[3], mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    if "--die-mid-send" in argv or "--die-mid-serve" in argv:
        _faults(argv, node)
    start, tier = 0, "none"
    if "--resume" in argv:
        initial = [t.detach().clone() for t in model.state_dict().values()]
        try:
            r = pccheck.load_latest(disk, model=model, optimizer=optim, memory_dir=mem)
            start, tier = r.step, r.tier
        except pccheck.NoCheckpointError as exc:
            print(f"NOCHECKPOINT {exc}", flush=True)
        except pccheck.PCCheckError as exc:
            same = all(torch.equal(a, b) for a, b in zip(initial, model.state_dict().values()))
            print(f"RESTOREFAILED {type(exc).__name__} {exc}", flush=True)
            print(f"UNTOUCHED {same}", flush=True)
            sys.stdout.flush()
            os._exit(3)
    if start == 0:
        torch.manual_seed(1000 + rank)  # each rank's dropout stream; on resume it comes from the checkpoint
    ddp = model if single or fsdp else torch.nn.parallel.DistributedDataParallel(model)
    memory = pccheck.MemoryOptions(every=1, dir=mem, replicas=1 if single else replicas, keep_last=keep_last)
    ck = pccheck.Checkpointer(model, optim, path=disk, interval=disk_interval, max_concurrent=2,
                              chunk_size=64 << 10, memory=memory, incremental="--incremental" in argv)
    print(f"START {start} {tier}", flush=True)
    digest = "--digest" in argv
    if digest and start:
        print(f"RESTORED {start} {_digest(model, optim)}", flush=True)
    for step in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(32, 16, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), torch.cos(x))
        if fsdp:
            loss = loss * model.scale[0]
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if step == touch:
            with torch.no_grad():
                model[2].weight.data[3, 5] += 0.25  # a frozen weight changed outside the optimizer
        ck.maybe_checkpoint(step)
        if digest:
            print(f"DIGEST {step} {_digest(model, optim)}", flush=True)
        print(f"LOSS {step} {loss.item()!r}", flush=True)
        time.sleep(pause)
    ck.close()
    print(f"TIERS {ck.stats().tiers}", flush=True)
    if "--incremental" in argv:
        import json

        from pccheck.tiers.memory import wire

        print(f"WIRE {json.dumps(wire.wire_bytes())}", flush=True)
        print(f"TIERJSON {json.dumps(ck.stats().tiers)}", flush=True)
    if "--final" in argv:
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        torch.save(full, f"{base}/final-{rank}.pt")
    if single:
        sys.stdout.flush()
        os._exit(0)
    leave()


if __name__ == "__main__":
    main(sys.argv[1:])
