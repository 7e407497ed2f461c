"""Bad input gets a specific PCCheckError subclass with a helpful message, and never loses data.

Every error derives from ``pccheck.PCCheckError`` and also from the matching built-in, so each
test checks both, checks that the message names what is wrong, and, where a checkpoint already
exists, that it is still loadable with exactly its bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import pccheck

# -- helpers (kept in this file on purpose: conftest.py is shared with other test files) -------------

KW = dict(interval=1, max_concurrent=2, writer_threads=2, chunk_size=64 << 10)
CALL_TIMEOUT_S = 30.0


def make_state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 100)).astype(np.float32),
            "i": rng.integers(0, 1 << 40, 1000),
            "s": np.array([b"abc", b"de"], dtype="S4")}


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert np.ascontiguousarray(g).tobytes() == np.ascontiguousarray(w).tobytes(), f"wrong bytes in {k!r}"


def assert_loads(path: Path, step: int, want: dict[str, np.ndarray]) -> None:
    r = pccheck.load_latest(path)
    assert r.step == step
    assert_same(r.state, want)


def guarded(fn: Callable[[], Any], timeout: float = CALL_TIMEOUT_S) -> Any:
    """Runs fn on a helper thread and returns its result; fails instead of hanging the suite."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["ret"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["exc"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"hung for {timeout} s")
    if "exc" in box:
        raise box["exc"]
    return box.get("ret")


def committed(ck: pccheck.Checkpointer, step: int) -> None:
    guarded(lambda: (ck.checkpoint(step), ck.wait()))


def no_store_files(d: Path) -> bool:
    return not d.exists() or not (list(d.glob("store-*")) or list(d.glob("*.tmp")))


