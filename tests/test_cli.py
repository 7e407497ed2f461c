"""The operator CLI: ``pccheck ls / verify / inspect / export``, through typer's CliRunner and as the
installed console script in a subprocess.

Stores are written by a real Checkpointer; damage is done to copies of them the way
test_corruption.py does it (byte flips at known offsets read from the meta records).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import pccheck
from pccheck.commands.cli import app
from pccheck.persist.recovery import read_manifest, read_store

BLOCK = 4096
STORE = "store-000001.pcc"
KW = dict(interval=1, max_concurrent=2, writer_threads=2, chunk_size=16 << 10)
runner = CliRunner()


def expected(step: int) -> dict[str, np.ndarray]:
    """Every dtype safetensors and torch can hold (big-endian, 0-d, empty and strided included)."""
    rng = np.random.default_rng(500 + step)
    base = rng.standard_normal((30, 20))
    return {
        "f32": rng.standard_normal((16, 32)).astype(np.float32),
        "f16": rng.standard_normal(77).astype(np.float16),
        "f64_be": rng.standard_normal(9).astype(">f8"),
        "i64": rng.integers(-2**62, 2**62, 50),
        "i32": rng.integers(-2**31, 2**31, 7, dtype=np.int32),
        "i16": rng.integers(-2**15, 2**15, 5, dtype=np.int16),
        "i8": rng.integers(-128, 128, 11, dtype=np.int8),
        "u8": rng.integers(0, 256, 13, dtype=np.uint8),
        "u16": rng.integers(0, 2**16, 3, dtype=np.uint16),
        "u32": rng.integers(0, 2**32, 3, dtype=np.uint32),
        "u64": rng.integers(0, 2**63, 3, dtype=np.uint64),
        "bool": rng.random(10) < 0.5,
        "c64": (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64),
        "scalar": np.array(step, dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "strided": base.T,  # a non-contiguous view
    }


def unsupported() -> dict[str, np.ndarray]:
    rec = np.zeros(3, dtype=[("a", "<i4"), ("s", "S3")])
    rec["a"] = [1, 2, 3]
    return {"ok": np.arange(4, dtype=np.float32), "rec": rec, "names": np.array([b"ab", b"cde"]),
            "when": np.array(["2026-01-01"], dtype="datetime64[ns]"), "c128": np.ones(2, np.complex128)}


def build(d: Path, steps: range, make=expected, **kw) -> None:
    state = make(steps[0])
    with pccheck.Checkpointer(state, d, **{**KW, **kw}) as ck:
        for step in steps:
            for k, v in make(step).items():
                state[k][...] = v
            ck.maybe_checkpoint(step, metadata={"step": step, "tag": "cli"})
            ck.wait()  # in order: slots then hold the last three steps


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli") / "ckpt"
    build(d, range(1, 6))  # 3 slots: steps 3, 4, 5 (latest)
    return d


@pytest.fixture
def store(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the pristine store, free to damage."""
    d = tmp_path / "ckpt"
    shutil.copytree(pristine, d)
    return d


def run(*args: str) -> "object":
    return runner.invoke(app, [str(a) for a in args])


def run_json(*args: str, code: int = 0) -> dict:
    res = run(*args, "--json")
    assert res.exit_code == code, res.output
    return json.loads(res.stdout)


def slot_of_step(d: Path, step: int) -> int:
    image = read_store(d / STORE)
    return next(s.slot for s in image.slots if s.meta and s.meta["step"] == step)


def flip_array_byte(d: Path, step: int, name: str = "f32") -> None:
    """Damages one byte of an array of the checkpoint of `step` (its crc32c no longer matches)."""
    image = read_store(d / STORE)
    slot = slot_of_step(d, step)
    with open(d / STORE, "rb") as f:
        man = read_manifest(image, slot, f.fileno())
    entry = next(e for e in man.arrays if e.name == name)
    off = image.header["slots_offset"] + slot * image.header["slot_capacity"] + entry.offset + 5
    with open(d / STORE, "r+b") as f:
        b = f.read()[off]
        f.seek(off)
        f.write(bytes([b ^ 0x40]))


