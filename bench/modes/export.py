"""Hugging Face export of an FSDP2 checkpoint: pccheck's against the raw read of its bytes and DCP's.

``python -m bench.export`` saves an FSDP2 model of ``--size`` (default 1 GiB) float32 weights in
``--layers`` (default 16) bias-free Linear layers, sharded over ``--world`` (default 4) gloo ranks
on this machine (torchrun; ``bench/modes/export_child.py``), once with a pccheck ``Checkpointer``
and once with ``torch.distributed.checkpoint.save`` through ``HuggingFaceStorageWriter
(save_distributed=True)``. Then, per repeat, each from cold files (``sync`` and
``posix_fadvise(DONTNEED)`` on every file of the work directory) and each in a fresh process:

- ``raw``: the floor: reading exactly the bytes the export reads (every chunk of the model, from
  each rank's store file, at its offset) with plain ``pread`` into one reused buffer, nothing checked;
- ``pccheck``: ``pccheck.export_hf`` to one directory (the crc32c of every chunk checked, the
  output fsynced): its seconds and the process's peak RSS (``ru_maxrss``) and the RSS before the
  call (the interpreter and imports);
- ``dcp``: ``consolidate_safetensors_files`` of the DCP checkpoint into one file (DCP does not
  fsync: ``dcp_sync_s`` is the ``os.sync`` right after it, ``seconds_synced`` their sum);
- ``pccheck_shm``, ``dcp_shm``: the same with the output on /dev/shm (when it has room): the
  export's own path, without the disk's write rate (on the CI VM about a quarter of its read rate,
  so an output on the same disk cannot come near the read floor).

Targets: pccheck's export at most 1.2x the raw read (judged for both outputs); its peak RSS at most 2x the largest tensor
plus 256 MiB. DCP's figures are reported beside them. Writes ``--json`` (default
``bench/results/export/latest.json``); ``--quick``: 64 MiB in 4 layers, 1 repeat (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.harness.common import (BENCH_DIR, fmt, format_size, host_info, machine_label, median_or_none, parse_size,
                                  print_table, result_path, scratch_dir, write_json)
from bench.harness.probes import wait_quiet
from bench.modes.sharded import make_cold  # POSIX_FADV_DONTNEED on every file of a checkpoint

__all__ = ["run", "targets", "report", "main"]

_CHILD = Path(__file__).resolve().with_name("export_child.py")
TIME_LIMIT = 1.2        # pccheck's export / the raw read of the same bytes
RSS_SLACK = 256 << 20   # peak RSS <= 2 x the largest tensor + this

_RAW = """
import json, os, sys, time
import numpy as np
ranges = json.loads(sys.argv[1])
buf = memoryview(np.empty(max(n for _, _, n in ranges), dtype=np.uint8))
fds = {}
t0 = time.perf_counter()
for path, off, n in ranges:
    fd = fds.get(path) or fds.setdefault(path, os.open(path, os.O_RDONLY))
    done = 0
    while done < n:
        done += os.preadv(fd, [buf[done:n]], off + done)
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""

_PCCHECK = """
import json, resource, sys, time
import pccheck
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
r = pccheck.export_hf(sys.argv[1], sys.argv[2])
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss": r.peak_rss, "rss_before": before,
                  "bytes": r.bytes, "bytes_read": r.bytes_read, "files": list(r.files)}))
"""

_DCP = """
import json, os, resource, sys, time
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
fqns = json.loads(sys.argv[3])
os.makedirs(sys.argv[2], exist_ok=True)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
consolidate_safetensors_files(sys.argv[1], sys.argv[2], {f: 1 for f in fqns})
t1 = time.perf_counter()
os.sync()
t2 = time.perf_counter()
print(json.dumps({"seconds": t1 - t0, "dcp_sync_s": t2 - t1, "seconds_synced": t2 - t0,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss_before": before}))
"""


