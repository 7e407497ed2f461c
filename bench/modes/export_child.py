"""One rank of ``python -m bench.export``'s save job (torchrun, gloo on CPU).

Usage: torchrun --standalone --nproc-per-node W export_child.py WORKDIR NBYTES LAYERS

Builds ``LAYERS`` bias-free ``Linear`` layers of ``NBYTES`` float32 weights in all, FSDP2-sharded
over the W ranks (built on the meta device, then each rank fills only its own shards, so no rank
ever holds the whole model), and saves the model twice: with a pccheck ``Checkpointer`` to
``WORKDIR/pccheck`` and with ``torch.distributed.checkpoint.save`` through
``HuggingFaceStorageWriter(save_distributed=True)`` to ``WORKDIR/dcp`` (per-rank safetensors
that DCP's ``consolidate_safetensors_files`` turns into one). Prints ``SAVED`` on rank 0.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def build(nbytes: int, layers: int, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    side = int(math.isqrt(nbytes // layers // 4))
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(side, side, bias=False) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(generator=g)
    return model


def main(argv: list[str]) -> None:
    import pccheck
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    workdir, nbytes, layers = Path(argv[0]), int(argv[1]), int(argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build(nbytes, layers, dist.get_world_size())
    with pccheck.Checkpointer(model, path=workdir / "pccheck") as ck:
        ck.checkpoint(1)
        ck.wait()
    save(get_model_state_dict(model), storage_writer=HuggingFaceStorageWriter(str(workdir / "dcp"),
                                                                             save_distributed=True))
    dist.barrier()
    if dist.get_rank() == 0:
        print("SAVED", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