def run_py(code: str, cwd: Path, *args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter (the venv's), from cwd so the installed package is imported."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


# -- the hierarchy --------------------------------------------------------------------------------


@pytest.mark.parametrize("cls, builtin", [
    (pccheck.NativeExtensionError, ImportError),
    (pccheck.ConfigError, ValueError),
    (pccheck.UnsupportedDtypeError, TypeError),
    (pccheck.PathNotWritableError, PermissionError),
    (pccheck.StoreLockedError, BlockingIOError),
    (pccheck.NoCheckpointError, FileNotFoundError),
    (pccheck.CorruptCheckpointError, ValueError),
    (pccheck.StorageError, OSError),
    (pccheck.NoSpaceError, OSError),
    (pccheck.DeviceIOError, OSError),
])
def test_one_root_and_the_matching_builtin(cls, builtin):
    assert issubclass(cls, pccheck.PCCheckError) and issubclass(cls, builtin)
    assert issubclass(pccheck.PCCheckError, Exception) and not issubclass(pccheck.PCCheckError, OSError)
    assert cls.__name__ in pccheck.__all__


def test_storage_errors_are_storage_errors():
    assert issubclass(pccheck.NoSpaceError, pccheck.StorageError)
    assert issubclass(pccheck.DeviceIOError, pccheck.StorageError)


# -- dtypes ----------------------------------------------------------------------------------------

OBJECT_ARRAYS = {
    "object": lambda: np.array([1, "two", None], dtype=object),
    "struct-with-object": lambda: np.zeros(3, dtype=[("x", "<f4"), ("o", "O")]),
    "nested-struct-with-object": lambda: np.zeros(2, dtype=[("p", [("q", "<i8"), ("r", "O")])]),
}


@pytest.mark.parametrize("kind", list(OBJECT_ARRAYS))
def test_object_dtype_rejected_at_construction(tmp_path, kind):
    d = tmp_path / "c"
    state = {**make_state(), "my_objects": OBJECT_ARRAYS[kind]()}
    with pytest.raises(pccheck.UnsupportedDtypeError) as ei:
        pccheck.Checkpointer(state, d, **KW)
    assert isinstance(ei.value, TypeError)
    assert "my_objects" in str(ei.value) and "object" in str(ei.value).lower()
    assert not d.exists(), "the dtype must be rejected before anything touches the disk"


@pytest.mark.parametrize("kind", list(OBJECT_ARRAYS))
def test_object_dtype_added_later_keeps_last_checkpoint(tmp_path, kind):
    d = tmp_path / "c"
    state = make_state()
    with pccheck.Checkpointer(state, d, **KW) as ck:
        committed(ck, 1)
        want = {k: v.copy() for k, v in state.items()}
        state["w"] += 1
        state["late"] = OBJECT_ARRAYS[kind]()
        # More attempts than max_concurrent: a leaked in-flight permit would hang the third one.
        for step in (2, 3, 4):
            with pytest.raises(pccheck.UnsupportedDtypeError) as ei:
                guarded(lambda: ck.maybe_checkpoint(step))
            assert isinstance(ei.value, TypeError) and "late" in str(ei.value)
        guarded(ck.wait)  # nothing pending
        assert_loads(d, 1, want)
        # Replacing the array by a plain one: training goes on.
        state["late"] = np.arange(5, dtype=np.int16)
        committed(ck, 5)
        assert_loads(d, 5, state)


def test_array_replaced_by_object_array_of_same_name(tmp_path):
    d = tmp_path / "c"
    state = make_state()
    with pccheck.Checkpointer(state, d, **KW) as ck:
        committed(ck, 1)
        want = {k: v.copy() for k, v in state.items()}
        state["i"] = state["i"].astype(object)
        with pytest.raises(pccheck.UnsupportedDtypeError, match="'i'"):
            guarded(lambda: ck.checkpoint(2))
        assert_loads(d, 1, want)


# -- paths -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["under-a-file", "is-a-file"])
def test_path_not_writable(tmp_path, where):
    afile = tmp_path / "afile"
    afile.write_bytes(b"precious")
    d = afile / "sub" if where == "under-a-file" else afile
    with pytest.raises(pccheck.PathNotWritableError) as ei:
        pccheck.Checkpointer(make_state(), d, **KW)
    assert isinstance(ei.value, PermissionError)
    assert str(d) in str(ei.value) and "writable" in str(ei.value)
    assert afile.read_bytes() == b"precious"


def test_path_not_writable_under_proc(tmp_path):
    d = Path("/proc/self/pccheck-test")  # root cannot create anything here either
    with pytest.raises(pccheck.PathNotWritableError):
        pccheck.Checkpointer(make_state(), d, **KW)


def test_load_latest_nonexistent_path(tmp_path):
    d = tmp_path / "nope"
    with pytest.raises(pccheck.NoCheckpointError) as ei:
        pccheck.load_latest(d)
    assert isinstance(ei.value, FileNotFoundError)
    assert str(d) in str(ei.value)
    assert not d.exists(), "load_latest must not create the directory"


def test_load_latest_empty_directory(tmp_path):
    with pytest.raises(pccheck.NoCheckpointError) as ei:
        pccheck.load_latest(tmp_path)
    assert isinstance(ei.value, FileNotFoundError) and "store" in str(ei.value)


def test_load_latest_on_a_regular_file(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x")
    with pytest.raises(pccheck.NoCheckpointError):
        pccheck.load_latest(f)


def test_load_latest_store_without_a_commit(tmp_path):
    d = tmp_path / "c"
    pccheck.Checkpointer(make_state(), d, **KW).close()  # a store file, but no checkpoint yet
    assert list(d.glob("store-*.pcc"))
    with pytest.raises(pccheck.NoCheckpointError, match="no valid checkpoint"):
        pccheck.load_latest(d)


def test_load_latest_default_path_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PCCHECK_DIR", str(tmp_path / "env-dir"))
    with pytest.raises(pccheck.NoCheckpointError, match="PCCHECK_DIR"):
        pccheck.load_latest()


# -- the store lock --------------------------------------------------------------------------------


def test_two_checkpointers_same_process(tmp_path):
    d = tmp_path / "c"
    state = make_state()
    first = pccheck.Checkpointer(state, d, **KW)
    try:
        committed(first, 1)
        with pytest.raises(pccheck.StoreLockedError) as ei:
            pccheck.Checkpointer(make_state(1), d, **KW)
        assert isinstance(ei.value, BlockingIOError)
        assert f"pid {os.getpid()}" in str(ei.value) and "close it first" in str(ei.value)
        assert (d / "LOCK").read_text() == f"{os.getpid()}\n", "the loser must not touch the LOCK file"
        # The failed second attempt did not disturb the first.
        state["w"] += 1
        committed(first, 2)
        assert_loads(d, 2, state)
    finally:
        first.close()
    with pccheck.Checkpointer(state, d, **KW) as again:
        state["w"] += 1
        committed(again, 3)
    assert_loads(d, 3, state)


_SECOND = """
    import json, sys
    import numpy as np, pccheck
    st = {"a": np.arange(10, dtype=np.float64)}
    try:
        ck = pccheck.Checkpointer(st, sys.argv[1], interval=1)
    except pccheck.PCCheckError as e:
        print(json.dumps({"type": type(e).__name__, "blocking": isinstance(e, BlockingIOError), "msg": str(e)}))
    else:
        ck.checkpoint(7); ck.close()
        print(json.dumps({"type": None}))
"""


def test_two_checkpointers_second_process(tmp_path):
    d = tmp_path / "c"
    state = make_state()
    first = pccheck.Checkpointer(state, d, **KW)
    try:
        committed(first, 1)
        p = run_py(_SECOND, tmp_path, str(d))
        assert p.returncode == 0, p.stderr
        got = json.loads(p.stdout.strip().splitlines()[-1])
        assert got["type"] == "StoreLockedError" and got["blocking"], got
        assert f"pid {os.getpid()}" in got["msg"], got
        state["w"] += 1
        committed(first, 2)
        assert_loads(d, 2, state)
    finally:
        first.close()
    p = run_py(_SECOND, tmp_path, str(d))  # the first closed: the other process opens fine
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1])["type"] is None
    assert pccheck.load_latest(d).step == 7


_HOLDER = """
    import sys
    import numpy as np, pccheck
    ck = pccheck.Checkpointer({"a": np.arange(10, dtype=np.float64)}, sys.argv[1], interval=1)
    ck.checkpoint(3); ck.wait()
    print("READY", flush=True)
    sys.stdin.readline()
"""


def test_lock_held_by_another_process_then_released_by_its_death(tmp_path):
    d = tmp_path / "c"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_HOLDER), str(d)], cwd=tmp_path,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = guarded(proc.stdout.readline)  # type: ignore[union-attr]
        assert line.startswith("READY"), proc.stderr.read() if proc.poll() is not None else line  # type: ignore[union-attr]
        with pytest.raises(pccheck.StoreLockedError, match=f"pid {proc.pid}"):
            pccheck.Checkpointer(make_state(), d, **KW)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close(); proc.stderr.close(); proc.stdin.close()  # type: ignore[union-attr]
    assert pccheck.load_latest(d).step == 3
    state = {"a": np.arange(10, dtype=np.float64) * 2}
    with pccheck.Checkpointer(state, d, **KW) as ck:  # the kernel released the dead holder's flock
        committed(ck, 4)
    assert_loads(d, 4, state)


