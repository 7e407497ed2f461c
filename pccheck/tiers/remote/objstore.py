"""The object-store client of the remote tier: boto3 under one small face, and its errors mapped.

Every request the tier makes goes through :class:`ObjectStore`: create-only and compare-and-swap
PUTs (the commit, FORMAT.md §12), multipart uploads of data objects, ranged GETs straight into a
caller's buffer, listing and deleting. Endpoint, region and credentials come only from boto3's own
resolution (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``, ``AWS_PROFILE``, ``~/.aws/config`` and ``~/.aws/credentials``): nothing
pccheck-specific. Why boto3 and not obstore: docs/ARCHITECTURE.md, "Remote tier".

Invariant: a conditional write that answers 404, 409 or 412 means "lost the race" and raises
:class:`LostRace`, never a generic error; the caller decides what losing means (§12.3).
"""

from __future__ import annotations

import base64
import contextlib
import io
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from urllib.parse import urlparse

from ...errors import ConfigError, RemoteConfigError, RemoteError

__all__ = ["ObjectStore", "LostRace", "NotFound", "parse_url", "is_remote"]

log = logging.getLogger("pccheck")

_RACE_STATUS = (404, 409, 412)


class LostRace(Exception):
    """A conditional write failed (404, 409 or 412): another writer got there first."""


class NotFound(Exception):
    """The key does not exist (404 on a GET or HEAD)."""


def is_remote(location: Any) -> bool:
    """Whether ``location`` names the remote tier (an ``s3://`` URL)."""
    return isinstance(location, str) and location.startswith("s3://")


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without slashes at either end)."""
    u = urlparse(url)
    if u.scheme != "s3" or not u.netloc or u.query or u.fragment:
        raise ConfigError(f"remote must be an s3://bucket/prefix URL, got {url!r}")
    bucket, prefix = u.netloc, u.path.strip("/")
    if len(bucket) < 3:
        raise ConfigError(f"bucket names have at least 3 characters, got {bucket!r}")
    return bucket, prefix


def _status(exc: Exception) -> int | None:
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        return resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


def _code(exc: Exception) -> str:
    resp = getattr(exc, "response", None)
    return str(resp.get("Error", {}).get("Code", "")) if isinstance(resp, dict) else ""


class BodyCancelled(Exception):
    """A part's body stopped being sent: its upload was given up (:meth:`ObjectStore.upload_part`'s ``stop``)."""


class _View(io.RawIOBase):
    """A read-only file over a memoryview, so a part is sent without a copy. ``stop``: asked
    before each block the HTTP client reads; True ends the request (BodyCancelled), so a part
    of a given-up upload stops taking bandwidth at once instead of at its end."""

    def __init__(self, view: memoryview, stop: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self._v, self._pos, self._stop = view, 0, stop

    def stopped(self) -> bool:
        return self._stop is not None and self._stop()

    def _check(self) -> None:
        if self._pos < len(self._v) and self.stopped():
            raise BodyCancelled("the upload was given up")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        self._pos = off if whence == 0 else (self._pos + off if whence == 1 else len(self._v) + off)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        self._check()
        n = max(0, min(len(b), len(self._v) - self._pos))
        b[:n] = self._v[self._pos:self._pos + n]
        self._pos += n
        return n

    def read(self, n: int = -1) -> bytes:
        self._check()
        end = len(self._v) if n is None or n < 0 else min(len(self._v), self._pos + n)
        out = bytes(self._v[self._pos:end])
        self._pos = end
        return out


def _no_retry_when_given_up(request_dict: Any = None, **_: Any) -> None:
    """botocore's ``needs-retry`` event of UploadPart: a part whose body was cut short because
    its upload was given up ends now (BodyCancelled) instead of being retried after a backoff
    (which would hold its sender thread and its part buffer for up to seconds)."""
    body = request_dict.get("body") if isinstance(request_dict, dict) else None
    if isinstance(body, _View) and body.stopped():
        raise BodyCancelled("the upload was given up")


@dataclass(frozen=True)
class Listed:
    key: str   # relative to the prefix
    size: int


def _parts_s3_config(session: Any) -> dict[str, Any]:
    """The parts client's s3 settings: SigV4 without the body's SHA-256 (``UNSIGNED-PAYLOAD``),
    unless the profile sets ``payload_signing_enabled`` itself (then it decides).

    Every part carries its crc32c in the signed ``x-amz-checksum-crc32c`` header, which the server
    checks against the body; botocore itself sends parts so over https whenever a checksum
    header is present. Over plain http it would hash every byte once more (about 0.8 CPU-seconds
    per GiB on these machines, a sixth of the upload's own CPU on the client:
    bench/README.md, "Remote tier"); an integrity check against transmission errors needs only the crc."""
    try:
        profile_s3 = session._session.get_scoped_config().get("s3") or {}
    except Exception:  # a broken or missing profile: boto3 reports it on the first request
        profile_s3 = {}
    if isinstance(profile_s3, dict) and profile_s3.get("payload_signing_enabled") is not None:
        return {}
    return {"payload_signing_enabled": False}


def _crc_header(crc: int) -> str:
    """A crc32c as S3's ``x-amz-checksum-crc32c`` value: base64 of its 4 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


