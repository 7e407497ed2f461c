"""``pccheck export --format hf`` / ``pccheck.export_hf``: a checkpoint's model as a Hugging Face
model directory, from every kind of store.

A tiny Llama built from a config (no download) is trained a few steps and checkpointed by pccheck
(one process; a 2-rank FSDP2 job and a 2-rank DDP job on a CPU gloo mesh; a memory tier; the
remote tier on the SeaweedFS fixture); the export is loaded with
``AutoModelForCausalLM.from_pretrained`` and compared with the trained model bit for bit.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import pccheck
from pccheck.errors import ConfigError, CorruptCheckpointError, NoCheckpointError

transformers = pytest.importorskip("transformers")

CHILD = str(Path(__file__).with_name("_hf_export_child.py"))
sys.path.insert(0, str(Path(__file__).parent))
from _hf_export_child import config  # noqa: E402


def _train(path: Path, steps: int = 3, **settings):  # type: ignore[no-untyped-def]
    """A tiny Llama trained ``steps`` steps, checkpointed each step; the model (eval mode)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pccheck.Checkpointer(model, opt, path, interval=1, **settings) as ck:
        for s in range(1, steps + 1):
            x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(s))
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ck.maybe_checkpoint(s)
            ck.wait()
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    x = torch.randint(0, 96, (3, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return model(input_ids=x).logits


def _loaded(out: Path, **kw):  # type: ignore[no-untyped-def]
    return transformers.AutoModelForCausalLM.from_pretrained(out, **kw).eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("hf")
    model = _train(tmp / "ck")
    config().save_pretrained(tmp / "cfg")
    return tmp / "ck", tmp / "cfg" / "config.json", model


def test_single_process_export_loads_bit_for_bit(trained, tmp_path):
    ck, cfg, model = trained
    r = pccheck.export_hf(ck, tmp_path / "m", config=cfg)
    assert r.files == ("model.safetensors",) and r.step == 3 and r.dtype == "keep"
    assert r.tensors == len(model.state_dict()) and r.bytes == r.bytes_read > 0 and r.peak_rss > 0
    got = _loaded(tmp_path / "m")
    assert got.dtype == torch.float32
    assert torch.equal(_logits(got), _logits(model))
    want = model.state_dict()
    assert all(torch.equal(got.state_dict()[k], v) for k, v in want.items())


def test_sharded_layout_matches_hugging_face(trained, tmp_path):
    """A small max_shard_size: model-0000x-of-0000n files and an index naming every tensor once;
    a second export with fewer shards removes the first one's extra files."""
    ck, cfg, model = trained
    r = pccheck.export_hf(ck, tmp_path / "m", config=cfg, max_shard_size="30KB")
    shards = [f for f in r.files if f.endswith(".safetensors")]
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict()) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == r.bytes
    for f in shards:  # within the limit unless one tensor alone is larger
        from safetensors import safe_open

        with safe_open(tmp_path / "m" / f, "pt") as st:
            assert st.metadata()["format"] == "pt"
            sizes = [st.get_tensor(k).nbytes for k in st.keys()]
        assert sum(sizes) <= 30_000 or len(sizes) == 1
    assert torch.equal(_logits(_loaded(tmp_path / "m")), _logits(model))
    pccheck.export_hf(ck, tmp_path / "m", max_shard_size="5GB")
    names = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert names == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_dtype_conversion_rounds_as_torch_does(trained, tmp_path, dtype, torch_dtype):
    ck, cfg, model = trained
    pccheck.export_hf(ck, tmp_path / "m", config=cfg, dtype=dtype)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == str(torch_dtype)[6:]
    got = _loaded(tmp_path / "m")
    assert got.dtype == torch_dtype
    assert all(torch.equal(got.state_dict()[k], v.to(torch_dtype)) for k, v in model.state_dict().items())


def test_bf16_rounding_ties_infinities_and_nan():
    from pccheck.ops.hf_export import _convert

    special = np.array([0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, 3.4e38, 1e-40, 1.00390625, 1.01171875],
                       dtype=np.float32)
    x = np.concatenate([special, np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 1e3])
    got = _convert(x, "float32", "bfloat16")
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got, want)
    back = _convert(got, "bfloat16", "float32")
    assert np.array_equal(back.view(np.uint32), torch.from_numpy(want.view(np.int16)).view(torch.bfloat16)
                          .float().numpy().view(np.uint32))