# -- bad arguments ---------------------------------------------------------------------------------

A = np.arange(10, dtype=np.float32)
BAD_CONSTRUCTOR_ARGS = [
    ("interval=0", dict(state={"a": A}, interval=0), "interval"),
    ("interval=1.5", dict(state={"a": A}, interval=1.5), "interval"),
    ("interval=True", dict(state={"a": A}, interval=True), "interval"),
    ("max_concurrent=0", dict(state={"a": A}, max_concurrent=0), "max_concurrent"),
    ("max_concurrent=255", dict(state={"a": A}, max_concurrent=255), "max_concurrent"),
    ("writer_threads=0", dict(state={"a": A}, writer_threads=0), "writer_threads"),
    ("chunk_size=100", dict(state={"a": A}, chunk_size=100), "chunk_size"),
    ("dram_budget=100", dict(state={"a": A}, dram_budget=100), "dram_budget"),
    ("storage=floppy", dict(state={"a": A}, storage="floppy"), "storage"),
    ("on_error=explode", dict(state={"a": A}, on_error="explode"), "on_error"),
    ("state=list", dict(state=[A]), "mapping"),
    ("state=array", dict(state=A), "mapping"),
    ("key=int", dict(state={1: A}), "keys must be str"),
    ("value=list", dict(state={"a": [1, 2, 3]}), "'a'"),
    ("value=torch-like", dict(state={"a": memoryview(b"abcd")}), "numpy"),
    ("metadata=object", dict(state={"a": A}, metadata={"x": object()}), "JSON"),
    ("metadata=nan", dict(state={"a": A}, metadata={"x": float("nan")}), "JSON"),
    ("metadata=bytes", dict(state={"a": A}, metadata={"x": b"raw"}), "JSON"),
]


