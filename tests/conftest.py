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
