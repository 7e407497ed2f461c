"""Which S3 client the remote tier uses: obstore vs boto3 on the same SeaweedFS server.

    python -m bench.remote_clients --size 1GiB --parts 8MiB,32MiB --repeat 2 [--out bench/results/remote_clients/latest.json]

For each client and part size: a multipart upload of ``--size`` bytes from memory (parts in
parallel, ``--concurrency`` at a time) and a download of the same object by parallel ranged GETs
into one preallocated buffer. A fresh ``weed mini`` (pccheck.tiers.remote.devserver) on 127.0.0.1
serves it. The speeds on a 2-vCPU machine are the server's more than the client's: compare the
ratios between rows of one run, never the absolute figures.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.harness.common import result_path, host_info, parse_size, parse_size_list
from pccheck.tiers.remote.devserver import DevServer


def _boto(srv: DevServer):
    import boto3
    from botocore.config import Config

    env = srv.env()
    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"],
                        config=Config(max_pool_connections=32, request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))


class _View(io.RawIOBase):
    """A read-only file over a memoryview: botocore reads a part from it without a copy."""

    def __init__(self, view: memoryview) -> None:
        self._v, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        self._pos = off if whence == 0 else (self._pos + off if whence == 1 else len(self._v) + off)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._v) - self._pos))
        b[:n] = self._v[self._pos:self._pos + n]
        self._pos += n
        return n

    def read(self, n: int = -1) -> bytes:
        end = len(self._v) if n is None or n < 0 else min(len(self._v), self._pos + n)
        out = bytes(self._v[self._pos:end])
        self._pos = end
        return out


def boto3_upload(srv: DevServer, data: memoryview, key: str, part: int, conc: int) -> None:
    c = _boto(srv)
    up = c.create_multipart_upload(Bucket=srv.bucket, Key=key)["UploadId"]
    offs = range(0, len(data), part)

    def one(i_off):
        i, off = i_off
        r = c.upload_part(Bucket=srv.bucket, Key=key, UploadId=up, PartNumber=i + 1, Body=_View(data[off:off + part]))
        return {"PartNumber": i + 1, "ETag": r["ETag"]}

    with ThreadPoolExecutor(conc) as ex:
        parts = list(ex.map(one, enumerate(offs)))
    c.complete_multipart_upload(Bucket=srv.bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts})


def boto3_download(srv: DevServer, out: memoryview, key: str, part: int, conc: int) -> None:
    c = _boto(srv)

    def one(off):
        end = min(off + part, len(out))
        body = c.get_object(Bucket=srv.bucket, Key=key, Range=f"bytes={off}-{end - 1}")["Body"]
        view, got = out[off:end], 0
        while got < end - off:
            n = body.readinto(view[got:]) if hasattr(body, "readinto") else 0
            if not n:
                chunk = body.read(end - off - got)
                if not chunk:
                    break
                view[got:got + len(chunk)] = chunk
                n = len(chunk)
            got += n

    with ThreadPoolExecutor(conc) as ex:
        list(ex.map(one, range(0, len(out), part)))


def _obs(srv: DevServer):
    from obstore.store import S3Store

    env = srv.env()
    return S3Store(srv.bucket, endpoint=env["AWS_ENDPOINT_URL"], access_key_id=env["AWS_ACCESS_KEY_ID"],
                   secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region=env["AWS_REGION"],
                   client_options={"allow_http": True}, virtual_hosted_style_request=False)


def obstore_upload(srv: DevServer, data: memoryview, key: str, part: int, conc: int) -> None:
    import obstore

    obstore.put(_obs(srv), key, data, chunk_size=part, max_concurrency=conc, use_multipart=True)


def obstore_download(srv: DevServer, out: memoryview, key: str, part: int, conc: int) -> None:
    import obstore

    store = _obs(srv)
    starts = list(range(0, len(out), part))
    ends = [min(s + part, len(out)) for s in starts]

    def one(i):
        b = obstore.get_range(store, key, start=starts[i], end=ends[i])
        out[starts[i]:ends[i]] = memoryview(b)

    with ThreadPoolExecutor(conc) as ex:
        list(ex.map(one, range(len(starts))))


CLIENTS = {"boto3": (boto3_upload, boto3_download), "obstore": (obstore_upload, obstore_download)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--parts", default="8MiB,32MiB")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--clients", default="boto3,obstore")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=str(result_path("remote_clients")))
    a = ap.parse_args(argv)
    size = parse_size(a.size)
    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    out = np.empty_like(data)
    out[:] = 1  # touched once: first touch is slow here (GUIDE §4)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pccheck-bench-s3-") as d:
        srv = DevServer(Path(d)).start()
        try:
            for rep in range(a.repeat):
                for part in parse_size_list(a.parts):
                    for name in a.clients.split(","):
                        up, down = CLIENTS[name]
                        key = f"bench/{uuid.uuid4().hex}"
                        t0 = time.perf_counter()
                        up(srv, memoryview(data), key, part, a.concurrency)
                        t1 = time.perf_counter()
                        down(srv, memoryview(out), key, part, a.concurrency)
                        t2 = time.perf_counter()
                        ok = bool(np.array_equal(out, data))
                        rows.append({"client": name, "part": part, "repeat": rep, "upload_s": t1 - t0,
                                     "download_s": t2 - t1, "upload_gbps": size / (t1 - t0) / 1e9,
                                     "download_gbps": size / (t2 - t1) / 1e9, "bytes_match": ok})
                        print(json.dumps(rows[-1]), flush=True)
                        _boto(srv).delete_object(Bucket=srv.bucket, Key=key)
        finally:
            srv.stop()
    summary = {}
    for name in a.clients.split(","):
        for part in parse_size_list(a.parts):
            rs = [r for r in rows if r["client"] == name and r["part"] == part]
            summary[f"{name}@{part >> 20}MiB"] = {
                k: {"median": statistics.median(r[k] for r in rs), "min": min(r[k] for r in rs),
                    "max": max(r[k] for r in rs)} for k in ("upload_gbps", "download_gbps")}
    res = {"command": "python -m bench.remote_clients " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
           "size": size, "concurrency": a.concurrency, "rows": rows, "summary": summary, "host": host_info(tempfile.gettempdir())}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    for k, v in summary.items():
        print(f"{k:18s} upload {v['upload_gbps']['median']:.3f} GB/s  download {v['download_gbps']['median']:.3f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