def test_step_picks_an_older_checkpoint(trained, tmp_path):
    ck, cfg, _ = trained
    r = pccheck.export_hf(ck, tmp_path / "m", step=2, config=cfg)
    assert r.step == 2
    with pytest.raises(NoCheckpointError, match="no complete checkpoint of step 9 .*steps held: 3, 2"):
        pccheck.export_hf(ck, tmp_path / "m", step=9)


def test_bad_arguments_are_clear_errors(trained, tmp_path):
    ck, cfg, _ = trained
    with pytest.raises(ConfigError, match="dtype must be one of keep, bf16, fp32"):
        pccheck.export_hf(ck, tmp_path / "m", dtype="fp16")
    with pytest.raises(ConfigError, match="is not a size"):
        pccheck.export_hf(ck, tmp_path / "m", max_shard_size="lots")
    with pytest.raises(ConfigError, match="does not exist"):
        pccheck.export_hf(ck, tmp_path / "m", config=tmp_path / "nope.json")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        pccheck.export_hf(ck, tmp_path / "f")
    arrays = {"w": np.ones(4, dtype=np.float32)}
    with pccheck.Checkpointer(arrays, tmp_path / "plain") as c:
        c.checkpoint(1)
    with pytest.raises(ConfigError, match="holds no model state dict.*--format safetensors"):
        pccheck.export_hf(tmp_path / "plain", tmp_path / "m")


