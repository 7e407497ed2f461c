"""The remote tier against its peers on one SeaweedFS server .

    python -m bench.remote --size 1GiB --iter-time 0.2 --every 10 --iters 60 [--out bench/results/remote/latest.json]

**The GPU is emulated** (bench/workloads.py, ``make_emulated``: sleep ``--iter-time``, then an SGD
step over the whole state). A fresh ``weed mini`` on 127.0.0.1 (pccheck.tiers.remote.devserver)
serves every row. Rows, each the same loop with a checkpoint every ``--every`` iterations:

* ``none``: no checkpoint (the loop's own time);
* ``local``: pccheck, local store only;
* ``pccheck-remote``: pccheck with ``remote=`` (every checkpoint queued for upload; a newer one
  supersedes a queued one, as the tier does);
* ``torch.save+upload``: ``torch.save`` + fsync of the state dict on the training thread, then a
  boto3 multipart upload of the file on a background thread (same part size and concurrency;
  one upload at a time, the newest file next);
* ``local-beside-raw-upload``: the ``local`` loop while boto3 uploads the state's size from
  memory again and again beside it (unsigned body, the uploader's nice): the loop's physical floor
  with that much upload traffic on this machine (the server shares its CPUs), no pccheck upload;
* ``raw-client``: boto3 uploading the same bytes from memory, no loop, with its default (body
  hashed for SigV4 over http) and with an unsigned body; the better of the two is its best;
* ``--upload-only``: no loop; pccheck's ``upload_slot`` from a committed slot against the raw
  client, alternating ``--repeat`` times (is the upload path itself slower than the client?);
* ``dcp.async_save+FsspecWriter`` (with ``--s3fs-path``): DCP's async save to s3fs, one in flight,
  in a child process (bench/resilience/remote_dcp_child.py), and its cold load with ``FsspecReader``.

Per row: the loop's wall time, blocked per save (loop time over ``none``, per save), time from the
save call until the checkpoint is committed remotely (median over committed ones), upload
throughput, and a cold load from the remote (pccheck ``load_latest("s3://...")`` vs download +
``torch.load``; with ``--s3fs-path``, DCP's ``FsspecReader``).
Speeds on 2 vCPUs are the server's: compare ratios between rows of one run.

``--bucket NAME`` runs every row against an existing server instead (its endpoint and keys from
the standard AWS variables, e.g. ``AWS_ENDPOINT_URL``; the bucket must exist and allow conditional
writes): a server on another host is what the loop targets need, since on one machine the
server's CPU work lands on the training loop (bench/README, "Remote tier").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.harness.common import result_path, bar_chart, host_info, parse_size
from bench.harness.workloads import make_emulated
from pccheck.tiers.remote.devserver import DevServer

PART = 32 << 20
CONC = 4


def _env(srv: DevServer) -> None:
    os.environ.update(srv.env())


class ExternalServer:
    """An S3 server this bench does not start: the bucket given, the AWS variables as they are."""

    def __init__(self, bucket: str) -> None:
        if not os.environ.get("AWS_ENDPOINT_URL"):
            raise SystemExit("--bucket needs AWS_ENDPOINT_URL (and the server's keys in the AWS variables)")
        self.bucket = bucket

    def start(self) -> ExternalServer:
        return self

    def env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k.startswith("AWS_")}

    def stop(self) -> None:
        """Nothing to stop: the server is not this bench's."""


def _server(a: argparse.Namespace, directory: Path) -> DevServer | ExternalServer:
    return ExternalServer(a.bucket) if a.bucket else DevServer(directory).start()


def _where(srv: DevServer | ExternalServer) -> dict[str, str]:
    """The server a run used, for its JSON."""
    return {"endpoint": srv.env()["AWS_ENDPOINT_URL"], "bucket": srv.bucket}


def _client():
    from pccheck.tiers.remote.objstore import ObjectStore

    return ObjectStore  # the tier's own wrapper: same timeouts and pool for every row