class ObjectStore:
    """One bucket and prefix. Thread-safe (boto3 clients are); keys are relative to the prefix.

    Args:
        url: ``s3://bucket/prefix``.
        connections: the HTTP connection pool (at least the upload and download concurrency).
        timeout: seconds for connect and for each read; a stopped server fails a request after it
            (and the retries boto3 makes) instead of hanging.
    """

    def __init__(self, url: str, *, connections: int = 16, timeout: float = 10.0, retries: int = 2) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ConfigError("the remote tier needs boto3: pip install 'pccheck[remote]' (boto3)") from None
        self.url = url
        self.bucket, self.prefix = parse_url(url)
        cfg = Config(max_pool_connections=connections, connect_timeout=timeout, read_timeout=timeout,
                     retries={"max_attempts": retries + 1, "mode": "standard"},
                     # our own crc32c per part and per array (FORMAT.md §12); boto3's would cost a
                     # second pass over every byte on 2 vCPUs
                     request_checksum_calculation="when_required", response_checksum_validation="when_required")
        session = boto3.session.Session()
        self.client = session.client("s3", config=cfg)
        self._parts = session.client("s3", config=cfg.merge(Config(s3=_parts_s3_config(session))))
        for c in (self.client, self._parts):  # a part cut short is not retried (botocore's retry event)
            c.meta.events.register_first("needs-retry.s3.UploadPart", _no_retry_when_given_up)
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _fail(self, exc: Exception, doing: str) -> RemoteError:
        return RemoteError(f"{doing} at {self.endpoint} (s3://{self.bucket}/{self.prefix}) failed: {exc}")

    # -- conditional writes: the commit (FORMAT.md §12) ---------------------------------------------

    def put_new(self, rel: str, body: bytes) -> str:
        """PUT with ``If-None-Match: *``; returns the ETag. LostRace if the key exists."""
        return self._put(rel, body, IfNoneMatch="*")

    def put_swap(self, rel: str, body: bytes, etag: str | None) -> str:
        """PUT with ``If-Match: etag`` (``If-None-Match: *`` when ``etag`` is None: the key must
        not exist yet); returns the new ETag. LostRace if the key changed since ``etag``."""
        return self._put(rel, body, IfMatch=etag) if etag is not None else self._put(rel, body, IfNoneMatch="*")

    @contextlib.contextmanager
    def _conditional(self, rel: str, what: str) -> Iterator[None]:
        """A conditional write's errors: 404, 409 or 412 is LostRace (FORMAT.md §12), any other
        failure the store's error naming ``what``."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as exc:
            if _status(exc) in _RACE_STATUS:
                raise LostRace(f"{rel}: {_code(exc) or _status(exc)}") from None
            raise self._fail(exc, what) from None
        except BotoCoreError as exc:
            raise self._fail(exc, what) from None

    def _put(self, rel: str, body: bytes, **cond: str) -> str:
        with self._conditional(rel, f"PUT {rel}"):
            return str(self.client.put_object(Bucket=self.bucket, Key=self.key(rel), Body=body, **cond)["ETag"])

    def put(self, rel: str, body: bytes) -> str:
        """An unconditional PUT (only for keys no other writer uses: unique data keys, probes)."""
        return self._put(rel, body)

    # -- reads ---------------------------------------------------------------------------------------

    def get(self, rel: str, max_bytes: int) -> tuple[bytes, str]:
        """The whole object and its ETag. NotFound if absent; RemoteError if over ``max_bytes``."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key(rel))
            if int(r.get("ContentLength", 0)) > max_bytes:
                r["Body"].close()
                raise RemoteError(f"{rel} holds {r['ContentLength']} bytes, more than the {max_bytes} allowed")
            return r["Body"].read(), str(r["ETag"])
        except ClientError as exc:
            if _status(exc) == 404:
                raise NotFound(rel) from None
            raise self._fail(exc, f"GET {rel}") from None
        except BotoCoreError as exc:
            raise self._fail(exc, f"GET {rel}") from None

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        """A ranged GET of ``len(out)`` bytes at ``offset``, read straight into ``out``.
        NotFound if absent; RemoteError on a short object."""
        from botocore.exceptions import BotoCoreError, ClientError

        n = len(out)
        if n == 0:
            return
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(rel),
                                          Range=f"bytes={offset}-{offset + n - 1}")["Body"]
            got = 0
            # urllib3's response reads straight into our buffer; else chunks are copied in
            raw = getattr(body, "_raw_stream", None)
            while got < n:
                if raw is not None and hasattr(raw, "readinto"):
                    k = raw.readinto(out[got:])
                else:
                    chunk = body.read(min(n - got, 8 << 20))
                    k = len(chunk)
                    out[got:got + k] = chunk
                if not k:
                    break
                got += k
            body.close()
        except ClientError as exc:
            if _status(exc) in (404, 416):
                raise NotFound(f"{rel} [{offset}, {offset + n})") from None
            raise self._fail(exc, f"GET {rel}") from None
        except BotoCoreError as exc:
            raise self._fail(exc, f"GET {rel}") from None
        if got != n:
            raise NotFound(f"{rel}: {got} of {n} bytes at offset {offset} (the object is short)")

    def list(self, rel_prefix: str) -> Iterator[Listed]:
        """Every key under ``rel_prefix`` (relative keys), in the store's order."""
        from botocore.exceptions import BotoCoreError, ClientError

        full = self.key(rel_prefix)
        cut = len(self.key(""))
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                for o in page.get("Contents", ()):
                    yield Listed(o["Key"][cut:], int(o["Size"]))
        except (ClientError, BotoCoreError) as exc:
            raise self._fail(exc, f"LIST {rel_prefix}") from None

    def delete(self, rel: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key(rel))
        except (ClientError, BotoCoreError) as exc:
            raise self._fail(exc, f"DELETE {rel}") from None

    # -- multipart -------------------------------------------------------------------------------

    def start_multipart(self, rel: str, crc32c: bool = False) -> str:
        """Starts a multipart upload; with ``crc32c`` every part must carry its crc32c
        (:meth:`upload_part`, :meth:`complete_multipart`)."""
        from botocore.exceptions import BotoCoreError, ClientError

        kw = {"ChecksumAlgorithm": "CRC32C"} if crc32c else {}
        try:
            return str(self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key(rel), **kw)["UploadId"])
        except (ClientError, BotoCoreError) as exc:
            raise self._fail(exc, f"starting the upload of {rel}") from None

    def upload_part(self, rel: str, upload_id: str, number: int, data: memoryview, crc32c: int | None = None,
                    stop: Callable[[], bool] | None = None) -> str:
        """Sends one part; with ``crc32c`` (the crc32c of ``data``) the server checks the body
        against it, and the body is sent without SHA-256 signing (:func:`_parts_s3_config`).
        ``stop``: asked as the body is sent; True cuts the request short (BodyCancelled; the
        caller then aborts the upload)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            if crc32c is None:
                return str(self.client.upload_part(Bucket=self.bucket, Key=self.key(rel), UploadId=upload_id,
                                                   PartNumber=number, Body=_View(data, stop))["ETag"])
            return str(self._parts.upload_part(Bucket=self.bucket, Key=self.key(rel), UploadId=upload_id,
                                               PartNumber=number, Body=_View(data, stop),
                                               ChecksumCRC32C=_crc_header(crc32c))["ETag"])
        except (ClientError, BotoCoreError) as exc:
            if stop is not None and stop():  # the HTTP client wraps the cut body in its own error
                raise BodyCancelled(f"part {number} of {rel}: the upload was given up") from None
            raise self._fail(exc, f"uploading part {number} of {rel}") from None

    def complete_multipart(self, rel: str, upload_id: str, etags: list[str], crcs: list[int] | None = None) -> None:
        """Completes with ``If-None-Match: *``: a data key is written once (§12.1). ``crcs``: the
        parts' crc32c, for an upload started with ``crc32c=True``."""
        parts: list[dict[str, Any]] = [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]
        for p, c in zip(parts, crcs or ()):
            p["ChecksumCRC32C"] = _crc_header(c)
        with self._conditional(rel, f"completing the upload of {rel}"):
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=self.key(rel), UploadId=upload_id,
                                                  MultipartUpload={"Parts": parts}, IfNoneMatch="*")

    def abort_multipart(self, rel: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key(rel), UploadId=upload_id)
        except Exception as exc:  # best effort: a stale upload is aborted later by retention
            log.info("pccheck: aborting the upload of %s failed (%s); retention aborts it later", rel, exc)

    def stale_uploads(self, rel_prefix: str) -> list[tuple[str, str, float]]:
        """Multipart uploads in progress under ``rel_prefix``: (relative key, upload id, start time)."""
        from botocore.exceptions import BotoCoreError, ClientError

        cut = len(self.key(""))
        out = []
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket,
                                                                                Prefix=self.key(rel_prefix))
            for page in pages:
                for u in page.get("Uploads", ()) or ():
                    out.append((u["Key"][cut:], u["UploadId"], u["Initiated"].timestamp()))
        except (ClientError, BotoCoreError) as exc:
            raise self._fail(exc, "listing multipart uploads") from None
        return out

    # -- the probe at construction ---------------------------------------------------------------------

    def probe(self) -> None:
        """Checks, once, that this store can hold the remote tier: the bucket exists, the
        credentials may write, and conditional writes hold (a second create-only PUT of one key
        must lose). Raises RemoteConfigError saying what to do."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        where = f"s3://{self.bucket}/{self.prefix} at {self.endpoint}"
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except NoCredentialsError:
            raise RemoteConfigError(f"no AWS credentials for {where}: set AWS_ACCESS_KEY_ID and "
                                    "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)") from None
        except ClientError as exc:
            st = _status(exc)
            if st == 404:
                raise RemoteConfigError(f"the bucket {self.bucket!r} does not exist at {self.endpoint}: create it "
                                        "first (pccheck never creates buckets)") from None
            if st in (401, 403):
                raise RemoteConfigError(f"access denied to {where} ({_code(exc) or st}): check AWS_ACCESS_KEY_ID, "
                                        "AWS_SECRET_ACCESS_KEY / AWS_PROFILE and the bucket's policy") from None
            raise RemoteConfigError(f"{where} answered {st} ({exc}): check AWS_ENDPOINT_URL") from None
        except BotoCoreError as exc:
            raise RemoteConfigError(f"cannot reach {where}: {exc}; check AWS_ENDPOINT_URL") from None
        probe = f"probe/{uuid.uuid4().hex}"
        try:
            self.put_new(probe, b"pccheck conditional-write probe\n")
            try:
                self.put_new(probe, b"second\n")
                won_twice = True
            except LostRace:
                won_twice = False
        except RemoteError as exc:
            if any(s in str(exc) for s in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch")):
                raise RemoteConfigError(f"{where} refuses writes with these credentials ({exc}): check "
                                        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY") from None
            if any(s in str(exc) for s in ("NotImplemented", "501")):
                won_twice = True
            else:
                raise
        finally:
            try:
                self.delete(probe)
            except RemoteError:
                pass
        if won_twice:
            raise RemoteConfigError(
                f"{where} does not honour conditional writes (If-None-Match: *): two create-only PUTs of one key "
                "both succeeded. pccheck's remote commit needs them (FORMAT.md §12): use AWS S3, SeaweedFS >= 4.18, "
                "MinIO, or another store that supports S3 conditional writes")
