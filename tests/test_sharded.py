"""Sharded state (FSDP2, DTensor) and resharded loads (FORMAT.md §9).

Real torch.distributed (gloo on CPU, FileStore rendezvous in a tmp dir) and real FSDP2: each job
is a set of tests/_sharded_child.py processes. A job saved on 2 ranks is loaded on 1, 2, 3 and 4;
the gathered model and optimizer state must be torch.equal to the state at the saved step.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pccheck.persist.recovery import read_manifest, read_store, slot_base, store_files
from pccheck.sharded.geometry import Box, chunk_range, local_box, overlap

CHILD = str(Path(__file__).with_name("_sharded_child.py"))


def run_job(mode: str, kind: str, path: Path, world: int, ref: Path, *extra: str,
            timeout: float = 240) -> list[str]:
    """Runs WORLD ranks of the child to completion; their stdout, rank by rank."""
    init = path.parent / f"init-{random.random()}"
    procs = [subprocess.Popen([sys.executable, CHILD, mode, kind, str(path), str(r), str(world), str(init), str(ref),
                               *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [o for o, _ in outs]


def loaded(out: str) -> tuple[int, int]:
    line = next(l for l in out.splitlines() if l.startswith("LOADED"))
    return int(line.split()[1]), int(line.split()[2])


@pytest.fixture(scope="module")
def fsdp_saved(tmp_path_factory) -> tuple[Path, Path]:
    """An FSDP2 job of 2 ranks that checkpointed steps 3 and 4; the gathered state of step 4."""
    tmp = tmp_path_factory.mktemp("fsdp")
    run_job("save", "fsdp", tmp / "ck", 2, tmp / "ref.pt")
    return tmp / "ck", tmp / "ref.pt"


@pytest.mark.parametrize("world", [1, 2] + [pytest.param(w, marks=pytest.mark.slow) for w in (3, 4)])  # 3, 4: `make test-slow` (test_dcp reshards to four)
def test_fsdp_saved_on_two_loads_on_any_world_size(fsdp_saved, tmp_path, world):
    saved, ref = fsdp_saved
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    outs = run_job("load", "fsdp", path, world, ref)
    assert "EQUAL" in outs[0]
    assert {loaded(o)[0] for o in outs} == {4}
    # The chunks were read straight into the model's own shards (no second copy of the state).
    for o in outs:
        kept, total = map(int, next(l for l in o.splitlines() if l.startswith("INPLACE")).split()[1:])
        assert kept == total > 0, o
    # Every rank reads what its own shards need (plus the replicated tensors); together they
    # read at least the whole state once.
    assert all(loaded(o)[1] > 0 for o in outs)
    # Two more steps ran and were checkpointed: the job of `world` ranks continues the store.
    losses = {l.split()[1]: l.split()[2] for o in outs for l in o.splitlines() if l.startswith("LOSS")}
    assert sorted(losses) == ["5", "6"]
    again = run_job("load", "fsdp", path, 1, ref, "--no-compare", timeout=120) if world != 1 else None
    if again is not None:
        assert loaded(again[0])[0] == 6


def test_saved_shards_are_local_and_replicated_tensors_stored_once(fsdp_saved):
    saved, _ = fsdp_saved
    trees = []
    for r in range(2):
        image = read_store(store_files(saved / f"rank-{r}")[0][1])
        slot = max((st for st in image.slots if st.meta), key=lambda st: st.meta["counter"]).slot
        with open(image.path, "rb") as f:
            trees.append(read_manifest(image, slot, f.fileno()))
    shards = [m.tree["shards"] for m in trees]
    # The 13x10 tied embedding is split 7 + 6 rows; the head shares it (one tensor).
    assert shards[0]["model/emb.weight"]["chunks"][0][1] == [0, 0]
    assert shards[1]["model/emb.weight"]["chunks"][0][1] == [7, 0]
    assert "model/head.weight" not in shards[0]
    # The plain buffer and AdamW's step counters are stored by rank 0 only.
    assert shards[0]["model/scale"]["chunks"] and not shards[1]["model/scale"]["chunks"]
    assert "model/scale" not in {e.name for e in trees[1].arrays}
    assert not shards[1]["optimizer/state/0/step"]["chunks"]


def test_dtensor_by_hand_shard_and_replicate(tmp_path):
    path, ref = tmp_path / "ck", tmp_path / "ref.pt"
    run_job("save", "dtensor", path, 2, ref)
    outs = run_job("load", "dtensor", path, 3, ref)
    assert "EQUAL" in outs[0] and {loaded(o)[0] for o in outs} == {4}


def test_partial_placement_is_refused_at_construction(tmp_path):
    outs = run_job("partial", "fsdp", tmp_path / "ck", 2, tmp_path / "ref.pt", timeout=120)
    for o in outs:
        assert "REFUSED" in o and "Partial" in o and "Shard" in o
    assert not Path("/nonexistent-never-created").exists()


def test_load_into_a_model_of_another_shape_names_the_tensor(fsdp_saved, tmp_path):
    saved, ref = fsdp_saved
    outs = run_job("shape", "fsdp", saved, 2, ref, timeout=120)
    for o in outs:
        # Every shape is checked before a byte is read: the first mismatch names itself, and the
        # model is left as it was.
        assert "REFUSED" in o and re.search(r"'blocks\.[012]\.(weight|bias)'.*holds shape \[(7|10)", o), o
        assert "UNTOUCHED" in o, o


def _corrupt_newest(rank_dir: Path) -> int:
    """Flips one byte of the first array of the newest slot; returns its step."""
    return _corrupt_newest_but(rank_dir, None)


def _corrupt_newest_but(rank_dir: Path, step: int | None) -> int:
    """Flips one byte of the first array of the newest slot not of ``step``; returns its step."""
    image = read_store(store_files(rank_dir)[0][1])
    st = max((st for st in image.slots if st.meta and st.meta["step"] != step), key=lambda st: st.meta["counter"])
    with open(image.path, "r+b") as f:
        man = read_manifest(image, st.slot, f.fileno())
        entry = next(e for e in man.arrays if e.nbytes)
        off = slot_base(image, st.slot) + entry.offset
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    return st.meta["step"]


def test_a_damaged_chunk_makes_every_rank_fall_back_together(fsdp_saved, tmp_path):
    saved, ref = fsdp_saved
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    assert _corrupt_newest(path / "rank-1") == 4
    # Step 4's chunks were read into the model before the vote; step 3 overwrites every tensor:
    # the state equals the one saved at step 3.
    outs = run_job("load", "fsdp", path, 3, Path(f"{ref}.3"))
    assert {loaded(o)[0] for o in outs} == {3}
    assert "EQUAL" in outs[0]


def test_when_no_set_loads_the_error_says_the_model_was_partly_written(fsdp_saved, tmp_path):
    saved, ref = fsdp_saved
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    assert _corrupt_newest(path / "rank-1") == 4
    assert _corrupt_newest_but(path / "rank-1", 4) == 3
    for o in run_job("damaged", "fsdp", path, 2, ref, timeout=120):
        assert "NOCHECKPOINT" in o and "step 4" in o and "step 3" in o and "initialise them again" in o, o


def test_sigkill_mid_checkpoint_every_rank_loads_the_same_committed_step(tmp_path):
    path = tmp_path / "ck"
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, CHILD, "train", "fsdp", str(path), str(r), "2", str(init),
                               str(tmp_path / "ref.pt")], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True) for r in range(2)]
    # Kill rank 1 while checkpoints are in flight (one every step), then rank 0.
    deadline = time.monotonic() + 120
    for line in procs[1].stdout:  # type: ignore[union-attr]
        if line.startswith("STEP") and int(line.split()[1]) >= 6 or time.monotonic() > deadline:
            break
    os.kill(procs[1].pid, signal.SIGKILL)
    time.sleep(0.2)
    os.kill(procs[0].pid, signal.SIGKILL)
    for p in procs:
        p.wait(30)
    outs = run_job("load", "fsdp", path, 2, tmp_path / "ref.pt", "--no-compare")
    steps = {loaded(o)[0] for o in outs}
    assert len(steps) == 1 and steps.pop() >= 1


# -- geometry (pure) --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,parts", [(10, 3), (13, 2), (7, 4), (3, 4), (0, 2), (1, 1)])
def test_chunk_range_follows_torch_chunk(n, parts):
    pieces = torch.arange(n).chunk(parts) if n else ()
    for i in range(parts):
        start, length = chunk_range(n, parts, i)
        want = pieces[i].tolist() if i < len(pieces) else []
        assert list(range(start, start + length)) == want


def test_local_box_matches_nested_torch_chunk_on_a_2d_mesh():
    """DTensor cuts mesh dimension by mesh dimension with torch.chunk: the box of each coordinate
    must hold exactly the elements that nested chunking gives."""
    full = torch.arange(11 * 7).reshape(11, 7)
    for coord in [(0, 0), (1, 2), (0, 1), (1, 0)]:
        for dims in [(0, 1), (None, 0), (1, 1), (None, None), (0, 0)]:
            piece = full
            for mesh_dim, d in enumerate(dims):
                if d is not None:
                    parts = piece.chunk((2, 3)[mesh_dim], dim=d)
                    piece = parts[coord[mesh_dim]] if coord[mesh_dim] < len(parts) else piece.narrow(d, 0, 0)
            box = local_box((11, 7), (2, 3), coord, dims)
            assert box.sizes == tuple(piece.shape), (coord, dims)
            if piece.numel():
                assert torch.equal(full[box.slices()], piece), (coord, dims)


def test_overlap():
    a, b = Box((0, 0), (4, 6)), Box((2, 3), (5, 5))
    assert overlap(a, b) == Box((2, 3), (2, 3))
    assert overlap(a, Box((4, 0), (1, 1))) is None
    assert overlap(Box((), ()), Box((), ())) == Box((), ())


def test_hostile_shards_sections_are_refused_cleanly():
    """Offsets and sizes read from a shards section are bounds-checked: every malformed entry is
    a CorruptCheckpointError, never another exception or an accepted chunk outside the tensor."""
    import random as rnd
    from types import SimpleNamespace

    import numpy as np

    from pccheck.errors import CorruptCheckpointError
    from pccheck.persist.layout import ArrayEntry
    from pccheck.sharded.index import _parse_tensor

    arrays = {"a": ArrayEntry("a", np.dtype("<f4"), (4, 6), 0, 96),
              "b": ArrayEntry("b", np.dtype("<u2"), (2,), 128, 4, "bfloat16")}
    member = SimpleNamespace(image=SimpleNamespace(path=Path("x")), slot=0, rank=1)
    good = {"dtype": "float32", "shape": [10, 6], "chunks": [["a", [6, 0]]]}
    dtype, shape, chunks = _parse_tensor("t", good, arrays, member)
    assert (dtype, shape, chunks[0].box) == ("float32", (10, 6), Box((6, 0), (4, 6)))
    bad = [None, [], {"dtype": "float32"}, {**good, "shape": [10]}, {**good, "shape": [9, 6]},
           {**good, "shape": [10, -1]}, {**good, "shape": "10"}, {**good, "shape": [True, 6]},
           {**good, "dtype": "float64"}, {**good, "dtype": "nope"}, {**good, "chunks": [["zz", [0, 0]]]},
           {**good, "chunks": [["a", [7, 0]]]}, {**good, "chunks": [["a", [0]]]}, {**good, "chunks": [["a"]]},
           {**good, "chunks": [["a", [0, 1 << 70]]]}, {**good, "chunks": [[1, [0, 0]]]},
           {"dtype": "uint16", "shape": [2], "chunks": [["b", [0]]]},  # bfloat16 bits are not uint16
           {**good, "shape": [10, 6] * 40}]
    for doc in bad:
        with pytest.raises(CorruptCheckpointError):
            _parse_tensor("t", doc, arrays, member)
    rng = rnd.Random(5)
    for _ in range(2000):  # random mutations of a good entry
        doc = {"dtype": rng.choice(["float32", "bfloat16", 3]),
               "shape": [rng.choice([0, 4, 10, -3, 2 ** 63]) for _ in range(rng.choice([1, 2, 3]))],
               "chunks": [[rng.choice(["a", "b"]), [rng.choice([0, 3, 6, -1]) for _ in range(rng.choice([1, 2]))]]]}
        try:
            _, shape, chunks = _parse_tensor("t", doc, arrays, member)
        except CorruptCheckpointError:
            continue
        assert all(c.box.within(shape) for c in chunks)


def test_chunk_reads_are_planned_in_file_order_and_a_gap_is_found_before_any_read():
    """A load hands its chunk reads to the threads member by member, front to back (taken
    tensor by tensor they scatter over the files and a cold load runs at half the disk's rate),
    whatever order the tensors come in; a destination the chunks do not cover is a
    CorruptCheckpointError found while planning, before a byte is read."""
    from types import SimpleNamespace

    from pccheck.errors import CorruptCheckpointError
    from pccheck.sharded.dtensor import Destination
    from pccheck.sharded.index import Chunk, TensorInfo
    from pccheck.sharded.load import _plan

    # Tensors "a" and "b" of 4 x 3, each saved as two 2-row chunks by ranks 0 and 1.
    offsets = {(0, "a0"): 500, (1, "a1"): 100, (0, "b0"): 0, (1, "b1"): 900}
    cand = SimpleNamespace(position=lambda rank, name: (rank, offsets[(rank, name)]))
    tensors = {t: TensorInfo(t, "float32", (4, 3), (Chunk(0, f"{t}0", Box((0, 0), (2, 3))),
                                                    Chunk(1, f"{t}1", Box((2, 0), (2, 3)))))
               for t in ("a", "b")}

    def dest(box: Box) -> Destination:
        return Destination(box, torch.empty(box.sizes), lambda t: t)

    plan = _plan(cand, tensors, {"a": dest(Box((0, 0), (4, 3))), "b": dest(Box((0, 0), (4, 3)))})
    assert [r.chunk.array for r in plan] == ["b0", "a0", "a1", "b1"]
    assert [r.position for r in plan] == [(0, 0), (0, 500), (1, 100), (1, 900)]
    # A rank holding rows 1-3 reads both chunks of "a", each for its overlap only.
    part = _plan(cand, tensors, {"a": dest(Box((1, 0), (3, 3)))})
    assert [(r.chunk.array, r.part) for r in part] == [("a0", Box((1, 0), (1, 3))), ("a1", Box((2, 0), (2, 3)))]
    # Rank 1's chunk of "a" is missing: rows 2-3 are uncovered.
    gap = {"a": TensorInfo("a", "float32", (4, 3), tensors["a"].chunks[:1])}
    with pytest.raises(CorruptCheckpointError, match="cover 6 of the 12 elements"):
        _plan(cand, gap, {"a": dest(Box((0, 0), (4, 3)))})