def _upload_file(url: str, path: Path, key: str) -> int:
    """A multipart upload of ``path`` with the tier's part size and concurrency; returns bytes."""
    import mmap

    store = _client()(url, connections=CONC + 4)
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        up = store.start_multipart(key)
        offs = list(range(0, size, PART))
        with ThreadPoolExecutor(CONC) as ex:
            etags = list(ex.map(lambda io: store.upload_part(key, up, io[0] + 1, view[io[1]:io[1] + PART]),
                                enumerate(offs)))
        store.complete_multipart(key, up, etags)
        view.release()
    return size


def _loop(wl: Any, iters: int, every: int, on_save: Any) -> tuple[float, dict[int, float]]:
    calls: dict[int, float] = {}
    t0 = time.perf_counter()
    for step in range(1, iters + 1):
        wl.step()
        if on_save is not None and step % every == 0:
            calls[step] = time.time()
            on_save(step)
    return time.perf_counter() - t0, calls


def row_none(wl: Any, a: argparse.Namespace, work: Path, url: str) -> dict[str, Any]:
    wall, _ = _loop(wl, a.iters, a.every, None)
    return {"wall_s": wall, "saves": 0}


def row_pccheck(wl: Any, a: argparse.Namespace, work: Path, url: str | None) -> dict[str, Any]:
    import pccheck

    kw = {"remote": url, "remote_part_size": PART, "remote_concurrency": CONC, "remote_keep_last": 2} if url else {}
    where = work / f"ck-{uuid.uuid4().hex[:6]}"
    ck = pccheck.Checkpointer(wl.model, wl.optimizer, where, interval=a.every, **kw)
    wl.step()  # the first step outside timing: Adam-free SGD, but the store opens here
    wall, calls = _loop(wl, a.iters, a.every, lambda s: ck.maybe_checkpoint(s))
    t_end = time.time()
    out: dict[str, Any] = {"wall_s": wall, "saves": len(calls)}
    if url:
        ck.wait(remote=True, timeout=600)
        hist = list(ck._remote.progress.history)
        out["committed"] = [h[0] for h in hist]
        out["to_remote_s"] = [h[2] - calls[h[0]] for h in hist if h[0] in calls]
        out["upload_gbps"] = [h[3] / h[4] / 1e9 for h in hist]
        # where the time until committed remotely goes: save call -> local commit -> the upload
        # starts (waiting for the one before it) -> committed remotely
        out["call_to_local_commit_s"] = [h[1] - calls[h[0]] for h in hist if h[0] in calls]
        out["local_commit_to_upload_start_s"] = [h[2] - h[4] - h[1] for h in hist if h[0] in calls]
        out["upload_s"] = [h[4] for h in hist if h[0] in calls]
        out["drain_after_loop_s"] = time.time() - t_end
    ck.close()
    shutil.rmtree(where)  # disk: a 1 GiB state's store is 4-5 GiB
    return out


