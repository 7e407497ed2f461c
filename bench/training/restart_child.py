"""The processes :mod:`bench.training.restart` starts: one training run to kill, one restart, one fresh start.

Run only by bench.restart, as ``python bench/training/restart_child.py SPEC`` (SPEC: one JSON object, see
:func:`bench.restart.child_spec`). The clock starts on the first line below, before any import; the
parent passes the wall-clock time at which it spawned this process (``spawn_wall``), so the phase
``start`` is the interpreter's own start-up.

Roles:

``train``    builds the workload, checkpoints it with the system's saver every ``interval`` steps,
             prints ``ready S`` once the checkpoint of step S is durable, then trains on (printing
             ``step s`` after every step) until the parent SIGKILLs it.
``restart``  the timed restart: imports, model build, load of the newest checkpoint, the saver's
             set-up (pccheck: ``Checkpointer`` construction on the same store), the first step,
             the first checkpoint (taken right after the first step; how long it blocked), then
             ``iters`` steps with checkpoints every ``interval`` steps (their it/s).
``fresh``    the same without the load, into an empty directory: the it/s a fresh start gets.

The workload (:func:`make_blocks`): ``blocks`` x (``Linear(d, d)`` + ``LayerNorm(d)``) trained with
fused ``AdamW``, d chosen so that the model's and the optimizer's tensors hold ``nbytes`` (the
parameters a third of it). **The GPU is emulated**: one iteration runs the real forward of every
block on a batch of ``batch`` rows (under ``no_grad``, so each block's forward pre-hooks fire, as a
lazy restore needs), sleeps ``iter_time`` (the host waiting for the GPU's backward), then
``optimizer.step()`` updates every parameter and the optimizer's state in place; the gradients are
set once, when the model is built (as :mod:`bench.harness.workloads` does).

The last line a ``restart`` or ``fresh`` child prints is one JSON object (its phases in seconds and
what it measured), or ``{"error": ...}`` with exit status 1.
"""

import time

_T0_WALL, _T0 = time.time(), time.perf_counter()  # before any import: this process's clock starts here

import importlib  # noqa: E402  (after the clock, on purpose)
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable, Mapping  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

if TYPE_CHECKING:
    from bench.harness.systems import LoopSystem
    from bench.harness.workloads import Workload

__all__ = ["SYSTEMS", "PHASES", "SAVERS", "make_blocks", "block_width", "state_bytes", "loop_system", "load", "main"]

SYSTEMS: tuple[str, ...] = ("pccheck_eager", "pccheck_lazy", "torch_load", "dcp", "safetensors",
                            "pccheck_eager_build_first", "pccheck_lazy_build_first")
BUILD_FIRST = "_build_first"  # the restart builds the Checkpointer, THEN loads (a common order in training scripts)
PHASES: tuple[str, ...] = ("start", "imports", "build", "load", "setup", "first_step", "first_checkpoint")
SAVERS = {  # the system that writes each one's checkpoints, in the training run and after the restart
    "pccheck_eager": "pccheck_N2", "pccheck_lazy": "pccheck_N2", "torch_load": "torch_save",
    "dcp": "dcp_async", "safetensors": "safetensors",
    "pccheck_eager_build_first": "pccheck_N2", "pccheck_lazy_build_first": "pccheck_N2",
}
_LIBRARIES = {"pccheck_eager": "pccheck", "pccheck_lazy": "pccheck", "torch_load": "torch",
              "dcp": "torch.distributed.checkpoint", "safetensors": "safetensors.torch",
              "pccheck_eager_build_first": "pccheck", "pccheck_lazy_build_first": "pccheck"}


# -- the workload ---------------------------------------------------------------------------------------

def block_width(nbytes: int, blocks: int, model: str = "bench") -> int:
    """d such that ``blocks`` x (Linear(d, d) + LayerNorm(d)) with AdamW holds about ``nbytes``:
    3 float32 copies (parameter, exp_avg, exp_avg_sq) of d^2 + 3d per block. ``bench`` rounds
    d^2 alone (3344 at 1 GiB in 8 blocks), ``mlp_relu`` solves d^2 + 3d exactly (3342)."""
    per_block = nbytes / (12 * blocks)
    if model == "mlp_relu":
        return max(8, int(((9 + 4 * per_block) ** 0.5 - 3) / 2))
    return max(8, int(per_block ** 0.5))


def state_bytes(nbytes: int, blocks: int, model: str = "bench") -> int:
    """Bytes of the model's and the optimizer's tensors :func:`make_blocks` makes (AdamW's step
    counters left out: 4 bytes each)."""
    d = block_width(nbytes, blocks, model)
    return 3 * 4 * blocks * (d * d + 3 * d)


