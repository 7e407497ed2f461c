"""One rank of a job whose frozen backbone and trained adapters are checkpointed with
incremental=True, for tests/test_incremental_group.py (gloo on CPU, FileStore rendezvous).

Usage: python _incr_group_child.py KIND MODE PATH RANK WORLD INIT_FILE REF [STEPS [REMOTE]]

KIND: "fsdp" (FSDP2 ``fully_shard`` of each block and the root on a CPU mesh of WORLD ranks) or
"ddp" (DistributedDataParallel). MODE "save" trains STEPS steps, checkpointing each one, and rank 0
writes the full model after each step S to REF.S and the per-checkpoint stats to REF.json; "load" builds the model from another
seed, loads the newest checkpoint (any WORLD: a resharded load for FSDP2) and rank 0 writes the
full model state it got to REF (PATH may be an s3:// URL). With REMOTE (an s3:// URL) "save" also
uploads every step there (incremental too, keeping the newest 3 remote steps), waits for each remote
commit, and each rank r writes its per-step disk and remote byte counts to REF.remote-r.json.
PCCHECK_TEST_WIDTH (default 64) sets the layers' width.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from _leave import leave

WIDTH = int(os.environ.get("PCCHECK_TEST_WIDTH", "64"))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(4, WIDTH) * 0.1)
        self.b = torch.nn.Parameter(torch.zeros(WIDTH, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.base(x) + (x @ self.a.t()) @ self.b.t())


def build(kind: str, world: int, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[Block() for _ in range(4)])
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model
    return model, torch.nn.parallel.DistributedDataParallel(model)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("module."): v.detach().clone() for k, v in full.items()}


def main(argv: list[str]) -> None:
    import pccheck

    kind, mode, path, rank, world, init_file, ref = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5], argv[6]
    steps = int(argv[7]) if len(argv) > 7 else 4
    remote = argv[8] if len(argv) > 8 else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model, trained = build(kind, world, seed=0 if mode == "save" else 1)
    params = [p for p in trained.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    if mode == "save":
        ck = pccheck.Checkpointer(trained, opt, path=path, interval=1, incremental=True,
                                  remote=pccheck.RemoteOptions(url=remote, keep_last=3) if remote else None)
        stats, uploads = [], []
        for s in range(1, steps + 1):
            g = torch.Generator().manual_seed(100 * s + rank)
            x = torch.randn(8, WIDTH, generator=g)
            trained(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if s == 3:  # an in-place change of a frozen tensor is captured too
                with torch.no_grad():
                    model[1].base.bias.add_(1.0)
            ck.maybe_checkpoint(s)
            ck.wait()
            if remote is not None:
                assert ck.wait(remote=True, timeout=120), "the remote commit did not come"
            report = ck.stats()
            cs = report.checkpoints[-1]
            stats.append({"step": s, "written": cs.bytes_written, "referenced": cs.bytes_referenced})
            if remote is not None:
                uploads.append({"step": s, "written": cs.bytes_written, "remote_step": report.remote["remote_step"],
                                "uploaded": report.remote["remote_last_bytes"],
                                "referenced": report.remote["remote_last_referenced"]})
            full = full_state(model)  # a collective: every rank gathers
            if rank == 0:
                torch.save(full, f"{ref}.{s}")
        ck.close()
        if remote is not None:
            with open(f"{ref}.remote-{rank}.json", "w") as f:
                json.dump(uploads, f)
        if rank == 0:
            with open(ref + ".json", "w") as f:
                json.dump(stats, f)
        print(f"SAVED {steps}", flush=True)
    else:
        step = pccheck.load_latest(path, model=trained, optimizer=opt).step
        full = full_state(model)
        if rank == 0:
            torch.save(full, ref)
        print(f"LOADED {step}", flush=True)
    leave()


if __name__ == "__main__":
    main(sys.argv[1:])
