"""Client and server CPU per GiB uploaded to a local S3 server: pccheck's upload_slot (TREE's pccheck)
against boto3 from memory (signed body: boto3's default over http; unsigned body).

    TREE=/path/to/old/checkout TAG=-old REP=3 python bench/analysis/s3_upload_client_cpu.py
    TREE=. TAG=-new REP=3 python bench/analysis/s3_upload_client_cpu.py

One JSON line per upload on stdout. The store file's pages are dropped before each pccheck upload,
as after an O_DIRECT commit.
"""
import os, sys, time, uuid, json, resource, tempfile
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
import numpy as np
sys.path.insert(0, os.environ.get("TREE", "."))
PART, CONC = 32 << 20, 4
SIZE = 1 << 30


def proc_cpu(pid):
    """utime + stime of process ``pid`` (the weed server), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        p = f.read().rsplit(")", 1)[1].split()
    return (int(p[11]) + int(p[12])) / os.sysconf("SC_CLK_TCK")
from pccheck.tiers.remote.devserver import DevServer
from pccheck.tiers.remote.objstore import ObjectStore
import pccheck
from pccheck.persist.recovery import read_store
from pccheck.tiers.remote.upload import BufferPool, SlotRef, upload_slot
print(pccheck.__file__)

def run(name, fn, srv):
    c0 = resource.getrusage(resource.RUSAGE_SELF); s0 = proc_cpu(srv.proc.pid); t = time.perf_counter()
    fn()
    w = time.perf_counter() - t
    c1 = resource.getrusage(resource.RUSAGE_SELF); s1 = proc_cpu(srv.proc.pid)
    r = {"name": name, "gbps": SIZE / w / 1e9, "wall": w, "client_cpu": round((c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime), 2), "server_cpu": round(s1 - s0, 2)}
    print(json.dumps(r), flush=True)

d = tempfile.mkdtemp(prefix="pccheck-upload-cpu-", dir="/tmp")
srv = DevServer(Path(d) / "s3").start()
os.environ.update(srv.env())
try:
    with pccheck.Checkpointer({"w": np.ones(SIZE, dtype=np.uint8)}, Path(d) / "ck") as ck:
        ck.checkpoint(1); ck.wait(); file = ck._orch.store.file
    img = read_store(file)
    st = next(s for s in img.slots if s.meta and s.meta["step"] == 1)
    ref = SlotRef(file, st.slot, st.meta["counter"], 1)
    store = ObjectStore(f"s3://{srv.bucket}/m", connections=CONC + 4)
    data = np.ones(SIZE, dtype=np.uint8); data[::4096] = 1; view = memoryview(data)
    pool = BufferPool(CONC + 1, PART)
    def pcc():
        with ThreadPoolExecutor(CONC) as s:
            part = upload_slot(store, ref, 1, 0, PART, pool, s, lambda: False)
        store.delete(part.data)
    def raw():
        key = f"raw/{uuid.uuid4().hex}"
        up = store.start_multipart(key)
        with ThreadPoolExecutor(CONC) as ex:
            et = list(ex.map(lambda io: store.upload_part(key, up, io[0] + 1, view[io[1]:io[1] + PART]), enumerate(range(0, SIZE, PART))))
        store.complete_multipart(key, up, et); store.delete(key)
    def drop():  # the page cache as after an O_DIRECT commit: the store's pages not cached
        fd = os.open(file, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
    import boto3
    from botocore.config import Config
    from pccheck.tiers.remote.objstore import _View
    ucl = boto3.session.Session().client("s3", config=store.client.meta.config.merge(Config(s3={"payload_signing_enabled": False})))
    def raw_unsigned():
        key = store.key(f"raw/{uuid.uuid4().hex}")
        up = ucl.create_multipart_upload(Bucket=store.bucket, Key=key)["UploadId"]
        with ThreadPoolExecutor(CONC) as ex:
            et = list(ex.map(lambda io: ucl.upload_part(Bucket=store.bucket, Key=key, UploadId=up, PartNumber=io[0] + 1, Body=_View(view[io[1]:io[1] + PART]))["ETag"], enumerate(range(0, SIZE, PART))))
        ucl.complete_multipart_upload(Bucket=store.bucket, Key=key, UploadId=up, MultipartUpload={"Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(et)]})
        ucl.delete_object(Bucket=store.bucket, Key=key)
    tag = os.environ.get("TAG", "")
    for rep in range(int(os.environ.get("REP", "3"))):
        drop(); run("pcc" + tag, pcc, srv)
        run("raw", raw, srv)
        run("raw_unsigned", raw_unsigned, srv)
finally:
    srv.stop()