def make_blocks(nbytes: int, blocks: int, batch: int, iter_time: float, model_kind: str = "bench",
                threads: int | None = None) -> "Workload":
    """The model, its fused AdamW and one (emulated GPU) iteration; see the module docstring.
    ``model_kind`` ``mlp_relu`` adds a ReLU to every block; ``threads``:
    ``torch.set_num_threads`` (None: torch's default)."""
    import torch

    from bench.harness.workloads import LR, Workload

    if threads:
        torch.set_num_threads(threads)
    d = block_width(nbytes, blocks, model_kind)
    torch.manual_seed(0)
    relu = [torch.nn.ReLU] if model_kind == "mlp_relu" else []
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.LayerNorm(d),
                                                      *(f() for f in relu))
                                  for _ in range(blocks)])
    for p in model.parameters():  # set once: what the (emulated) backward would leave
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    x = torch.randn(batch, d)

    def step() -> None:
        with torch.no_grad():
            model(x)           # every block's forward (and its forward pre-hooks)
        time.sleep(iter_time)  # the host waiting for the (emulated) GPU's backward
        opt.step()             # every byte of parameters and optimizer state updated in place

    act = " + ReLU" if relu else ""
    return Workload("blocks", model, opt, step,
                    f"GPU EMULATED: {blocks} x (Linear({d}, {d}) + LayerNorm({d}){act}), real forward of a batch "
                    f"of {batch} (no_grad), sleep {iter_time * 1e3:g} ms, fused AdamW.step() over "
                    f"{state_bytes(nbytes, blocks, model_kind) / (1 << 20):.0f} MiB of float32 state (parameters a third "
                    f"of it), torch threads {torch.get_num_threads()}")


# -- saving (bench.systems' training-loop systems) ----------------------------------------------------------

def _safetensors_system() -> type:
    from bench.harness.systems import LoopSystem, safetensors_save_durable

    class SafetensorsSave(LoopSystem):
        """Synchronous ``save_file`` of the model's and the optimizer's tensors, flattened as
        :meth:`Workload.tensors` names them; the previous file is deleted once the new one is durable."""

        name = "safetensors"
        prev: Path | None = None

        def checkpoint(self, step: int) -> None:
            path = self.dir / f"ckpt-{step}.safetensors"
            safetensors_save_durable({k: v.contiguous() for k, v in self.wl.tensors()}, path)
            if self.prev is not None:
                self.prev.unlink()
            self.prev = path

    return SafetensorsSave


def loop_system(system: str, wl: "Workload", workdir: Path, interval: int) -> "LoopSystem":
    """The saver of ``system`` (:data:`SAVERS`) on ``workdir``, checkpointing every ``interval`` steps."""
    from bench.harness.systems import make_loop_system

    if SAVERS[system] == "safetensors":
        return _safetensors_system()(wl, workdir, interval)
    return make_loop_system(SAVERS[system], wl, workdir, interval, None)


# -- loading -------------------------------------------------------------------------------------------------

def _newest(workdir: Path, pattern: str) -> tuple[int, Path]:
    """(step, path) of the newest ``pattern`` (``ckpt-*.pt``, ``step-*``) in ``workdir``."""
    found = [(int(p.name.split("-", 1)[1].split(".")[0]), p) for p in workdir.glob(pattern)]
    if not found:
        raise FileNotFoundError(f"no {pattern} in {workdir}")
    return max(found)


def _put_flat(wl: "Workload", flat: Mapping[str, Any], model_prefix: str, optim_prefix: str) -> None:
    """``load_state_dict`` of model and optimizer from flat tensors: the optimizer's named
    ``{optim_prefix}{param id}.{key}``, the model's ``{model_prefix}{state_dict key}``; the param groups
    are the fresh optimizer's (same hyperparameters)."""
    model_sd: dict[str, Any] = {}
    state: dict[int, dict[str, Any]] = {}
    for k, v in flat.items():
        if k.startswith(optim_prefix):
            pid, key = k[len(optim_prefix):].split(".", 1)
            state.setdefault(int(pid), {})[key] = v
        elif k.startswith(model_prefix):
            model_sd[k[len(model_prefix):]] = v
    wl.model.load_state_dict(model_sd)
    wl.optimizer.load_state_dict({"state": state, "param_groups": wl.optimizer.state_dict()["param_groups"]})


