"""One rank of a small sharded job for tests/test_sharded.py (gloo on CPU, FileStore rendezvous).

Usage: python _sharded_child.py MODE KIND PATH RANK WORLD INIT_FILE OUT [STEPS] [--no-compare]

KIND: "fsdp" (FSDP2 ``fully_shard`` on a CPU mesh: uneven dims, a tied embedding, a replicated
buffer, AdamW) or "dtensor" (parameters made DTensors by hand: Shard(0) and Replicate(), SGD with
momentum). WORLD 1 builds the model unsharded, without a process group.

MODE
  save     train STEPS steps with a Checkpointer (interval 3), then checkpoint step STEPS and
           wait; rank 0 writes the gathered full state (model + optimizer, by fqn) to OUT.
  load     load_latest; rank 0 compares the gathered full state with OUT (torch.equal, every
           tensor), then every rank trains 2 more steps and checkpoints them. Prints
           "LOADED step bytes_read" and "EQUAL".
  train    trains until killed, checkpointing every step (the kill test).
  partial  builds a model with a Partial DTensor parameter: Checkpointer must refuse it.
  shape    loads into a model with a different global shape: load_latest must refuse it.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from _leave import leave


def build(kind: str, world: int, wide: int = 7) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    if kind == "fsdp":
        model = _Net(wide)
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            fully_shard(model.blocks[0], mesh=mesh)
            fully_shard(model.blocks[2], mesh=mesh)
            fully_shard(model, mesh=mesh)  # the tied embedding/head live in the root unit
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Linear(9, 5))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        for name, p in list(model[0].named_parameters()):
            setattr(model[0], name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        for name, p in list(model[1].named_parameters()):
            setattr(model[1], name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
    return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, nesterov=True)


class _Net(torch.nn.Module):
    def __init__(self, wide: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(13, 10)
        self.blocks = torch.nn.Sequential(torch.nn.Linear(10, wide), torch.nn.LayerNorm(wide), torch.nn.Linear(wide, 10))
        self.head = torch.nn.Linear(10, 13, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor([0.5, 1.0, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(x)) * self.scale[1])


def step(kind: str, model: torch.nn.Module, opt: torch.optim.Optimizer, s: int) -> float:
    g = torch.Generator().manual_seed(s)  # the same batch on every rank and world size
    if kind == "fsdp":
        x = torch.randint(0, 13, (8,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), torch.roll(x, 1))
    else:
        x = torch.randn(4, 6, generator=g)

        def full(t: torch.Tensor) -> torch.Tensor:  # differentiable gather of a DTensor parameter
            return t.full_tensor() if hasattr(t, "full_tensor") else t

        h = torch.nn.functional.linear(x, full(model[0].weight), full(model[0].bias))
        loss = (torch.nn.functional.linear(h, full(model[1].weight), full(model[1].bias)) ** 2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss)


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer, world: int) -> dict[str, torch.Tensor]:
    """Model and optimizer state gathered to full tensors, flat by fqn (collective when world > 1)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True) if world > 1 else None
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, opt, options=opts)
    flat = {f"model.{k}": v for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            flat[f"optim.{fqn}.{k}"] = v
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in flat.items()}


def main(argv: list[str]) -> None:
    import pccheck

    mode, kind, path, rank, world, init_file, out = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4]), \
        argv[5], argv[6]
    steps = int(argv[7]) if len(argv) > 7 and argv[7].isdigit() else 4
    compare = "--no-compare" not in argv
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    if mode == "partial":
        _partial(world)
    elif mode == "shape":
        model, opt = build(kind, world, wide=8)
        before = [t.detach().clone() for t in _locals(model)]
        try:
            pccheck.load_latest(path, model=model, optimizer=opt)
        except pccheck.ConfigError as exc:
            print(f"REFUSED {exc}", flush=True)
        if all(torch.equal(a, b) for a, b in zip(before, _locals(model))):
            print("UNTOUCHED", flush=True)
    else:
        model, opt = build(kind, world)
        if mode == "damaged":
            try:
                pccheck.load_latest(path, model=model, optimizer=opt)
            except pccheck.NoCheckpointError as exc:
                print(f"NOCHECKPOINT {exc}", flush=True)
        elif mode == "load":
            ptrs = [t.data_ptr() for t in _locals(model)]
            r = pccheck.load_latest(path, model=model, optimizer=opt)
            print(f"LOADED {r.step} {r.bytes_read}", flush=True)
            kept = sum(a == b.data_ptr() for a, b in zip(ptrs, _locals(model)))
            print(f"INPLACE {kept} {len(ptrs)}", flush=True)
            state = full_state(model, opt, world)
            if rank == 0 and compare:
                ref = torch.load(out, weights_only=True)
                assert sorted(ref) == sorted(state), (sorted(ref), sorted(state))
                bad = [k for k in ref if not torch.equal(ref[k], state[k])]
                assert not bad, f"differ after load: {bad}"
                print("EQUAL", flush=True)
            ck = pccheck.Checkpointer(model, opt, path=path, interval=1, max_concurrent=2)
            for s in (r.step + 1, r.step + 2):
                print(f"LOSS {s} {step(kind, model, opt, s)!r}", flush=True)
                ck.maybe_checkpoint(s)
            ck.close()
        else:
            ck = pccheck.Checkpointer(model, opt, path=path, interval=1 if mode == "train" else 3, max_concurrent=2)
            s = 0
            while mode == "train" or s < steps:
                s += 1
                step(kind, model, opt, s)
                ck.maybe_checkpoint(s)
                if s == 3 and mode == "save":  # the reference for a load that falls back to step 3
                    state = full_state(model, opt, world)
                    if rank == 0:
                        torch.save(state, out + ".3")
                print(f"STEP {s}", flush=True)
            ck.checkpoint(steps)
            ck.wait()
            state = full_state(model, opt, world)
            if rank == 0:
                torch.save(state, out)
            ck.close()
    if world > 1:
        leave()


def _locals(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's own memory of every parameter (a DTensor's local shard)."""
    return [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]


def _partial(world: int) -> None:
    import pccheck
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Linear(4, 4)
    model.weight = torch.nn.Parameter(DTensor.from_local(torch.ones(4, 4), mesh, [Partial()]))
    try:
        pccheck.Checkpointer(model, path="/nonexistent-never-created")
    except pccheck.ConfigError as exc:
        print(f"REFUSED {exc}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