def row_torch_save(wl: Any, a: argparse.Namespace, work: Path, url: str) -> dict[str, Any]:
    import torch

    lock = threading.Condition()
    pending: list[tuple[int, Path]] = []
    done: list[tuple[int, float, int, float]] = []
    stop = [False]

    def uploader() -> None:
        while True:
            with lock:
                lock.wait_for(lambda: pending or stop[0])
                if not pending:
                    return
                step, path = pending.pop()
                pending.clear()  # the newest supersedes the queued ones
            t = time.perf_counter()
            n = _upload_file(url, path, f"torchsave/{step:06d}-{uuid.uuid4().hex[:8]}.pt")
            done.append((step, time.time(), n, time.perf_counter() - t))
            for old in work.glob("ts-*.pt"):  # disk: only files not uploaded yet stay
                if old != path and int(old.stem[3:]) < step:
                    old.unlink(missing_ok=True)
            path.unlink(missing_ok=True)

    th = threading.Thread(target=uploader, daemon=True)
    th.start()

    def save(step: int) -> None:
        path = work / f"ts-{step}.pt"
        with open(path, "wb") as f:
            torch.save(wl.model.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        with lock:
            pending.append((step, path))
            lock.notify_all()

    wl.step()
    wall, calls = _loop(wl, a.iters, a.every, save)
    with lock:
        stop[0] = True
        lock.notify_all()
    th.join()
    return {"wall_s": wall, "saves": len(calls), "committed": [d[0] for d in done],
            "to_remote_s": [d[1] - calls[d[0]] for d in done], "upload_gbps": [d[2] / d[3] / 1e9 for d in done]}


_RAW_DATA: dict[int, Any] = {}


def raw_client(size: int, url: str, stop: threading.Event | None = None, unsigned: bool = False) -> float:
    """boto3 uploading ``size`` bytes from memory (multipart, PART, CONC): its GB/s. ``unsigned``:
    the body sent without SigV4's SHA-256 (``payload_signing_enabled=False``, no checksum: the
    least client CPU boto3 can spend), else boto3's default over http (the body hashed)."""
    import numpy as np
    from botocore.config import Config

    from pccheck.tiers.remote.objstore import _View
    from pccheck.tiers.remote.uploader import _background_priority

    store = _client()(url, connections=CONC + 4)
    cl = store.client
    if unsigned:
        cl = boto3_client(cl.meta.config.merge(Config(s3={"payload_signing_enabled": False})))
    if size not in _RAW_DATA:  # one buffer, touched once, for every upload of this size
        _RAW_DATA.clear()
        _RAW_DATA[size] = np.ones(size, dtype=np.uint8)
    view = memoryview(_RAW_DATA[size])
    key = store.key(f"raw/{uuid.uuid4().hex}")
    t = time.perf_counter()
    up = cl.create_multipart_upload(Bucket=store.bucket, Key=key)["UploadId"]

    def part(i_off: tuple[int, int]) -> str:
        i, off = i_off
        return cl.upload_part(Bucket=store.bucket, Key=key, UploadId=up, PartNumber=i + 1,
                              Body=_View(view[off:off + PART]))["ETag"]

    with ThreadPoolExecutor(CONC, initializer=_background_priority if stop is not None else None) as ex:
        etags = list(ex.map(part, enumerate(range(0, size, PART))))
    cl.complete_multipart_upload(Bucket=store.bucket, Key=key, UploadId=up, MultipartUpload={
        "Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]})
    gbps = size / (time.perf_counter() - t) / 1e9
    cl.delete_object(Bucket=store.bucket, Key=key)  # disk: 1 GiB per upload
    return gbps


def boto3_client(config: Any) -> Any:
    import boto3

    return boto3.session.Session().client("s3", config=config)


def cold_loads(wl: Any, url: str, work: Path) -> dict[str, float]:
    """pccheck's load from the remote into the model vs download + torch.load of the newest file."""
    import torch

    import pccheck

    t = time.perf_counter()
    r = pccheck.load_latest(url + "/pccheck", model=wl.model, optimizer=wl.optimizer)
    pcc = time.perf_counter() - t
    assert r.tier == "remote"
    t = time.perf_counter()  # both rows pay for their client (boto3 loads its service model)
    store = _client()(url)
    key, size = sorted((o.key, o.size) for o in store.list("torchsave/"))[-1]
    buf = bytearray(size)
    parts = [(o, min(PART, size - o)) for o in range(0, size, PART)]
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda p: store.read_into(key, p[0], memoryview(buf)[p[0]:p[0] + p[1]]), parts))
    import io

    sd = torch.load(io.BytesIO(buf), weights_only=True)
    wl.model.load_state_dict(sd)
    ts = time.perf_counter() - t
    return {"pccheck_load_s": pcc, "torch_download_load_s": ts}


def row_dcp(a: argparse.Namespace, url: str) -> dict[str, Any] | None:
    """DCP ``async_save`` + ``FsspecWriter`` (s3fs) in a child process (bench/resilience/remote_dcp_child.py),
    s3fs from ``--s3fs-path`` (it pins a botocore that boto3 cannot share a process with)."""
    import subprocess
    import sys

    if not a.s3fs_path:
        return None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([a.s3fs_path, str(Path(__file__).resolve().parent.parent)]))
    out = subprocess.run([sys.executable, "-m", "bench.remote_dcp_child", a.size, str(a.iter_time), str(a.every),
                          str(a.iters), url], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"the DCP row failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def row_local_beside_upload(wl: Any, a: argparse.Namespace, work: Path, url: str) -> dict[str, Any]:
    """The local-only loop while the raw client uploads the state's size, again and again, on
    threads at the uploader's priority: the slowdown the traffic alone causes on this machine
    (the server shares its CPUs), without any of pccheck's remote tier."""
    from pccheck.tiers.remote.uploader import _background_priority

    stop = threading.Event()
    size = parse_size(a.size)
    gbps: list[float] = []

    def pump() -> None:
        _background_priority()
        while not stop.is_set():
            gbps.append(raw_client(size, url, stop, unsigned=True))

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    try:
        out = row_pccheck(wl, a, work, None)
    finally:
        stop.set()
        th.join()
    out["raw_upload_gbps_beside_loop"] = gbps  # the last one may have run past the loop's end
    return out


def run_once(a: argparse.Namespace, srv: DevServer, work: Path) -> dict[str, Any]:
    size = parse_size(a.size)
    base = f"s3://{srv.bucket}/bench-{uuid.uuid4().hex[:6]}"
    res: dict[str, Any] = {}
    wl = make_emulated(size, a.iter_time)
    res["none"] = row_none(wl, a, work, base)
    if a.attribution:  # only: local, pccheck-remote, local beside the raw client's uploads
        res["local"] = row_pccheck(wl, a, work, None)
        res["pccheck-remote"] = row_pccheck(wl, a, work, base + "/pccheck")
        res["local-beside-raw-upload"] = row_local_beside_upload(wl, a, work, base)
        return res
    res["local"] = row_pccheck(wl, a, work, None)
    res["pccheck-remote"] = row_pccheck(wl, a, work, base + "/pccheck")
    res["local-beside-raw-upload"] = row_local_beside_upload(wl, a, work, base)  # the loop's floor
    res["torch.save+upload"] = row_torch_save(wl, a, work, base)
    res["raw-client"] = {"upload_gbps": [raw_client(size, base)], "upload_gbps_unsigned": [raw_client(size, base, None, True)]}
    res["cold_load"] = cold_loads(wl, base, work)
    del wl  # the DCP child builds its own state
    dcp_row = row_dcp(a, base + "/dcp")
    if dcp_row is not None:
        res["dcp.async_save+FsspecWriter"] = dcp_row
    return res


def upload_path_only(a: argparse.Namespace, work: Path, base: str) -> dict[str, Any]:
    """``--upload-only``: the upload path alone, no training loop: pccheck's ``upload_slot`` from a
    committed local slot of ``--size`` bytes (read from the store file, per-part and per-array
    crc32c, the same BufferPool and sender threads as the tier, at normal priority here) against
    the raw client uploading the same number of bytes from memory, alternating, the same part
    size, concurrency and ObjectStore settings."""
    import numpy as np

    import pccheck
    from pccheck.persist.recovery import read_store
    from pccheck.tiers.remote.upload import BufferPool, SlotRef, upload_slot

    size = parse_size(a.size)  # pccheck_upload_slot_gbps vs the best of the raw client's two settings
    where = work / "ck"
    with pccheck.Checkpointer({"w": np.ones(size, dtype=np.uint8)}, where) as ck:
        ck.checkpoint(1)
        ck.wait()
        file = ck._orch.store.file
    meta = next(st.meta for st in read_store(file).slots if st.meta and st.meta["step"] == 1)
    ref = SlotRef(file, next(st.slot for st in read_store(file).slots if st.meta == meta), meta["counter"], 1)
    store = _client()(base, connections=CONC + 4)
    out: dict[str, Any] = {"pccheck_upload_slot_gbps": [], "raw_client_gbps": [], "raw_client_unsigned_gbps": []}
    pool = BufferPool(CONC + 1, PART)  # the tier allocates its pool once per uploader
    for _ in range(a.repeat):
        os_drop_cache(file)  # as after an O_DIRECT commit: the slot's pages are not cached
        with ThreadPoolExecutor(CONC, thread_name_prefix="bench-part") as senders:
            t = time.perf_counter()
            part = upload_slot(store, ref, 1, 0, PART, pool, senders, lambda: False)
            out["pccheck_upload_slot_gbps"].append(part.size / (time.perf_counter() - t) / 1e9)
        store.delete(part.data)  # disk: 1 GiB per upload
        out["raw_client_gbps"].append(raw_client(size, base, None))
        out["raw_client_unsigned_gbps"].append(raw_client(size, base, None, True))
    shutil.rmtree(where)
    p = out["pccheck_upload_slot_gbps"]
    r = [max(x, y) for x, y in zip(out["raw_client_gbps"], out["raw_client_unsigned_gbps"])]  # the best per round
    ratios = [x / y for x, y in zip(p, r)]
    out["summary"] = {"pccheck_median_gbps": statistics.median(p), "pccheck_range": [min(p), max(p)],
                      "raw_best_median_gbps": statistics.median(r), "raw_best_range": [min(r), max(r)],
                      "raw_signed_median_gbps": statistics.median(out["raw_client_gbps"]),
                      "raw_unsigned_median_gbps": statistics.median(out["raw_client_unsigned_gbps"]),
                      "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]}
    return out


def os_drop_cache(file: Path) -> None:
    """Drops ``file``'s cached pages (POSIX_FADV_DONTNEED)."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def summarize_attribution(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each row's loop against ``none`` and ``local`` (median [min, max] over runs)."""
    out: dict[str, Any] = {}
    for name in ("local", "pccheck-remote", "local-beside-raw-upload"):
        vs_none = [r[name]["wall_s"] / r["none"]["wall_s"] for r in runs]
        vs_local = [r[name]["wall_s"] / r["local"]["wall_s"] for r in runs]
        out[name] = {"slowdown_vs_none": statistics.median(vs_none), "range_vs_none": [min(vs_none), max(vs_none)],
                     "slowdown_vs_local": statistics.median(vs_local), "range_vs_local": [min(vs_local), max(vs_local)]}
    return out


def summarize(runs: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    if a.attribution:
        return summarize_attribution(runs)

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    out: dict[str, Any] = {}
    for name in ("local", "pccheck-remote", "torch.save+upload"):
        blocked = [(r[name]["wall_s"] - r["none"]["wall_s"]) / max(1, r[name]["saves"]) for r in runs]
        slow = [r[name]["wall_s"] / r["none"]["wall_s"] for r in runs]
        out[name] = {"blocked_per_save_s": med(blocked), "blocked_range": [min(blocked), max(blocked)],
                     "slowdown_vs_none": med(slow), "slowdown_range": [min(slow), max(slow)]}
        if name != "local":
            to = [med(r[name]["to_remote_s"]) for r in runs if r[name]["to_remote_s"]]
            gb = [med(r[name]["upload_gbps"]) for r in runs if r[name]["upload_gbps"]]
            out[name].update({"to_remote_s": med(to), "to_remote_range": [min(to), max(to)] if to else None,
                              "upload_gbps": med(gb), "upload_range": [min(gb), max(gb)] if gb else None})
    if all("dcp.async_save+FsspecWriter" in r for r in runs):
        d = [r["dcp.async_save+FsspecWriter"] for r in runs]
        blocked = [(x["wall_s"] - x["none_wall_s"]) / max(1, x["saves"]) for x in d]
        to = [med(x["to_remote_s"]) for x in d]
        out["dcp.async_save+FsspecWriter"] = {
            "blocked_per_save_s": med(blocked), "blocked_range": [min(blocked), max(blocked)],
            "slowdown_vs_none": med([x["wall_s"] / x["none_wall_s"] for x in d]),
            "to_remote_s": med(to), "to_remote_range": [min(to), max(to)],
            "upload_gbps": med([med(x["upload_gbps"]) for x in d]),
            "cold_load_s": med([x["cold_load_s"] for x in d])}
    raw = [max(r["raw-client"]["upload_gbps"] + r["raw-client"].get("upload_gbps_unsigned", [])) for r in runs]
    out["raw-client"] = {"upload_gbps": med(raw), "upload_range": [min(raw), max(raw)],
                         "note": "the best of boto3's default (signed body) and an unsigned body, per run"}
    floor = [r["local-beside-raw-upload"]["wall_s"] / r["local"]["wall_s"] for r in runs]
    beside = [med(r["local-beside-raw-upload"]["raw_upload_gbps_beside_loop"]) for r in runs]
    out["local-beside-raw-upload"] = {"loop_vs_local": med(floor), "loop_vs_local_range": [min(floor), max(floor)],
                                      "raw_upload_gbps_beside_loop": med(beside)}
    out["pccheck-remote"]["breakdown_median_s"] = {
        k: med([med(r["pccheck-remote"][k]) for r in runs]) for k in
        ("call_to_local_commit_s", "local_commit_to_upload_start_s", "upload_s")}
    pr, ts = out["pccheck-remote"], out["torch.save+upload"]
    loop_local = [r["local"]["wall_s"] for r in runs]
    loop_remote = [r["pccheck-remote"]["wall_s"] for r in runs]
    out["ratios"] = {
        "upload_vs_raw_client": pr["upload_gbps"] / out["raw-client"]["upload_gbps"] if pr["upload_gbps"] else None,
        "blocked_vs_torch_save_upload": (pr["blocked_per_save_s"] / ts["blocked_per_save_s"]
                                         if ts["blocked_per_save_s"] else None),
        "to_remote_vs_torch_save_upload": pr["to_remote_s"] / ts["to_remote_s"] if ts["to_remote_s"] else None,
        "cold_load_vs_torch_download_load": med([r["cold_load"]["pccheck_load_s"] / r["cold_load"]["torch_download_load_s"]
                                                 for r in runs]),
        "loop_remote_vs_local": med([r / l for r, l in zip(loop_remote, loop_local)]),
        "loop_floor_raw_upload_vs_local": out["local-beside-raw-upload"]["loop_vs_local"],
        "upload_in_loop_vs_raw_beside_loop": (pr["upload_gbps"] / out["local-beside-raw-upload"]["raw_upload_gbps_beside_loop"]
                                              if pr["upload_gbps"] else None),
        **_dcp_ratios(out, runs),
        "loop_remote_vs_local_range": [min(r / l for r, l in zip(loop_remote, loop_local)),
                                       max(r / l for r, l in zip(loop_remote, loop_local))],
    }
    return out


def _dcp_ratios(out: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    d = out.get("dcp.async_save+FsspecWriter")
    if d is None:
        return {}
    pr = out["pccheck-remote"]
    loads = [r["cold_load"]["pccheck_load_s"] for r in runs]
    return {"blocked_vs_dcp_fsspec": pr["blocked_per_save_s"] / d["blocked_per_save_s"] if d["blocked_per_save_s"] else None,
            "to_remote_vs_dcp_fsspec": pr["to_remote_s"] / d["to_remote_s"] if d["to_remote_s"] else None,
            "cold_load_vs_dcp_fsspec_reader": statistics.median(loads) / d["cold_load_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--iter-time", type=float, default=0.2)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=None, help="default bench/results/remote/latest.json "
                    "(--upload-only: latest-upload-only.json; --attribution: latest-attribution.json)")
    ap.add_argument("--attribution", action="store_true",
                    help="only the loop rows: local, pccheck-remote, and local beside the raw client's uploads")
    ap.add_argument("--s3fs-path", default=os.environ.get("PCCHECK_BENCH_S3FS"),
                    help="a directory holding s3fs (pip install --target DIR s3fs) for the DCP row")
    ap.add_argument("--upload-only", action="store_true",
                    help="only the upload path, no loop: pccheck's upload_slot vs the raw client, alternating")
    ap.add_argument("--bucket", help="use an existing server's bucket (endpoint and keys from the AWS variables) "
                                     "instead of starting weed mini on 127.0.0.1")
    a = ap.parse_args(argv)
    a.out = a.out or str(result_path("remote", variant="upload-only" if a.upload_only else
                                                 "attribution" if a.attribution else ""))
    if a.upload_only:
        return _main_upload_only(a, argv)
    import logging

    logging.getLogger("pccheck").setLevel(logging.WARNING)
    runs = []
    with tempfile.TemporaryDirectory(prefix="pccheck-bench-remote-", dir=os.environ.get("TMPDIR", "/tmp")) as d:
        srv = _server(a, Path(d) / "s3")
        server = _where(srv)
        try:
            _env(srv)
            for i in range(a.repeat):
                work = Path(d) / f"run{i}"
                work.mkdir()
                runs.append(run_once(a, srv, work))
                print(json.dumps({"run": i, **{k: {kk: vv for kk, vv in v.items() if not isinstance(vv, list)}
                                                 for k, v in runs[-1].items()}}, default=str), flush=True)
        finally:
            srv.stop()
    summary = summarize(runs, a)
    res = {"command": "python -m bench.remote " + " ".join(argv if argv is not None else os.sys.argv[1:]),
           "gpu": "EMULATED (sleep iter_time, then SGD over the state)", "size": parse_size(a.size),
           "server": server, "iter_time": a.iter_time, "every": a.every, "iters": a.iters, "part_size": PART,
           "concurrency": CONC,
           "runs": runs, "summary": summary, "host": host_info(tempfile.gettempdir())}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    if not a.attribution:
        plot(summary, Path(a.out).with_suffix(".png"), a)
    print(json.dumps(summary, indent=1, default=str))
    return 0


def _main_upload_only(a: argparse.Namespace, argv: list[str] | None) -> int:
    with tempfile.TemporaryDirectory(prefix="pccheck-bench-remote-", dir=os.environ.get("TMPDIR", "/tmp")) as d:
        srv = _server(a, Path(d) / "s3")
        try:
            _env(srv)
            work = Path(d) / "run"
            work.mkdir()
            res = upload_path_only(a, work, f"s3://{srv.bucket}/bench-{uuid.uuid4().hex[:6]}")
            server = _where(srv)
        finally:
            srv.stop()
    res = {"command": "python -m bench.remote " + " ".join(argv if argv is not None else os.sys.argv[1:]),
           "server": server, "size": parse_size(a.size), "part_size": PART, "concurrency": CONC, **res,
           "host": host_info(tempfile.gettempdir())}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res["summary"], indent=1), flush=True)
    return 0


def plot(summary: dict[str, Any], path: Path, a: argparse.Namespace) -> None:
    """Blocked per save and time until committed remotely, per row (medians)."""
    rows = [r for r in ("pccheck-remote", "torch.save+upload", "dcp.async_save+FsspecWriter") if r in summary]
    bar_chart(path, ["blocked per save (s)", "save call -> remote commit (s)"],
              {r: [summary[r]["blocked_per_save_s"] or 0.0, summary[r]["to_remote_s"] or 0.0] for r in rows},
              title=f"remote tier, {a.size} state, GPU emulated (t = {a.iter_time} s), every {a.every}; "
                    "SeaweedFS on loopback, 2 vCPUs", ylabel="seconds (median of runs)")


if __name__ == "__main__":
    raise SystemExit(main())
