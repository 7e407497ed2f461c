"""Incremental checkpoints in a torch.distributed group (gloo on CPU): each rank's store references
its own earlier cells; FSDP2 (DTensor) state loads on the same world and resharded, DDP state on
every rank, and a rank whose newest checkpoint is damaged takes the whole group back a step."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pccheck.persist.recovery import slot_base  # noqa: E402
from test_incremental import manifest_of_latest  # noqa: E402

CHILD = str(Path(__file__).with_name("_incr_group_child.py"))
STEPS = 4


def _job(kind: str, mode: str, ck: Path | str, ref: Path, world: int, remote: str | None = None,
         env: dict[str, str] | None = None) -> list[str]:
    """Runs ``world`` ranks of _incr_group_child.py (``ck``: a directory, or an s3:// URL to load
    from; ``remote``: an s3:// URL "save" uploads to too) and returns their stdouts."""
    init = ref.parent / f"init-{random.random()}"
    extra = [remote] if remote is not None else []
    procs = [subprocess.Popen([sys.executable, CHILD, kind, mode, str(ck), str(r), str(world), str(init), str(ref),
                               str(STEPS), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
             for r in range(world)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


def _loaded_step(outs: list[str]) -> set[int]:
    return {int(line.split()[1]) for out in outs for line in out.splitlines() if line.startswith("LOADED")}


def _equal(a: Path, b: Path) -> bool:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def fsdp_saved(tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("fsdp")
    _job("fsdp", "save", tmp / "ck", tmp / "ref", world=2)
    return tmp


def test_fsdp2_ranks_write_only_what_changed(fsdp_saved):
    stats = json.loads((fsdp_saved / "ref.json").read_text())
    first, later = stats[0], stats[1:]
    assert first["referenced"] == 0
    for s in later:  # the frozen bases are referenced, the adapters and their AdamW state written
        assert s["referenced"] > 2 * s["written"] > 0, stats
    # step 3 also changed a frozen bias in place: its shard of it is written
    assert stats[2]["written"] > stats[1]["written"], stats


def test_hugging_face_export_consolidates_through_the_references(fsdp_saved, tmp_path):
    """The FSDP2 ranks' incremental stores export to one set of safetensors shards under the
    module's names, bit for bit (the frozen bases read from step 1's cells, the adapters from
    the newest step's)."""
    import pccheck
    from safetensors.torch import load_file

    r = pccheck.export_hf(fsdp_saved / "ck", tmp_path / "hf", max_shard_size="20KB")
    assert r.step == STEPS and len(r.files) > 2
    got = {}
    for f in r.files:
        if f.endswith(".safetensors"):
            got.update(load_file(tmp_path / "hf" / f))
    want = torch.load(fsdp_saved / f"ref.{STEPS}", weights_only=True)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])  # 1: resharded
def test_fsdp2_loads_through_references_on_the_same_and_another_world(fsdp_saved, tmp_path, world):
    outs = _job("fsdp", "load", fsdp_saved / "ck", tmp_path / "got", world=world)
    assert _loaded_step(outs) == {STEPS}
    assert _equal(tmp_path / "got", fsdp_saved / f"ref.{STEPS}")


def test_a_rank_with_a_damaged_newest_cell_takes_the_group_back_a_step(fsdp_saved, tmp_path):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(fsdp_saved / "ck", ck)
    rank_dir = ck / "rank-1"
    store = next(rank_dir.glob("store-*.pcc"))
    image, slot, man = manifest_of_latest(rank_dir, store.name)
    own = [i for i in range(len(man.arrays)) if man.cell_of(i, slot) == slot and man.arrays[i].nbytes]
    assert own, "the newest checkpoint wrote no array of its own"
    off = slot_base(image, slot) + man.arrays[own[0]].offset
    with open(store, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    outs = _job("fsdp", "load", ck, tmp_path / "got", world=2)
    assert _loaded_step(outs) == {STEPS - 1}
    assert _equal(tmp_path / "got", fsdp_saved / f"ref.{STEPS - 1}")


@pytest.mark.slow  # two more 2-rank jobs
def test_ddp_ranks_resume_bit_exact(tmp_path):
    _job("ddp", "save", tmp_path / "ck", tmp_path / "ref", world=2)
    stats = json.loads((tmp_path / "ref.json").read_text())
    assert all(s["referenced"] > 2 * s["written"] for s in stats[1:]), stats
    outs = _job("ddp", "load", tmp_path / "ck", tmp_path / "got", world=2)
    assert _loaded_step(outs) == {STEPS}
    assert _equal(tmp_path / "got", tmp_path / f"ref.{STEPS}")


def test_the_group_step_keeps_its_cells_while_a_rank_runs_ahead(tmp_path):
    """Rank 0 commits steps 4 and 5 (changing array b again) while rank 1 stops after step 3:
    the group's step stays 3, so rank 0's step 3 must keep the cells it references (b's, written
    at step 2) though rank 0's own newest checkpoint no longer does. SIGKILL, then the group
    loads step 3 on both ranks, bit for bit; and again after a restart from step 3 in which rank 0
    alone commits steps 4 and 5."""
    lag = str(Path(__file__).with_name("_incr_lag_child.py"))

    jobs = [0]

    def job(mode: str) -> list[tuple[int, str, str]]:
        jobs[0] += 1  # each job its own FileStore file: a used one holds the last job's rendezvous keys
        init = tmp_path / f"init-{mode}-{jobs[0]}"
        procs = [subprocess.Popen([sys.executable, lag, mode, str(tmp_path / "ck"), str(r), str(init)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]

    ran = job("run")
    assert [rc for rc, _, _ in ran] == [-9, -9], [e[-2000:] for _, _, e in ran]
    assert "COMMITTED 5" in ran[0][1] and "COMMITTED 4" not in ran[1][1]
    loaded = job("load")
    assert [o for _, o, _ in loaded] == ["LOADED 3 True\n"] * 2, [e[-2000:] for _, _, e in loaded]
    # restarted from step 3, rank 0 commits steps 4 and 5 again while rank 1 does not: the group's
    # step is still 3, whose cells rank 0's reopened store must keep though its base moved on
    resumed = job("resume")
    assert [rc for rc, _, _ in resumed] == [-9, -9], [e[-2000:] for _, _, e in resumed]
    assert "COMMITTED 5" in resumed[0][1] and "COMMITTED 4" not in resumed[1][1]
    loaded = job("load")
    assert [o for _, o, _ in loaded] == ["LOADED 3 True\n"] * 2, [e[-2000:] for _, _, e in loaded]