@pytest.mark.parametrize("kwargs, needle", [c[1:] for c in BAD_CONSTRUCTOR_ARGS],
                         ids=[c[0] for c in BAD_CONSTRUCTOR_ARGS])
def test_bad_constructor_argument(tmp_path, kwargs, needle):
    d = tmp_path / "c"
    kwargs = dict(kwargs)
    state = kwargs.pop("state")
    with pytest.raises(pccheck.ConfigError) as ei:
        pccheck.Checkpointer(state, d, **kwargs)
    assert isinstance(ei.value, ValueError)
    assert needle in str(ei.value), str(ei.value)
    assert no_store_files(d), "a rejected argument must not leave a store file"
    with pccheck.Checkpointer({"a": A}, d, interval=1) as ck:  # and must not leave the lock held
        committed(ck, 1)


@pytest.mark.parametrize("metadata", [["x"], "ab", 5], ids=["list", "str", "int"])
def test_metadata_not_a_mapping(tmp_path, metadata):
    with pytest.raises(pccheck.ConfigError, match="metadata"):
        pccheck.Checkpointer({"a": A}, tmp_path / "c", metadata=metadata)


@pytest.mark.parametrize("step", ["3", None, 2.5, 2.0, True, [4]], ids=repr)
def test_checkpoint_step_not_an_int(tmp_path, step):
    d = tmp_path / "c"
    state = {"a": A.copy()}
    with pccheck.Checkpointer(state, d, interval=1) as ck:
        committed(ck, 1)
        with pytest.raises(pccheck.ConfigError, match="step must be an int"):
            ck.checkpoint(step)
        assert_loads(d, 1, state)
        committed(ck, np.int64(2))  # numpy integers are ints
    assert pccheck.load_latest(d).step == 2


@pytest.mark.parametrize("step", ["3", None, 2.5], ids=repr)
def test_maybe_checkpoint_step_not_an_int(tmp_path, step):
    with pccheck.Checkpointer({"a": A.copy()}, tmp_path / "c", interval=1) as ck:
        with pytest.raises(pccheck.ConfigError, match="step must be an int"):
            ck.maybe_checkpoint(step)


def test_bad_metadata_at_checkpoint_keeps_last_checkpoint(tmp_path):
    d = tmp_path / "c"
    state = make_state()
    with pccheck.Checkpointer(state, d, **KW, metadata={"run": "r1"}) as ck:
        committed(ck, 1)
        want = {k: v.copy() for k, v in state.items()}
        state["w"] += 1
        # More attempts than max_concurrent: a leaked in-flight permit or slot would hang or fail later.
        for step in (2, 3, 4):
            with pytest.raises(pccheck.ConfigError, match="JSON"):
                guarded(lambda: ck.checkpoint(step, metadata={"bad": {1, 2}}))
        assert_loads(d, 1, want)
        committed(ck, 5)
        r = pccheck.load_latest(d)
        assert r.step == 5 and r.metadata == {"run": "r1"}
        assert_same(r.state, state)


def test_checkpoint_after_close(tmp_path):
    ck = pccheck.Checkpointer({"a": A}, tmp_path / "c", interval=1)
    ck.close()
    with pytest.raises(pccheck.ConfigError, match="closed"):
        ck.checkpoint(1)
    ck.close()  # idempotent


# -- storage modes -----------------------------------------------------------------------------------


def test_pmem_on_ext4_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("PMEM_IS_PMEM_FORCE", raising=False)
    d = tmp_path / "c"
    with pytest.raises(pccheck.StorageError) as ei:
        pccheck.Checkpointer(make_state(), d, **KW, storage="pmem")
    assert isinstance(ei.value, OSError) and isinstance(ei.value, pccheck.PCCheckError)
    assert "not on persistent memory" in str(ei.value)
    assert "storage='ssd'" in str(ei.value)
    # The lock is released; the same directory works with an SSD mode.
    state = make_state()
    with pccheck.Checkpointer(state, d, **KW, storage="ssd") as ck:
        assert ck.storage == "odirect"
        committed(ck, 1)
    assert_loads(d, 1, state)