def _env() -> dict[str, str]:
    root = str(BENCH_DIR.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def _python(code: str, *args: str, timeout: float = 1200) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=_env(),
                       timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def _shm_out(nbytes: int) -> Path | None:
    """A directory on /dev/shm for the output when it has room for it twice over (None: no tmpfs)."""
    root = Path("/dev/shm")
    if not root.is_dir() or shutil.disk_usage(root).free < 2 * nbytes + (256 << 20):
        return None
    import tempfile

    return Path(tempfile.mkdtemp(prefix="pccheck-bench-export-", dir=root))


def _layout(ck: Path) -> tuple[list[tuple[str, int, int]], int, list[str]]:
    """(file, offset, bytes) of every model chunk the export reads, the largest tensor's bytes, the fqns."""
    sys.path.insert(0, str(BENCH_DIR.parent))
    from pccheck.persist.recovery import slot_base
    from pccheck.sharded.index import find_sets

    s = find_sets(ck)[0]
    ranges, largest = [], 0
    for info in s.tensors().values():
        largest = max(largest, _nbytes(info.shape, 4))  # float32 weights
        for c in info.chunks:
            m = s.members[c.rank]
            e = m.entries[c.array][0]
            ranges.append((str(m.image.path), slot_base(m.image, m.slot) + e.offset, e.nbytes))
    fqns = [f.removeprefix("model/") for f in s.tensors()]
    return sorted(ranges), largest, fqns


def _nbytes(shape: Sequence[int], itemsize: int) -> int:
    n = itemsize
    for d in shape:
        n *= d
    return n


def run(cfg: Mapping[str, Any], repeats: int, base_dir: Path) -> dict[str, Any]:
    with scratch_dir(base_dir) as work:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={cfg['world']}", str(_CHILD), str(work), str(cfg["nbytes"]),
                            str(cfg["layers"])], capture_output=True, text=True, env=_env(), timeout=3600)
        if p.returncode != 0 or "SAVED" not in p.stdout:
            raise RuntimeError(p.stderr[-3000:])
        save_s = time.perf_counter() - t0
        ranges, largest, fqns = _layout(work / "pccheck")
        runs = []
        shm = _shm_out(cfg["nbytes"])
        cells = ["raw", "pccheck", "dcp"] + (["pccheck_shm", "dcp_shm"] if shm is not None else [])
        for i in range(repeats):
            one: dict[str, Any] = {}
            for cell in (cells if i % 2 == 0 else cells[::-1]):
                out = (shm if cell.endswith("_shm") else work) / "out"  # type: ignore[operator]
                shutil.rmtree(out, ignore_errors=True)
                make_cold(work)
                waited, other = wait_quiet(cfg["quiet_wait_s"])
                try:
                    if cell == "raw":
                        one[cell] = _python(_RAW, json.dumps(ranges))
                    elif cell.startswith("pccheck"):
                        one[cell] = _python(_PCCHECK, str(work / "pccheck"), str(out))
                    else:
                        one[cell] = _python(_DCP, str(work / "dcp"), str(out), json.dumps(fqns))
                finally:
                    shutil.rmtree(out, ignore_errors=True)
                one[cell].update(quiet_wait_s=waited, other_cpus=other)
            runs.append(one)
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
    summary = _summary(runs)
    nbytes = sum(n for _, _, n in ranges)
    return {"config": dict(cfg), "host": host_info(base_dir), "machine": machine_label(host_info(base_dir)),
            "save_s": save_s, "bytes": nbytes, "largest_tensor_bytes": largest, "runs": runs, "summary": summary}


def _summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    def med(system: str, key: str) -> float | None:
        return median_or_none([r[system][key] for r in runs if key in r.get(system, {})])

    return {"raw_s": med("raw", "seconds"), "pccheck_s": med("pccheck", "seconds"),
            "pccheck_peak_rss": med("pccheck", "peak_rss"), "pccheck_rss_before": med("pccheck", "rss_before"),
            "dcp_s": med("dcp", "seconds"), "dcp_s_synced": med("dcp", "seconds_synced"),
            "dcp_peak_rss": med("dcp", "peak_rss"), "dcp_rss_before": med("dcp", "rss_before"),
            "pccheck_shm_s": med("pccheck_shm", "seconds"), "dcp_shm_s": med("dcp_shm", "seconds"),
            "pccheck_shm_peak_rss": med("pccheck_shm", "peak_rss")}