def meta_offset(slot: int) -> int:
    return (1 + slot) * BLOCK


def same(got: np.ndarray, want: np.ndarray) -> bool:
    """Same values and shape; byte order may differ (exports are little-endian)."""
    return got.shape == want.shape and got.dtype.newbyteorder("=") == want.dtype.newbyteorder("=") and \
        np.array_equal(got, want.astype(want.dtype.newbyteorder("=")))


# -- ls -------------------------------------------------------------------------------------------


def test_ls_lists_slots_steps_and_status(store: Path) -> None:
    doc = run_json("ls", store)
    (gen,) = doc["generations"]
    assert gen["generation"] == 1 and gen["num_slots"] == 3 and gen["problem"] is None
    by_step = {s["step"]: s for s in gen["slots"]}
    assert sorted(by_step) == [3, 4, 5]
    assert by_step[5]["status"] == "latest" and gen["check_addr"] == {"slot": by_step[5]["slot"],
                                                                        "counter": by_step[5]["counter"]}
    assert by_step[3]["status"] == by_step[4]["status"] == "committed"
    assert by_step[3]["counter"] < by_step[4]["counter"] < by_step[5]["counter"]
    for s in gen["slots"]:
        assert s["data_bytes"] >= 16 * 32 * 4 and s["data_bytes"] % BLOCK == 0
        assert 0 <= s["age_s"] < 3600
    res = run("ls", store)
    assert res.exit_code == 0, res.output
    assert "latest" in res.stdout and "committed" in res.stdout and "CHECK_ADDR" in res.stdout


def test_ls_empty_free_and_invalid_slots(tmp_path: Path) -> None:
    d = tmp_path / "c"
    build(d, range(1, 2), max_concurrent=3)  # 4 slots, one checkpoint
    statuses = [s["status"] for s in run_json("ls", d)["generations"][0]["slots"]]
    assert sorted(statuses) == ["empty", "empty", "empty", "latest"]
    build(d, range(2, 4), max_concurrent=3)  # steps 2, 3 into two more slots
    image = read_store(d / STORE)
    by_step = {s.meta["step"]: s.slot for s in image.slots if s.meta}
    with open(d / STORE, "r+b") as f:
        f.seek(meta_offset(by_step[1]))
        f.write(bytes(BLOCK))  # cleared for reuse, as acquire_slot does: the data is still there
        f.seek(meta_offset(by_step[2]) + 20)
        f.write(b"\xff")  # the counter, under the meta crc
    slots = {s["slot"]: s for s in run_json("ls", d)["generations"][0]["slots"]}
    assert slots[by_step[1]]["status"] == "free"
    assert slots[by_step[2]]["status"] == "invalid" and "checksum" in slots[by_step[2]]["problem"]
    assert slots[by_step[3]]["status"] == "latest"
    assert sorted(s["status"] for s in slots.values()) == ["empty", "free", "invalid", "latest"]


def test_ls_errors(tmp_path: Path) -> None:
    res = run("ls", tmp_path / "missing")
    assert res.exit_code == 2 and "no checkpoint directory" in res.output
    doc = run_json("ls", tmp_path, code=2)
    assert doc["type"] == "NoCheckpointError" and "no pccheck store" in doc["error"]


def test_ls_unreadable_generation(store: Path) -> None:
    (store / "store-000002.pcc").write_bytes(b"not a store" * 1000)
    gens = run_json("ls", store)["generations"]
    assert [g["generation"] for g in gens] == [2, 1]
    assert gens[0]["problem"] and not gens[0]["slots"]
    assert any(s["status"] == "latest" for s in gens[1]["slots"])


# -- verify ---------------------------------------------------------------------------------------