# -- what importing and loading pull in ----------------------------------------------------------------


def test_import_does_not_import_torch_or_cupy(tmp_path):
    p = run_py("""
        import sys
        import pccheck
        assert pccheck.__file__.startswith(sys.prefix), pccheck.__file__  # the installed package
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cupy"))
        assert not bad, bad
        # the profiler and the search load only for pccheck-tune (tuner/__init__.py is lazy)
        loaded = sorted(m for m in ("pccheck.tuner.profile", "pccheck.tuner.search") if m in sys.modules)
        assert not loaded, loaded
        from pccheck.tuner import run_profile, choose  # still importable by name
        assert callable(run_profile) and callable(choose)
        print("OK")
    """, tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == "OK", p.stderr


_NO_PICKLE = """
    import hashlib, json, sys
    import numpy as np
    import pccheck
    import pickle, _pickle, numpy.lib.format

    class Forbidden(AssertionError):
        pass

    def forbid(name):
        def f(*a, **k):
            raise Forbidden(f"{name} was called on the load path")
        return f

    for mod in (pickle, _pickle):
        for name in ("load", "loads", "Unpickler"):
            setattr(mod, name, forbid(f"{mod.__name__}.{name}"))
    np.load = forbid("numpy.load")
    numpy.lib.format.read_array = forbid("numpy.lib.format.read_array")

    def audit(event, args):
        if event in ("pickle.find_class", "marshal.loads"):
            raise Forbidden(f"audit event {event} {args!r}")
    sys.addaudithook(audit)

    class NoPickleImport:
        def find_spec(self, name, path=None, target=None):
            if name in ("pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib"):
                raise Forbidden(f"import of {name}")
            return None
    sys.meta_path.insert(0, NoPickleImport())
    for m in ("pickle", "_pickle"):
        sys.modules.pop(m, None)  # a fresh `import pickle` now hits the finder

    # The guards work:
    for check in (lambda: __import__("pickle"), lambda: np.load("x.npy")):
        try:
            check()
        except Forbidden:
            pass
        else:
            raise SystemExit("a guard did not fire")

    out = {}
    for zero_copy in (False, True):
        r = pccheck.load_latest(sys.argv[1], zero_copy=zero_copy)
        out[str(zero_copy)] = {"step": r.step, "metadata": r.metadata,
                               "arrays": {k: [str(v.dtype), list(v.shape),
                                              hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()]
                                          for k, v in r.state.items()}}
    print(json.dumps(out))
"""


def test_load_path_never_unpickles(tmp_path):
    import hashlib

    d = tmp_path / "c"
    rec = np.zeros(4, dtype=[("id", "<i8"), ("name", "S8"), ("xy", "<f4", (2,))])
    rec["id"] = [1, 2, 3, 4]
    rec["name"] = [b"a", b"bb", b"ccc", b"dddd"]
    rec["xy"] = np.arange(8, dtype=np.float32).reshape(4, 2)
    state = {**make_state(), "rec": rec, "half": np.linspace(0, 1, 33, dtype=np.float16),
             "c": (np.arange(6) + 1j).astype(np.complex128), "empty": np.zeros((0, 3), np.int8),
             "big_endian": np.arange(5, dtype=">u4")}
    with pccheck.Checkpointer(state, d, **KW, metadata={"run": "no-pickle", "nested": {"lr": 0.1}}) as ck:
        committed(ck, 9)
    p = run_py(_NO_PICKLE, tmp_path, str(d))
    assert p.returncode == 0, p.stderr + p.stdout
    got = json.loads(p.stdout.strip().splitlines()[-1])
    want = {k: [str(v.dtype), list(v.shape), hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()]
            for k, v in state.items()}
    for zero_copy in ("False", "True"):
        assert got[zero_copy]["step"] == 9
        assert got[zero_copy]["metadata"] == {"run": "no-pickle", "nested": {"lr": 0.1}}
        assert got[zero_copy]["arrays"] == want
