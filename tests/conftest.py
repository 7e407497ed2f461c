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