def targets(res: Mapping[str, Any]) -> list[dict[str, Any]]:
    s = res["summary"]
    rss_limit = 2 * res["largest_tensor_bytes"] + RSS_SLACK
    shm = [] if s.get("pccheck_shm_s") is None else [
        {"what": "export time, output on /dev/shm / raw read of its bytes", "value": s["pccheck_shm_s"] / s["raw_s"],
         "limit": TIME_LIMIT},
        {"what": "export time / DCP consolidation, both to /dev/shm (reported)",
         "value": s["pccheck_shm_s"] / s["dcp_shm_s"], "limit": None}]
    return [{"what": "export time, output on the disk (fsynced) / raw read of its bytes",
             "value": s["pccheck_s"] / s["raw_s"], "limit": TIME_LIMIT}, *shm,
            {"what": "peak RSS / (2 x largest tensor + 256 MiB)", "value": s["pccheck_peak_rss"] / rss_limit,
             "limit": 1.0},
            {"what": "export time / DCP consolidation + sync (reported)", "value": s["pccheck_s"] / s["dcp_s_synced"],
             "limit": None},
            {"what": "peak RSS / DCP's (reported)", "value": s["pccheck_peak_rss"] / s["dcp_peak_rss"], "limit": None}]


def report(res: Mapping[str, Any]) -> None:
    s = res["summary"]
    mib = 1 << 20
    print(f"{format_size(res['bytes'])} FSDP2 checkpoint of {res['config']['world']} ranks, largest tensor "
          f"{format_size(res['largest_tensor_bytes'])}; {res['machine']}; medians of {len(res['runs'])} repeats")
    print_table("Hugging Face export, cold files", ["system", "seconds", "peak RSS MiB", "RSS before MiB"], [
        ["raw read (floor)", fmt(s["raw_s"], ".2f"), "-", "-"],
        ["pccheck export_hf", fmt(s["pccheck_s"], ".2f"), fmt(s["pccheck_peak_rss"] / mib, ".0f"),
         fmt(s["pccheck_rss_before"] / mib, ".0f")],
        ["DCP consolidate (no fsync)", fmt(s["dcp_s"], ".2f"), fmt(s["dcp_peak_rss"] / mib, ".0f"),
         fmt(s["dcp_rss_before"] / mib, ".0f")],
        ["DCP consolidate + sync", fmt(s["dcp_s_synced"], ".2f"), "-", "-"],
        ["pccheck export_hf to /dev/shm", fmt(s.get("pccheck_shm_s"), ".2f"),
         fmt((s.get("pccheck_shm_peak_rss") or 0) / mib, ".0f"), "-"],
        ["DCP consolidate to /dev/shm", fmt(s.get("dcp_shm_s"), ".2f"), "-", "-"]])
    for t in targets(res):
        verdict = "" if t["limit"] is None else ("  ok" if t["value"] <= t["limit"] else "  MISSED")
        limit = "" if t["limit"] is None else f" (target <= {t['limit']})"
        print(f"{t['what']}: {t['value']:.2f}{limit}{verdict}")


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="model weights in all (default 1GiB)")
    p.add_argument("--layers", type=int, default=16, help="Linear layers (default 16: 64 MiB tensors at 1 GiB)")
    p.add_argument("--world", type=int, default=4, help="ranks of the save job (default 4)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quiet-wait", type=float, default=30.0, help="seconds to wait for a quiet machine per cell")
    p.add_argument("--dir", type=Path, default=BENCH_DIR / "_scratch", help="work directory's parent")
    p.add_argument("--quick", action="store_true", help="64 MiB in 4 layers, 1 repeat (a smoke run)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.size, a.layers, a.repeats = 64 << 20, 4, 1
    if a.json is None:
        a.json = result_path("export", quick=a.quick)
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    a = _parse_args(args)
    cfg = {"nbytes": a.size, "layers": a.layers, "world": a.world, "quiet_wait_s": a.quiet_wait}
    t0 = time.perf_counter()
    res = {"command": shlex.join(["python", "-m", "bench.export", *args]), **run(cfg, a.repeats, a.dir)}
    res["date"] = res["host"]["date"]
    res["targets"] = targets(res)
    res["runtime_s"] = time.perf_counter() - t0
    report(res)
    write_json(a.json, res)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