def test_verify_pristine_exits_0(store: Path) -> None:
    res = run("verify", store)
    assert res.exit_code == 0, res.output
    assert "OK" in res.stdout and "step 5" in res.stdout
    doc = run_json("verify", store)
    assert doc["exit_code"] == 0 and doc["latest"]["step"] == 5 and doc["latest_problem"] is None
    assert [c["verdict"] for c in doc["slots"]] == ["ok"] * 3
    assert all(c["arrays"] == len(expected(1)) for c in doc["slots"])


def test_verify_damaged_latest_exits_1_naming_both(store: Path) -> None:
    flip_array_byte(store, 5)
    res = run("verify", store)
    assert res.exit_code == 1, res.output
    out = " ".join(res.stdout.split())
    assert "step 5" in out and "step 4" in out and "checksum mismatch" in out
    doc = run_json("verify", store, code=1)
    assert doc["latest"]["step"] == 5 and "checksum" in doc["latest_problem"]
    assert doc["newest_valid"]["step"] == 4
    # verify names what load_latest returns
    assert pccheck.load_latest(store).step == 4


def test_verify_word_naming_a_cleared_slot_exits_1(store: Path) -> None:
    with open(store / STORE, "r+b") as f:
        f.seek(meta_offset(slot_of_step(store, 5)))
        f.write(bytes(BLOCK))
    doc = run_json("verify", store, code=1)
    assert "does not confirm" in doc["latest_problem"] and doc["newest_valid"]["step"] == 4


def test_verify_nothing_valid_exits_2(store: Path) -> None:
    for step in (3, 4, 5):
        flip_array_byte(store, step, "i64")
    res = run("verify", store)
    assert res.exit_code == 2, res.output
    assert "NO VALID CHECKPOINT" in res.stdout
    doc = run_json("verify", store, code=2)
    assert doc["newest_valid"] is None and [c["verdict"] for c in doc["slots"]] == ["bad"] * 3
    with pytest.raises(pccheck.NoCheckpointError):
        pccheck.load_latest(store)


def test_verify_older_generation_is_valid(store: Path) -> None:
    """A garbage newest generation: the latest is invalid, generation 1 still has a valid one."""
    (store / "store-000002.pcc").write_bytes(os.urandom(3 * BLOCK))
    doc = run_json("verify", store, code=1)
    assert "generation 2" in doc["latest_problem"] and doc["newest_valid"]["step"] == 5


def test_verify_no_store(tmp_path: Path) -> None:
    assert run("verify", tmp_path).exit_code == 2


# -- inspect --------------------------------------------------------------------------------------


def test_inspect_latest_and_by_step(store: Path) -> None:
    doc = run_json("inspect", store)
    assert doc["step"] == 5 and doc["metadata"] == {"step": 5, "tag": "cli"}
    want = expected(5)
    assert [a["name"] for a in doc["arrays"]] == list(want)
    for a in doc["arrays"]:
        w = want[a["name"]]
        assert np.dtype(np.lib.format.descr_to_dtype(a["dtype"])) == w.dtype
        assert a["shape"] == list(w.shape) and a["nbytes"] == w.nbytes
    assert run_json("inspect", store, "--step", "3")["step"] == 3
    res = run("inspect", store, "--step", "4")
    assert res.exit_code == 0, res.output
    for name in want:
        assert name in res.stdout
    assert "float16" in res.stdout and ">f8" in res.stdout and "(16, 32)" in res.stdout and "(0, 3)" in res.stdout


def test_inspect_missing_step_names_the_steps_on_disk(store: Path) -> None:
    res = run("inspect", store, "--step", "99")
    assert res.exit_code == 2
    assert "no valid checkpoint of step 99" in " ".join(res.output.split())
    assert "3, 4, 5" in res.output


# -- export ---------------------------------------------------------------------------------------