def _load_dcp(wl: "Workload", workdir: Path) -> int:
    """``dcp.load`` (bench.systems' :func:`dcp_load`) of the tensors the DCP metadata lists."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from bench.harness.systems import dcp_load, quiet_dcp_warnings

    quiet_dcp_warnings()
    step, src = _newest(workdir, "step-*")
    meta = FileSystemReader(src).read_metadata().state_dict_metadata
    shapes = {k: (tuple(m.size), torch.empty(0, dtype=m.properties.dtype).numpy().dtype)
              for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
    _put_flat(wl, dcp_load(shapes, src), "model.", "optim.state.")
    return step


def _load_torch(wl: "Workload", workdir: Path) -> int:
    """``torch.load(weights_only=True)`` (bench.systems' :func:`torch_load`) + ``load_state_dict``."""
    from bench.harness.systems import torch_load

    step, path = _newest(workdir, "ckpt-*.pt")
    sd = torch_load(path)
    wl.model.load_state_dict(sd["model"])
    wl.optimizer.load_state_dict(sd["optim"])
    return step


def _load_safetensors(wl: "Workload", workdir: Path) -> int:
    """``safetensors.torch.load_file`` (bench.systems' :func:`safetensors_load`) + ``load_state_dict``."""
    from bench.harness.systems import safetensors_load

    step, path = _newest(workdir, "ckpt-*.safetensors")
    _put_flat(wl, safetensors_load(path), "", "optim.")
    return step


def load(system: str, wl: "Workload", workdir: Path) -> tuple[int, Any]:
    """Load the newest checkpoint of ``system`` into ``wl``: (its step, a lazy restore or None)."""
    if system.startswith("pccheck"):
        import pccheck

        lazy = {"lazy": True} if system.startswith("pccheck_lazy") else {}
        r = pccheck.load_latest(workdir, model=wl.model, optimizer=wl.optimizer, **lazy)
        return r.step, (r if lazy else None)
    loaders: dict[str, Callable[["Workload", Path], int]] = {
        "torch_load": _load_torch, "dcp": _load_dcp, "safetensors": _load_safetensors}
    return loaders[system](wl, workdir), None


# -- the roles -----------------------------------------------------------------------------------------------

def _build(spec: Mapping[str, Any]) -> "Workload":
    return make_blocks(spec["nbytes"], spec["blocks"], spec["batch"], spec["iter_time"],
                       spec.get("model", "bench"), spec.get("threads"))


def train(spec: Mapping[str, Any]) -> None:
    """The training run the parent kills (see the module docstring)."""
    wl, workdir = _build(spec), Path(spec["dir"])
    ls = loop_system(spec["system"], wl, workdir, spec["interval"])
    step = 0
    while True:
        step += 1
        wl.step()
        if ls.after_step(step) and step == spec["interval"]:
            ls.drain()
            print(f"ready {step}", flush=True)
        print(f"step {step}", flush=True)


def _first_checkpoint(ls: "LoopSystem", step: int) -> dict[str, Any]:
    """Checkpoint ``step`` now; the call's wall time (the next step's copy-on-write wait is read later)."""
    t0 = time.perf_counter()
    ls.checkpoint(step)
    return {"call_s": time.perf_counter() - t0}


def _pool_watch(ls: "LoopSystem") -> dict[str, Any]:
    """Whether the saver's chunk pool is faulted in as the first checkpoint starts
    (``Checkpointer.wait_ready(0)``, pccheck only); if not, a thread times how much longer it takes
    (``pool_ready_after_s``, filled in once it is)."""
    ck = getattr(ls, "ck", None)
    if ck is None:
        return {}
    out: dict[str, Any] = {"pool_ready_at_first": ck.wait_ready(0)}
    if not out["pool_ready_at_first"]:
        t0 = time.perf_counter()

        def watch() -> None:
            if ck.wait_ready(120.0):
                out["pool_ready_after_s"] = time.perf_counter() - t0

        threading.Thread(target=watch, daemon=True).start()
    return out


def _window(wl: "Workload", ls: "LoopSystem", first: int, iters: int) -> dict[str, Any]:
    """``iters`` steps from ``first`` on, checkpointing as the interval says: their it/s."""
    calls: dict[int, float] = {}  # step -> wall time of the maybe_checkpoint call that checkpointed it
    t0 = time.perf_counter()
    for s in range(first, first + iters):
        wl.step()
        c0 = time.perf_counter()
        if ls.after_step(s):
            calls[s] = time.perf_counter() - c0
    window = time.perf_counter() - t0
    return {"iters": iters, "window_s": window, "it_s": iters / window, "checkpoints_in_window": len(calls),
            "window_calls_s": calls}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _blocking(ls: "LoopSystem", first: Mapping[str, Any], window_calls: Mapping[int, float]) -> dict[str, Any]:
    """How long the first checkpoint blocked training: the call, plus (pccheck) the copy-on-write
    wait it left to the next step. pccheck's own account (``stats_block_s``: stall + blocked copy +
    copy-on-write wait from ``ck.stats()``) is reported beside it; what the call spends outside it
    (opening the store, say) is the difference. ``steady_block_s``: the median of the same measure
    over the window's later checkpoints (the steady state the first one is compared with)."""
    ck = getattr(ls, "ck", None)
    if ck is None:
        return {**first, "block_s": first["call_s"], "steady_block_s": _median(list(window_calls.values()))}
    stats = ck.stats().as_dict()["checkpoints"]
    c = stats[0]
    parts = {k: c[k] for k in ("stall_s", "prepare_s", "blocked_copy_s", "cow_wait_s")}
    first = {**first, "backpressure_s": c["backpressure_s"], "copy_s": c["copy_s"]}
    cow = {x["step"]: x["cow_wait_s"] for x in stats[1:]}
    steady = [call + cow[s] for s, call in window_calls.items() if s in cow]
    return {**first, **parts, "stats_block_s": sum(parts.values()), "block_s": first["call_s"] + c["cow_wait_s"],
            "outcome": c["outcome"], "steady_block_s": _median(steady)}


def resume(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The timed ``restart`` (``spec["role"] == "restart"``) or ``fresh`` start."""
    marks = {"start": _T0_WALL - spec["spawn_wall"]}
    lap = [_T0]

    def mark(phase: str) -> None:
        now = time.perf_counter()
        marks[phase], lap[0] = now - lap[0], now

    # torch._dynamo: what torch.optim's first optimizer imports (seconds), counted with the imports
    for lib in ("torch", "torch._dynamo", "bench.harness.systems", _LIBRARIES[spec["system"]]):
        importlib.import_module(lib)
    mark("imports")
    wl, workdir = _build(spec), Path(spec["dir"])
    mark("build")
    build_first = spec["system"].endswith(BUILD_FIRST)
    if build_first:  # the Checkpointer before load_latest, as many training scripts do (a common order in training scripts)
        ls = loop_system(spec["system"], wl, workdir, spec["interval"])
        mark("setup")
    step, lazy = load(spec["system"], wl, workdir) if spec["role"] == "restart" else (0, None)
    mark("load")
    if not build_first:
        ls = loop_system(spec["system"], wl, workdir, spec["interval"])
        mark("setup")
    wl.step()
    mark("first_step")
    out: dict[str, Any] = {"to_first_step_s": sum(marks.values()), "loaded_step": step}
    if lazy is not None:
        t0 = time.perf_counter()
        lazy.wait()
        out["lazy_wait_after_first_step_s"] = time.perf_counter() - t0
    after = spec.get("first_after", 1)
    for _ in range(after - 1):  # the first checkpoint comes `first_after` steps after the restart
        wl.step()
    pool = _pool_watch(ls)  # before the call, untimed
    first = _first_checkpoint(ls, step + after)
    out.update(_window(wl, ls, step + after + 1, spec["iters"]))
    ls.drain()
    out["first_checkpoint"] = {**_blocking(ls, first, out["window_calls_s"]), **pool}
    marks["first_checkpoint"] = out["first_checkpoint"]["block_s"]
    ls.close()
    return {"role": spec["role"], "system": spec["system"], "phases": marks, **out, "versions": _versions()}


def _versions() -> dict[str, str]:
    """The libraries this process used, and where its pccheck came from (the checkout or installed)."""
    from bench.harness.common import versions

    found = versions(["torch", "numpy", "safetensors", "pccheck"])
    if "pccheck" in sys.modules:
        found["pccheck_path"] = str(Path(sys.modules["pccheck"].__file__ or "?").parent)
    return found


def main(argv: list[str]) -> int:
    """Run the role SPEC (``argv[1]``) names; print the result (or the error) as one JSON line."""
    spec = json.loads(argv[1])
    try:
        if spec["role"] == "train":
            train(spec)
        print(json.dumps(resume(spec)), flush=True)
        return 0
    except Exception as exc:  # reported to the parent, which marks the system failed and goes on
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    sys.path[:1] = _spec["path_first"]  # not bench/ (this script's folder): the parent's pccheck first
    sys.path.append(_spec["root"])      # then bench, from the checkout, after site-packages
    sys.exit(main(sys.argv))
