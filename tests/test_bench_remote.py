"""bench.remote against a server it did not start (``--bucket``): how the remote tier's loop
targets get measured where the S3 server runs on another host."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.resilience import remote  # noqa: E402


def test_the_upload_bench_runs_against_an_existing_bucket(s3_server, s3_url, tmp_path):
    bucket = s3_url[len("s3://"):].split("/", 1)[0]
    out = tmp_path / "remote.json"
    assert remote.main(["--bucket", bucket, "--upload-only", "--size", "8MiB", "--repeat", "1",
                        "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["summary"]["pccheck_median_gbps"] > 0 and res["summary"]["raw_best_median_gbps"] > 0
    assert res["server"] == {"endpoint": s3_server.env()["AWS_ENDPOINT_URL"], "bucket": bucket}


def test_an_existing_bucket_needs_the_endpoint_variable(monkeypatch, tmp_path):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with pytest.raises(SystemExit, match="AWS_ENDPOINT_URL"):
        remote.main(["--bucket", "b", "--upload-only", "--out", str(tmp_path / "r.json")])
