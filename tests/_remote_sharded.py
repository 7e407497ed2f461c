"""One rank of an FSDP2 job with the remote tier, for tests/test_remote_sharded.py (gloo on CPU,
FileStore rendezvous; the model, the batches and the gathered state are _sharded_child's).

Usage: python _remote_sharded.py MODE LOCAL URL RANK WORLD INIT_FILE REF [STEPS] [--continue REF2]
       [--train] [--via-local]

MODE
  save  trains STEPS steps with remote=URL (local store LOCAL, a checkpoint every 2 steps),
        checkpoints step STEPS, waits for the remote; rank 0 writes the gathered state to REF
        (and, when STEPS > 2, that of step 2, once it is committed remotely, to REF.2).
        Prints "REMOTE <committed> <step>". With --train it never stops (the kill test):
        a checkpoint every step, "STEP s" and "REMOTE step" printed per step.
  load  load_latest(URL, model=..., optimizer=...) with no local store anywhere (--via-local:
        load_latest(LOCAL, ..., remote=URL), LOCAL being absent); prints
        "LOADED step bytes_read tier"; rank 0 compares the gathered state with REF ("EQUAL").
        With --continue REF2: trains 2 more steps with remote=URL (a new local store), checkpoints
        the second, waits for the remote, and rank 0 writes the gathered state to REF2.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from _leave import leave
from _sharded_child import build, full_state, step


def _save(local: str, url: str, rank: int, world: int, ref: str, steps: int, train: bool) -> None:
    import pccheck

    model, opt = build("fsdp", world)
    ck = pccheck.Checkpointer(model, opt, path=local, interval=1 if train else 2, max_concurrent=2, remote=url)
    s = 0
    while train or s < steps:
        s += 1
        step("fsdp", model, opt, s)
        if train or s < steps:  # the last step: _finish
            ck.maybe_checkpoint(s)
        if s == 2 and steps > 2 and not train:  # the reference of a load that falls back to step 2
            ck.wait(remote=True, timeout=180)
            state = full_state(model, opt, world)
            if rank == 0:
                torch.save(state, ref + ".2")
        if train:
            print(f"STEP {s}", flush=True)
            print(f"REMOTE {ck.stats().remote_step}", flush=True)
    _finish(ck, model, opt, world, rank, ref, steps)


def _finish(ck, model, opt, world: int, rank: int, ref: str, steps: int) -> None:
    ck.checkpoint(steps)
    ck.wait()
    done = ck.wait(remote=True, timeout=180)
    print(f"REMOTE {done} {ck.stats().remote_step}", flush=True)
    ck.close()
    state = full_state(model, opt, world)
    if rank == 0:
        torch.save(state, ref)


def _load(local: str, url: str, rank: int, world: int, ref: str, argv: list[str]) -> None:
    import pccheck

    model, opt = build("fsdp", world)
    if "--via-local" in argv:  # the local store first (deleted): falls back to the remote tier
        r = pccheck.load_latest(local, model=model, optimizer=opt, remote=url)
    else:
        r = pccheck.load_latest(url, model=model, optimizer=opt)
    print(f"LOADED {r.step} {r.bytes_read} {r.tier}", flush=True)
    state = full_state(model, opt, world)
    if rank == 0:
        want = torch.load(ref, weights_only=True)
        assert sorted(want) == sorted(state), (sorted(want), sorted(state))
        bad = [k for k in want if not torch.equal(want[k], state[k])]
        assert not bad, f"differ after load: {bad}"
        print("EQUAL", flush=True)
    if "--continue" in argv:
        ck = pccheck.Checkpointer(model, opt, path=local, max_concurrent=2, remote=url)
        for s in (r.step + 1, r.step + 2):  # _finish checkpoints the second
            step("fsdp", model, opt, s)
        _finish(ck, model, opt, world, rank, argv[argv.index("--continue") + 1], r.step + 2)


def main(argv: list[str]) -> None:
    mode, local, url, rank, world, init = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5]
    ref = argv[6]
    steps = int(argv[7]) if len(argv) > 7 and argv[7].isdigit() else 4
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    if mode == "save":
        _save(local, url, rank, world, ref, steps, "--train" in argv)
    else:
        _load(local, url, rank, world, ref, argv)
    if world > 1:
        leave()


if __name__ == "__main__":
    main(sys.argv[1:])
