"""The per-rank restore plan over every tier (memory, peer, disk, remote): in a 2-rank group
(torchrun on localhost, gloo, each rank with its own directories) where rank 1 lost its memory
and its disk, the ranks agree on the step rank 0 holds in memory and the remote tier holds for
rank 1; rank 0 loads it from memory, rank 1 from the remote, each its own part, bit for bit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pccheck.restore import REFUSED

WHY = dict(REFUSED)

CHILD = str(Path(__file__).with_name("_plan_child.py"))
STEPS = 4


def _job(kind: str, base: Path, url: str, *extra: str) -> list[str]:
    """Both ranks of one torchrun job; its stdout, rank by rank (--tee: each rank's own lines)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = base / f"logs-{len(list(base.glob('logs-*')))}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           "--log-dir", str(logs), "--redirects=3", CHILD, kind, str(base), url, str(STEPS), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    outs = [next(logs.rglob(f"attempt_0/{r}/stdout.log")).read_text() for r in range(2)]
    errs = [next(logs.rglob(f"attempt_0/{r}/stderr.log")).read_text() for r in range(2)]
    assert p.returncode == 0, (p.stderr[-2000:], errs[0][-3000:], errs[1][-3000:])
    return outs


def _start(out: str) -> tuple[int, str]:
    line = next(l for l in out.splitlines() if l.startswith("START "))
    return int(line.split()[1]), line.split()[2]


@pytest.mark.slow  # two torchrun jobs of two ranks importing torch (~30-60 s on 2 vCPUs): `make test-slow`
@pytest.mark.parametrize("kind", ["plain", "fsdp"])
def test_one_rank_from_memory_the_other_from_the_remote(s3_url, tmp_path, kind):
    """kind "fsdp": the same through the sharded path (each rank's own slot from its nearest
    tier, then the chunks it lacks from the other rank): remote= is part of its plan too."""
    base = tmp_path / "job"
    outs = _job(kind, base, s3_url)
    assert all(f"REMOTE True {STEPS}" in o for o in outs), outs
    shutil.rmtree(base / "rank-1")  # rank 1's node lost its memory and its disk
    outs = _job(kind, base, s3_url, "--resume")
    assert [_start(o) for o in outs] == [(STEPS, "memory"), (STEPS, "remote")], outs
    lazy = WHY["lazy= in a group from a local store" if kind == "plain" else "lazy= with sharded (DTensor) state"]
    assert all(f"REFUSED {lazy}" in o for o in outs), outs
    if kind == "plain":  # rank 0 alone: refused, and distributed=False loads without the group
        zero_copy = WHY["zero_copy= in a group's rank stores"]
        assert f"REFUSED {zero_copy}" in outs[0], outs[0]
        assert f"SOLO {STEPS} disk" in outs[0], outs[0]
    for r in range(2 if kind == "plain" else 1):  # fsdp: rank 0 saved the gathered state
        final = torch.load(base / f"final-{r}.pt", weights_only=True)
        loaded = torch.load(base / f"loaded-{r}.pt", weights_only=True)
        assert final.keys() == loaded.keys() and all(torch.equal(final[k], loaded[k]) for k in final), r


def _msg(**own):
    return {"own": {t: [list(k) for k in ks] for t, ks in own.items()}, "rep": {}, "bad": []}


def test_the_plan_takes_the_remote_last_and_only_for_ranks_no_nearer_tier_serves():
    from pccheck.errors import NoCheckpointError
    from pccheck.tiers.memory.nearest import TIERS, _plan

    assert TIERS == ("memory", "peer", "disk", "remote")
    # rank 1 lost memory and disk: the remote's step 9 for it, rank 0's own memory for rank 0
    key, plan = _plan([_msg(memory=[(1, 8), (1, 9)], remote=[(1, 9)]), _msg(remote=[(1, 5), (1, 9)])], 2)
    assert key == (1, 9) and plan == [("memory", -1), ("remote", -1)]
    # the disk is nearer than the remote
    assert _plan([_msg(disk=[(1, 9)], remote=[(1, 9)]), _msg(disk=[(1, 9)], remote=[(1, 9)])], 2)[1] == \
        [("disk", -1)] * 2
    # rank 1's remote part of step 9 failed in an earlier round: the next older common step
    failed = {**_msg(remote=[(1, 5)]), "bad": [["remote", -1, 1, 9]]}
    key, plan = _plan([_msg(memory=[(1, 5), (1, 9)]), failed], 2)
    assert key == (1, 5) and plan == [("memory", -1), ("remote", -1)]
    with pytest.raises(NoCheckpointError, match="remote tier"):
        _plan([_msg(memory=[(1, 9)]), _msg(remote=[(1, 4)])], 2)