def _damage(path: Path, rank: int, step: int) -> None:
    """Flips a byte of one model array of ``rank``'s slot of ``step``."""
    from pccheck.persist.recovery import slot_base
    from pccheck.sharded.index import find_sets

    s = next(s for s in find_sets(path) if s.step == step)
    m = s.members[rank]
    entry = next(e for e in m.manifest.arrays if e.name.startswith("model/") and e.nbytes)
    with open(m.image.path, "r+b") as f:
        f.seek(slot_base(m.image, m.slot) + entry.offset)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def _job(kind: str, tmp: Path, world: int = 2) -> Path:
    init = tmp / f"init-{random.random()}"
    procs = [subprocess.Popen([sys.executable, CHILD, kind, str(tmp / "ck"), str(r), str(world), str(init),
                               str(tmp / "ref.pt")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and "SAVED" in out, err[-3000:]
    return tmp / "ck"


@pytest.fixture(scope="module")
def fsdp_job(tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("fsdp")
    return _job("fsdp", tmp), tmp


def _reference(tmp: Path) -> transformers.PreTrainedModel:
    model = transformers.LlamaForCausalLM(config())
    model.load_state_dict(torch.load(tmp / "ref.pt", weights_only=True))
    return model.eval()


def test_fsdp2_two_ranks_consolidated(fsdp_job, tmp_path):
    ck, tmp = fsdp_job
    assert (ck / "rank-1").is_dir()
    r = pccheck.export_hf(ck, tmp_path / "m", config=tmp / "config.json", max_shard_size="40KB")
    assert len(r.files) > 2 and r.step == 3
    got, want = _loaded(tmp_path / "m"), _reference(tmp)
    assert all(torch.equal(got.state_dict()[k], v) for k, v in want.state_dict().items())
    assert torch.equal(_logits(got), _logits(want))


def test_a_damaged_chunk_falls_back_or_fails_with_step(fsdp_job, tmp_path):
    import shutil

    ck, tmp = fsdp_job
    path = tmp_path / "ck"
    shutil.copytree(ck, path)
    _damage(path, 1, 3)
    with pytest.raises(CorruptCheckpointError, match="step 3 cannot be exported.*checksum mismatch"):
        pccheck.export_hf(path, tmp_path / "m", step=3)
    assert not list((tmp_path / "m").glob("*"))  # no temporary file left
    r = pccheck.export_hf(path, tmp_path / "m")
    assert r.step == 2


def _evict(path: Path) -> None:
    """Drops every file under ``path`` from the page cache (written back first)."""
    import os

    os.sync()
    for f in (p for p in path.rglob("*") if p.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_uncached_reads_bypass_the_page_cache_and_match_cached_ones(tmp_path):
    import os

    from pccheck.native import _native
    from pccheck.persist.reader import aligned_span, cached_fraction, fresh_buffer, open_direct, read_uncached

    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    _evict(tmp_path)
    fd, direct = os.open(path, os.O_RDONLY), open_direct(path)
    try:
        if cached_fraction(fd, 0, data.nbytes) != 0.0:
            pytest.skip("this filesystem keeps the file in memory (posix_fadvise DONTNEED does not evict it)")
        off, n = 4096 * 3 + 17, (2 << 20) + 101  # neither aligned: the read covers the pages around them
        buf = fresh_buffer(aligned_span(off, n))
        got, crc = read_uncached(fd, direct, off, n, buf, piece=1 << 20)
        assert np.array_equal(got, data[off:off + n]) and crc == _native.crc32c(data[off:off + n].tobytes())
        assert cached_fraction(fd, 0, data.nbytes) == 0.0  # read with O_DIRECT: nothing was cached
        os.pread(fd, data.nbytes, 0)  # now every page is cached: the read goes through the cache
        assert cached_fraction(fd, 0, data.nbytes) == 1.0
        again, crc2 = read_uncached(fd, direct, off, n, fresh_buffer(aligned_span(off, n)))
        assert np.array_equal(again, got) and crc2 == crc
        with pytest.raises(ValueError, match="buffer holds"):
            read_uncached(fd, direct, off, n, fresh_buffer(n))
        os.truncate(path, off + n - 5000)  # the file ends inside the array
        _evict(tmp_path)
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            read_uncached(fd, direct, off, n, buf)
    finally:
        os.close(fd)
        os.close(direct)


def test_a_cold_fsdp2_checkpoint_exports_bit_for_bit_and_damage_is_caught(fsdp_job, tmp_path):
    import shutil

    ck, tmp = fsdp_job
    path = tmp_path / "ck"
    shutil.copytree(ck, path)
    _evict(path)  # the chunks are read past the page cache
    pccheck.export_hf(path, tmp_path / "m", config=tmp / "config.json")
    got, want = _loaded(tmp_path / "m"), _reference(tmp)
    assert all(torch.equal(got.state_dict()[k], v) for k, v in want.state_dict().items())
    _damage(path, 0, 3)
    _evict(path)
    with pytest.raises(CorruptCheckpointError, match="step 3 cannot be exported.*checksum mismatch"):
        pccheck.export_hf(path, tmp_path / "m2", step=3)


def test_ddp_exports_rank_zero_under_the_wrapped_model_names(tmp_path):
    ck = _job("ddp", tmp_path)
    r = pccheck.export_hf(ck, tmp_path / "m", config=tmp_path / "config.json")
    got, want = _loaded(tmp_path / "m"), _reference(tmp_path)
    assert r.tensors == len(want.state_dict())  # "module." dropped: the names from_pretrained knows
    assert torch.equal(_logits(got), _logits(want))


def test_memory_tier_store(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mem = tmp_path / "mem"
    with pccheck.Checkpointer(model, opt, tmp_path / "ck", disk=pccheck.DiskOptions(every=100),
                              memory=pccheck.MemoryOptions(every=1, dir=mem)) as ck:
        for s in (1, 2):
            x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(s))
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ck.maybe_checkpoint(s)
            ck.wait()
        r = pccheck.export_hf(mem, tmp_path / "m")
    assert r.step == 2
    config().save_pretrained(tmp_path / "m")
    assert torch.equal(_logits(_loaded(tmp_path / "m")), _logits(model.eval()))


def test_remote_tier(s3_url, tmp_path, trained):
    _, cfg, _ = trained
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pccheck.Checkpointer(model, opt, tmp_path / "ck", interval=1, remote=s3_url) as ck:
        x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        ck.maybe_checkpoint(1)
        assert ck.wait(remote=True, timeout=60)
    r = pccheck.export_hf(s3_url, tmp_path / "m", config=cfg)
    assert r.step == 1 and r.bytes_read == r.bytes
    assert torch.equal(_logits(_loaded(tmp_path / "m")), _logits(model.eval()))


def test_cli(trained, tmp_path):
    from typer.testing import CliRunner

    from pccheck.commands.cli import app

    ck, cfg, model = trained
    res = CliRunner().invoke(app, ["export", str(ck), "--format", "hf", "--out", str(tmp_path / "m"), "--step", "3",
                                   "--dtype", "keep", "--max-shard-size", "30KB", "--config", str(cfg), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["format"] == "hf" and doc["step"] == 3 and "model.safetensors.index.json" in doc["files"]
    assert torch.equal(_logits(_loaded(tmp_path / "m")), _logits(model))
    res = CliRunner().invoke(app, ["export", str(ck), "--format", "safetensors", "--out", str(tmp_path / "x"),
                                   "--dtype", "bf16"])
    assert res.exit_code == 2 and "belong to --format hf" in res.output