def test_export_safetensors_loads_with_the_safetensors_library(store: Path, tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.numpy import load_file

    out = tmp_path / "model.safetensors"
    doc = run_json("export", store, "--format", "safetensors", "--out", out)
    assert doc["step"] == 5 and doc["skipped"] == [] and out.is_file()
    got = load_file(out)
    want = expected(5)
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert same(got[k], w), k
    with safe_open(out, framework="np") as f:
        meta = f.metadata()
    assert meta["pccheck.step"] == "5" and json.loads(meta["pccheck.metadata"]) == {"step": 5, "tag": "cli"}
    # torch through the safetensors library as well
    import torch
    from safetensors.torch import load_file as load_torch

    tt = load_torch(out)
    assert torch.equal(tt["f32"], torch.from_numpy(want["f32"])) and tt["u16"].dtype == torch.uint16
    # an older step
    run_json("export", store, "--step", "3", "--out", out)
    assert np.array_equal(load_file(out)["i64"], expected(3)["i64"])
    assert not list(tmp_path.glob(".*tmp"))  # no temporary file left behind


def test_export_torch_loads_with_weights_only(store: Path, tmp_path: Path) -> None:
    import torch

    out = tmp_path / "model.pt"
    res = run("export", store, "--format", "torch", "--out", out)
    assert res.exit_code == 0, res.output
    sd = torch.load(out, weights_only=True)
    want = expected(5)
    assert sorted(sd) == sorted(want)
    for k, w in want.items():
        assert isinstance(sd[k], torch.Tensor)
        assert same(sd[k].numpy(), w), k


def test_export_torch_only_dtypes(tmp_path: Path) -> None:
    """bfloat16 (stored with an integer carrier and named in the manifest) comes back as bfloat16."""
    import torch
    from safetensors.torch import load_file

    d = tmp_path / "c"
    x = torch.linspace(-3, 3, 40, dtype=torch.bfloat16)
    with pccheck.Checkpointer({"x": x, "y": torch.arange(4)}, d, **KW) as ck:
        ck.checkpoint(7)
    run_json("export", d, "--out", tmp_path / "a.safetensors")
    run_json("export", d, "--format", "torch", "--out", tmp_path / "a.pt")
    for got in (load_file(tmp_path / "a.safetensors"), torch.load(tmp_path / "a.pt", weights_only=True)):
        assert got["x"].dtype == torch.bfloat16 and torch.equal(got["x"], x)
        assert torch.equal(got["y"], torch.arange(4))


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_unsupported_dtype_is_a_clear_error(tmp_path: Path, fmt: str) -> None:
    d = tmp_path / "c"
    build(d, range(1, 2), make=lambda step: unsupported())
    out = tmp_path / f"x.{fmt}"
    res = run("export", d, "--format", fmt, "--out", out)
    assert res.exit_code == 2
    msg = " ".join(res.output.split())
    assert "'rec'" in msg and "cannot hold" in msg and "--skip-unsupported" in msg
    assert not out.exists() and not list(tmp_path.glob(".*tmp"))
    doc = run_json("export", d, "--format", fmt, "--out", out, "--skip-unsupported")
    left = {"rec", "names", "when"} | ({"c128"} if fmt == "safetensors" else set())
    assert set(doc["skipped"]) == left and doc["arrays"] == 5 - len(left)
    if fmt == "safetensors":
        from safetensors.numpy import load_file

        got = load_file(out)
    else:
        import torch

        got = {k: v.numpy() for k, v in torch.load(out, weights_only=True).items()}
    assert set(got) == set(unsupported()) - left
    assert np.array_equal(got["ok"], np.arange(4, dtype=np.float32))


def test_export_errors(store: Path, tmp_path: Path) -> None:
    res = run("export", store, "--out", tmp_path)  # a directory
    assert res.exit_code == 2 and "is a directory" in res.output
    res = run("export", store, "--format", "npz", "--out", tmp_path / "x")
    assert res.exit_code == 2  # typer's usage error for a bad choice
    flip_array_byte(store, 5)
    res = run_json("export", store, "--step", "5", "--out", tmp_path / "x.safetensors", code=2)
    assert "step 5" in res["error"] and "checksum" in res["error"]
    assert run_json("export", store, "--out", tmp_path / "x.safetensors")["step"] == 4  # latest valid


# -- the installed script ---------------------------------------------------------------------------


def _script() -> str:
    exe = Path(sys.executable).with_name("pccheck")
    assert exe.is_file(), f"the console script is not installed at {exe} (run `make setup`)"
    return str(exe)


def test_installed_script_in_a_subprocess(store: Path, tmp_path: Path) -> None:
    env = {**os.environ, "COLUMNS": "200"}
    p = subprocess.run([_script(), "ls", str(store), "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["generations"][0]["num_slots"] == 3
    p = subprocess.run([_script(), "verify", str(store)], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr
    flip_array_byte(store, 5)
    p = subprocess.run([_script(), "verify", str(store)], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "step 4" in p.stdout and "step 5" in p.stdout
    p = subprocess.run([_script(), "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and pccheck.__version__ in p.stdout
    # PATH defaults to $PCCHECK_DIR
    p = subprocess.run([_script(), "inspect", "--json"], capture_output=True, text=True, timeout=60,
                       env={**env, "PCCHECK_DIR": str(store)}, cwd=tmp_path)
    assert p.returncode == 0 and json.loads(p.stdout)["step"] == 5, p.stderr  # manifest only


def test_cli_does_not_import_torch_unless_exporting_torch(store: Path, tmp_path: Path) -> None:
    code = ("import sys; from pccheck.commands.cli import main; sys.argv = ['pccheck', 'verify', sys.argv[1]];\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    p = subprocess.run([sys.executable, "-c", code, str(store)], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr


def test_struct_unpack_meta_offsets_match_format(store: Path) -> None:
    """The helpers above read FORMAT.md §3 offsets directly; keep them honest."""
    raw = (store / STORE).read_bytes()
    slot = slot_of_step(store, 5)
    magic, _, s, counter, step = struct.unpack_from("<8sIIQq", raw, meta_offset(slot))
    assert magic == b"PCCMETA\0" and s == slot and step == 5 and counter >= 5


def test_a_distributed_root_lists_and_verifies_every_rank(store: Path, tmp_path: Path) -> None:
    """Pointed at a distributed job's root, ls and verify cover each rank-r/ store (the worst exit
    status counts); inspect and export, which need one store, name the ranks to choose from."""
    top = tmp_path / "dist"
    top.mkdir()
    for r in (0, 1):
        shutil.copytree(store, top / f"rank-{r}")
    doc = run_json("ls", top)
    assert [Path(d["directory"]).name for d in doc["stores"]] == ["rank-0", "rank-1"]
    assert all(d["generations"][0]["num_slots"] == 3 for d in doc["stores"])
    assert run_json("verify", top)["exit_code"] == 0
    flip_array_byte(top / "rank-1", 5)  # rank 1's latest is damaged; an older step is valid
    doc = run_json("verify", top, code=1)
    assert [d["exit_code"] for d in doc["stores"]] == [0, 1]
    res = run("inspect", top)
    assert res.exit_code != 0 and "rank-0" in res.output and "rank-1" in res.output and "pass one" in res.output
    assert run_json("inspect", top / "rank-0")["step"] == 5


def test_a_lightning_dirpath_finds_the_store_below_it(store: Path, tmp_path: Path) -> None:
    """pccheck.lightning keeps its store in DIRPATH/.pccheck beside Lightning's pointer files."""
    dirpath = tmp_path / "lightning-ckpt"
    dirpath.mkdir()
    (dirpath / "epoch=0-step=5.ckpt").write_text("{}")
    shutil.copytree(store, dirpath / ".pccheck")
    (dirpath / ".pccheck" / "history").mkdir()
    assert run_json("ls", dirpath)["directory"] == str(dirpath / ".pccheck")
    assert run("verify", dirpath).exit_code == 0
    assert run_json("inspect", dirpath)["step"] == 5
    assert "store " in run("ls", dirpath).output  # text output names the store it found
    empty = tmp_path / "nothing-below"
    (empty / "a" / "b" / "c").mkdir(parents=True)
    doc = run_json("ls", empty, code=2)
    assert doc["type"] == "NoCheckpointError" and "nor does any directory below it" in doc["error"]
