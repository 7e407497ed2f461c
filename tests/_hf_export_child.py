"""One rank of a small causal-LM job for tests/test_hf_export.py (gloo on CPU, FileStore rendezvous).

Usage: python _hf_export_child.py KIND PATH RANK WORLD INIT_FILE REF [STEPS]

KIND: "fsdp" (FSDP2 ``fully_shard`` of each decoder layer and the root on a CPU mesh) or "ddp"
(DistributedDataParallel: every rank holds the whole model; the Checkpointer is given the DDP
wrapper, whose names carry ``module.``). The model is a tiny Llama built from a config (no
download). Trains STEPS steps (default 3) with AdamW, checkpointing each one, then rank 0 writes
the full model state dict (gathered from the shards) to REF and the config to REF's directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from _leave import leave


def config():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def main(argv: list[str]) -> None:
    import pccheck
    from transformers import LlamaForCausalLM

    kind, path, rank, world, init_file, ref = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4], argv[5]
    steps = int(argv[6]) if len(argv) > 6 else 3
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        trained: torch.nn.Module = model
    else:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    ck = pccheck.Checkpointer(trained, opt, path=path, interval=1)
    for s in range(1, steps + 1):
        g = torch.Generator().manual_seed(100 * s + rank)
        x = torch.randint(0, 96, (2, 12), generator=g)
        loss = trained(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ck.maybe_checkpoint(s)
    ck.close()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in full.items()}, ref)
        config().save_pretrained(Path(ref).parent)
    print(f"SAVED {steps}", flush=True)
    leave()


if __name__ == "__main__":
    main(sys.argv[1:])
