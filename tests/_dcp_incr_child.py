"""One rank of a 2-rank FSDP2 job (gloo on CPU) saving through pccheck.dcp with incremental=True
to an s3:// location, and loading from it (tests/test_dcp_incremental_remote.py).

Usage: python _dcp_incr_child.py MODE URL STAGE RANK WORLD INIT_FILE OUT
  save  a frozen 1 MiB backbone and a trained head (AdamW), dcp.save after each of SAVES steps;
        each rank counts the bytes its remote tier's clients put on the wire (botocore's
        before-send hook: every request's Content-Length) per save, and writes them with the
        bytes of its changed and its frozen shards to OUT.rank-<r>.json; rank 0 writes the
        full state of the last save to OUT (torch.save, test side only)
  load  a fresh model of another seed, dcp.load from the URL, rank 0 writes the full state to OUT
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import pccheck
import pccheck.dcp

from _leave import leave

SAVES = 5
WIDTH = 512  # the frozen backbone: a 512 x 512 float32 linear, 1 MiB (sharded over the ranks)


def _model(seed: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 8))
    model[0].requires_grad_(False)
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(100 + step)
    model(torch.randn(4, WIDTH)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class _Wire:
    """The bytes a store's boto3 clients put on the wire, independent of pccheck's counters."""

    def __init__(self, store) -> None:  # type: ignore[no-untyped-def]
        self.bytes = 0
        for client in {id(c): c for c in (store.client, store._parts)}.values():
            client.meta.events.register("before-send.s3", self._count)

    def _count(self, request, **_) -> None:  # type: ignore[no-untyped-def]
        self.bytes += int(request.headers.get("Content-Length", 0) or 0)


def main(mode: str, url: str, stage: str, rank: int, world: int, init: str, out: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    if mode == "load":
        model, optim = _model(99, world)
        _train(model, optim, 0)  # creates the optimizer state the load fills
        sd = _state(model, optim)
        dcp.load(sd, storage_reader=pccheck.dcp.Reader(url))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:
        from pccheck.integrations.dcp_store import rank_store

        model, optim = _model(1, world)
        writer = pccheck.dcp.Writer(url, local=stage, incremental=True, max_concurrent=1,
                                    remote=pccheck.RemoteOptions(keep_last=2, part_size=8 << 20))
        wire, sent = None, []
        for step in range(SAVES):
            _train(model, optim, step)
            dcp.save(_state(model, optim), storage_writer=writer)
            tier = rank_store(writer.path, world, rank, writer.engine).stack.tier("remote")
            if wire is None:  # the rank store (and its remote tier) opened at the first save
                wire = _Wire(tier.store)
                sent.append(None)
            else:
                sent.append(wire.bytes)
        p = tier.progress
        sd = _state(model, optim)
        frozen = sum(_local_bytes(t) for k, t in sd["model"].items() if k.startswith("0."))
        changed = sum(_local_bytes(t) for k, t in sd["model"].items() if k.startswith("2."))
        changed += sum(_local_bytes(t) for st in sd["optim"]["state"].values() for t in st.values())
        doc = {"sent": sent, "frozen": frozen, "changed": changed, "last_bytes": p.last_bytes,
               "last_referenced": p.last_referenced, "bytes_referenced": p.bytes_referenced}
        with open(f"{out}.rank-{rank}.json", "w") as f:
            json.dump(doc, f)
        writer.close()
    full = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"model": full[0], "optim": full[1]}, out)
    dist.barrier()
    leave()  # every check is done and OUT is closed


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], int(a[3]), int(a[4]), a[5], a[6])
