"""The ``pccheck-tune`` command: profile this machine and choose N, p, chunk size and interval (§3.4).

    pccheck-tune --path /mnt/ckpt --size 1.3GiB --iter-time 0.12 --max-overhead 1.03 \\
                 --dram-budget 2x --storage-budget 8GiB [--failure-rate 0.5] [--json] [--write-config]
    pccheck-tune --path /mnt/ckpt [--size 1.3GiB] -- python train.py ...

The second form runs the training script with ``$PCCHECK_TUNE_REPORT`` set; the script calls
:func:`pccheck.tune.report_iteration` once per iteration, which gives the iteration time t (and the
checkpoint size m if it passes ``state_bytes``). After ``--iterations`` timed iterations the script
is stopped (SIGTERM to its process group) and the storage is profiled.

Exit status: 0 success; 2 bad arguments (the message says which and what to do); 1 a failure
while profiling (e.g. the device reported an I/O error). A progress bar goes to stderr; the table
(or with ``--json`` one JSON document, the same as the config file) goes to stdout. This module
only parses, runs the profile and renders; the work is in :mod:`pccheck.tuner.profile`,
:mod:`pccheck.tuner.search` and :mod:`pccheck.tuner.config`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..checkpointer import Checkpointer
from ..errors import ConfigError, PathNotWritableError, PCCheckError
from ..persist.files import default_path
from ..tuner.config import make_config, write_config
from ..tuner.online import ENV_VAR
from ..tuner.profile import run_profile
from ..tuner.samples import DEFAULT_N_CAP, Profile, ProfileSpec
from ..tuner.search import Choice, Constraints, choose

__all__ = ["app", "main", "parse_size"]

log = logging.getLogger("pccheck")

app = typer.Typer(name="pccheck-tune", add_completion=False,
                  help="Profile copy and storage bandwidth and choose pccheck's N, writer threads, chunk size "
                       "and checkpoint interval (PCcheck §3.4).")

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}
_SIZE_RE = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*$")
_MiB = 1 << 20


class _BadArgs(Exception):
    """A bad command-line argument: exit status 2."""


def parse_size(text: str, what: str = "size") -> int:
    """``"1.3GiB"``, ``"512MiB"``, ``"1e9"``, ``"4096"`` → bytes (KiB/MiB/GiB and bare K/M/G are
    binary, KB/MB/GB decimal). Raises ValueError with a message for anything else or <= 0."""
    m = _SIZE_RE.match(text or "")
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot parse {what} {text!r}; write it like 512MiB, 1.3GiB or 4096")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{what} must be a positive number of bytes, got {text!r}")
    return int(value)


def _parse_budget(text: str, m: int, what: str) -> int:
    """``"2x"`` (a multiple of the checkpoint size m) or a size."""
    t = text.strip().lower()
    if t.endswith("x"):
        try:
            factor = float(t[:-1])
        except ValueError:
            raise ValueError(f"cannot parse {what} {text!r}; write a multiple of the state like 2x, "
                             "or a size like 8GiB") from None
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"{what} must be positive, got {text!r}")
        return int(factor * m)
    return parse_size(text, what)


def _parse_list(text: str, conv: Any, what: str) -> tuple[Any, ...]:
    items = tuple(conv(x.strip()) for x in text.split(",") if x.strip())
    if not items:
        raise ValueError(f"{what} is empty")
    return items


def _check_path(path: Path) -> None:
    """The store directory exists or can be made, and a file can be created in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".pccheck-tune-probe-"):
            pass
    except OSError as exc:
        raise _BadArgs(f"--path {path} is not a writable directory ({exc.strerror or exc}); "
                       "pass the directory your checkpoints will go to") from None


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB/s"


def _size(n: int) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f:
            return f"{n / f:.3g} {unit}"
    return f"{n} B"


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.2f} s"


# -- profiling a training script -------------------------------------------------------------------

def _profile_script(command: list[str], iterations: int, warmup: int, timeout: float,
                    console: Console) -> tuple[float, int | None, int]:
    """Runs ``command`` with ``$PCCHECK_TUNE_REPORT`` set until it reported ``warmup + iterations + 1``
    iterations (then stops it), exits, or ``timeout`` seconds pass. Returns (t, m or None, reports)."""
    with tempfile.TemporaryDirectory(prefix="pccheck-tune-") as td:
        report = Path(td) / "iterations"
        report.touch()
        env = {**os.environ, ENV_VAR: str(report)}
        want = warmup + iterations + 1
        try:
            # The script's stdout goes to our stderr: our stdout is the table or the JSON document.
            proc = subprocess.Popen(command, env=env, stdout=2, start_new_session=True)
        except OSError as exc:
            raise _BadArgs(f"cannot run {' '.join(command)!r} ({exc.strerror or exc})") from None
        lines: list[str] = []
        t0 = time.monotonic()
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task("running the training script: iterations reported", total=want)
            try:
                while True:
                    lines = report.read_text().splitlines()
                    bar.update(task, completed=min(len(lines), want))
                    if len(lines) >= want or proc.poll() is not None or time.monotonic() - t0 > timeout:
                        break
                    time.sleep(0.05)
            finally:
                _stop(proc)
        lines = report.read_text().splitlines()
    stamps, sizes = [], []
    for ln in lines:
        parts = ln.split()
        if len(parts) == 2:
            try:
                stamps.append(float(parts[0]))
                sizes.append(int(parts[1]))
            except ValueError:
                continue
    used = stamps[warmup:] if len(stamps) > warmup + 3 else stamps
    dts = [b - a for a, b in zip(used, used[1:]) if b > a]
    if len(dts) < 3:
        rc = proc.returncode
        raise _BadArgs(f"the script reported {len(stamps)} iteration(s) (exit status {rc}); it must call "
                       "pccheck.tune.report_iteration() (or a Checkpointer's maybe_checkpoint) once per "
                       "training iteration and run at least "
                       f"{warmup + 4} iterations (or lower --warmup-iterations)")
    m = next((s for s in reversed(sizes) if s > 0), None)
    return statistics.median(dts), m, len(stamps)


def _stop(proc: subprocess.Popen) -> None:
    """Stops the script and everything it started (its own session): SIGTERM, then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


# -- rendering -----------------------------------------------------------------------------------

def _render(console: Console, profile: Profile, choice: Choice, c: Constraints, t_source: str,
            written: Path | None) -> None:
    meas = Table(title="measured", title_justify="left", show_header=True)
    for h in ("quantity", "setting", "value"):
        meas.add_column(h, justify="right" if h == "value" else "left")
    meas.add_row("m (checkpoint size)", "", _size(c.state_bytes))
    meas.add_row("t (iteration time)", t_source, _ms(c.iter_time))
    dev = "device → pinned" if profile.device == "cuda" else "memcpy → pre-touched"
    for s in profile.copy:
        meas.add_row("T_G (copy)", f"{dev}, {_size(s.chunk_size)} chunks", _gb(s.bytes_per_s))
    for s in profile.storage:
        meas.add_row("T_S (storage, via pccheck)",
                     f"{s.writer_threads} thread(s), {_size(s.chunk_size)} chunks, {s.mode}",
                     _gb(s.bytes_per_s))
    for w in profile.write:
        meas.add_row(f"T_w, N={w.n}", "a checkpoint every t" + (", soft copy-on-write" if profile.soft_cow else ""),
                     f"{_ms(w.tw_s)}  (T_w/N {_ms(w.tw_per_n)})")
    if profile.blocked is not None:
        b = profile.blocked
        meas.add_row("B (cost per checkpoint)", f"a checkpoint every {b.interval} iterations, end to end",
                     f"{_ms(b.blocked_s)}")
    console.print(meas)

    ch = Table(title="chosen", title_justify="left")
    ch.add_column("parameter")
    ch.add_column("value", justify="right")
    ch.add_column("why")
    ch.add_row("N* (max_concurrent)", str(choice.max_concurrent),
               f"smallest interval within q; argmin T_w/N = {choice.paper_n}" if choice.objective == "overhead"
               else "least wasted time (goodput)")
    ch.add_row("p* (writer_threads)", str(choice.writer_threads), f"T_S {_gb(choice.storage_bytes_per_s)}")
    ch.add_row("b (chunk_size)", _size(choice.chunk_size),
               f"c = {choice.chunks} chunks in {_size(choice.dram_bytes)} of DRAM")
    ch.add_row("f* (interval)", str(choice.interval),
               f"eq. (3) ceil(T_w/(N* q t)) = {choice.interval_eq3}; blocked copy term = {choice.interval_blocked}"
               if choice.objective == "overhead" else "minimises the wasted fraction")
    if choice.objective == "goodput":
        yd = f"{choice.young_daly_interval:.1f}" if choice.young_daly_interval else "n/a (nothing blocks)"
        ch.add_row("Young/Daly N*", yd, f"sqrt(2 T_ckpt / (p T_step^2)), {choice.failure_rate:g} failures/h")
        ch.add_row("goodput", f"{choice.goodput:.4f}", f"wasted fraction {choice.waste_fraction:.4f}")
    ch.add_row("expected slowdown", f"{choice.expected_slowdown:.3f}", f"q = {choice.max_overhead:g}")
    ch.add_row("recovery bound, eq. (4)", _ms(choice.recovery_bound_s),
               f"l + f t + t min(N f, T_w/t); l = {_ms(choice.load_s)}"
               + (" (estimated m/T_S)" if choice.load_estimated else ""))
    ch.add_row("spread_steps (\"auto\")", str(choice.spread_steps),
               f"modelled stall per checkpoint {_ms(choice.spread_stall_s)} over k steps vs {_ms(choice.whole_stall_s)} "
               f"in one (gradients {_size(choice.grad_bytes)} per step)")
    ch.add_row("storage used", _size(choice.storage_bytes), "(N*+1) m")
    ch.add_row("profiling time", f"{profile.seconds:.1f} s", "")
    console.print(ch)
    for note in choice.notes:
        console.print(f"note: {note}")
    if written:
        console.print(f"wrote {written}: Checkpointer(..., disk=DiskOptions(every=\"auto\"), max_concurrent=\"auto\", ...) reads it")
    else:
        console.print("pass --write-config to store this choice for Checkpointer(..., disk=DiskOptions(every=\"auto\"))")


# -- the command ---------------------------------------------------------------------------------

@app.command(context_settings={"help_option_names": ["-h", "--help"]})
def tune(
    command: Annotated[Optional[list[str]], typer.Argument(
        help="after --: a training script to run and time (it calls pccheck.tune.report_iteration(), "
             "or uses a Checkpointer)",
        show_default=False)] = None,
    path: Annotated[Optional[Path], typer.Option("--path", help="the store directory to profile (default: "
                                                 "$PCCHECK_DIR or ./checkpoints)", show_default=False)] = None,
    size: Annotated[Optional[str], typer.Option("--size", help="checkpoint size m, e.g. 1.3GiB (optional with a "
                                                "script that reports state_bytes)", show_default=False)] = None,
    iter_time: Annotated[Optional[float], typer.Option("--iter-time", help="seconds per training iteration t "
                                                       "(or give a script)", show_default=False)] = None,
    max_overhead: Annotated[float, typer.Option("--max-overhead", help="q: the largest acceptable slowdown, "
                                                ">= 1 (1.03 = 3%)")] = 1.03,
    dram_budget: Annotated[str, typer.Option("--dram-budget", help="M: DRAM for chunks, a multiple of m (2x) "
                                             "or a size")] = "2x",
    storage_budget: Annotated[Optional[str], typer.Option("--storage-budget", help="S: storage for the store, "
                              "a size or a multiple of m (default: room for N up to --max-n)",
                              show_default=False)] = None,
    failure_rate: Annotated[Optional[float], typer.Option("--failure-rate", help="failures per hour: maximise "
                            "goodput (Young/Daly) instead of the smallest interval within q",
                            show_default=False)] = None,
    load_time: Annotated[Optional[float], typer.Option("--load-time", help="seconds to load a checkpoint "
                         "(eq. 4; default m / T_S)", show_default=False)] = None,
    grad_bytes: Annotated[Optional[str], typer.Option("--grad-bytes", help="gradient bytes per step, for "
                          "spread_steps=\"auto\" (default m/3: fp32 parameters with Adam's two moments)",
                          show_default=False)] = None,
    threads: Annotated[str, typer.Option("--threads", help="writer thread counts to try")] = "1,2,3,4",
    chunks: Annotated[str, typer.Option("--chunks", help="chunk sizes to try")] = "16MiB,64MiB,256MiB",
    max_n: Annotated[int, typer.Option("--max-n", help="largest N to try (also bounded by S/m - 1)")] = DEFAULT_N_CAP,
    device: Annotated[str, typer.Option("--device", help="where the state lives: auto, cpu or cuda")] = "auto",
    exhaustive: Annotated[bool, typer.Option("--exhaustive", help="every thread x chunk pair and every N")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON document instead of tables")] = False,
    write: Annotated[bool, typer.Option("--write-config", help="store the choice as PATH/pccheck-tune.json")] = False,
    iterations: Annotated[int, typer.Option("--iterations", help="script mode: iterations to time")] = 30,
    warmup_iterations: Annotated[int, typer.Option("--warmup-iterations", help="script mode: iterations "
                                 "ignored first")] = 5,
    script_timeout: Annotated[float, typer.Option("--script-timeout", help="script mode: seconds to wait "
                              "for the iterations")] = 600.0,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log what the profilers do")] = False,
) -> None:
    """Profile T_G, T_S and T_w at PATH and choose N*, p*, b and f* (PCcheck §3.4)."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        code = _run(command or [], path, size, iter_time, max_overhead, dram_budget, storage_budget, failure_rate,
                    load_time, threads, chunks, max_n, device, exhaustive, as_json, write, iterations,
                    warmup_iterations, script_timeout, err, grad_bytes)
    except (_BadArgs, ConfigError, PathNotWritableError, ValueError) as exc:
        _fail(as_json, err, exc, 2)
    except PCCheckError as exc:
        _fail(as_json, err, exc, 1)
    raise typer.Exit(code)


def _fail(as_json: bool, err: Console, exc: Exception, code: int) -> None:
    if as_json:
        typer.echo(json.dumps({"error": str(exc), "type": type(exc).__name__}))
    err.print(f"[bold red]error:[/] {exc}", markup=True)
    raise typer.Exit(code)


def _run(command: list[str], path: Optional[Path], size: Optional[str], iter_time: Optional[float], q: float,
         dram_budget: str, storage_budget: Optional[str], failure_rate: Optional[float], load_time: Optional[float],
         threads: str, chunks: str, max_n: int, device: str, exhaustive: bool, as_json: bool, write: bool,
         iterations: int, warmup_iterations: int, script_timeout: float, err: Console,
         grad_bytes: Optional[str] = None) -> int:
    """The command: every argument checked before anything runs, then profile, choose, report."""
    _check_options(command, iter_time, q, failure_rate, load_time, max_n, device, iterations, warmup_iterations,
                   script_timeout)
    m = parse_size(size, "--size") if size is not None else None
    if m is None and not command:
        raise _BadArgs("give --size (the checkpoint size m, e.g. 1.3GiB)")
    thread_list, chunk_list = _parse_sweeps(threads, chunks)
    if path is None:
        path = default_path()
    _check_path(path)
    # budgets need m, which a script may report: checked after it ran
    m, iter_time, t_source = _workload(command, m, iter_time, iterations, warmup_iterations, script_timeout, err)
    M, S = _budgets(m, dram_budget, storage_budget, max_n)
    g = parse_size(grad_bytes, "--grad-bytes") if grad_bytes is not None else None
    constraints = Constraints(m, iter_time, q, M, S, failure_rate, load_time, grad_bytes=g)
    spec = ProfileSpec(path=path, state_bytes=m, iter_time=iter_time, dram_budget=M, storage_budget=S,
                       threads=thread_list, chunks=chunk_list, n_cap=max_n, device=device, exhaustive=exhaustive,
                       max_overhead=q)
    profile = _profile(spec, err)
    choice = choose(profile, constraints)
    doc = make_config(constraints, profile, choice, path=path)
    written = write_config(path, doc) if write else None
    if as_json:
        typer.echo(json.dumps({**doc, "config_written": str(written) if written else None}, indent=2))
    else:
        _render(Console(highlight=False), profile, choice, constraints, t_source, written)
    return 0


def _check_options(command: list[str], iter_time: Optional[float], q: float, failure_rate: Optional[float],
                   load_time: Optional[float], max_n: int, device: str, iterations: int, warmup_iterations: int,
                   script_timeout: float) -> None:
    """The numeric options and the choice between --iter-time and a script; _BadArgs if one is off."""
    if not (math.isfinite(q) and q >= 1):
        raise _BadArgs(f"--max-overhead is the largest acceptable slowdown factor q >= 1 (1.03 = 3%), got {q}")
    if failure_rate is not None and not (math.isfinite(failure_rate) and failure_rate > 0):
        raise _BadArgs(f"--failure-rate must be a positive number of failures per hour, got {failure_rate}")
    if load_time is not None and not (math.isfinite(load_time) and load_time >= 0):
        raise _BadArgs(f"--load-time must be >= 0 seconds, got {load_time}")
    if max_n < 1:
        raise _BadArgs(f"--max-n must be >= 1, got {max_n}")
    if device not in ("auto", "cpu", "cuda"):
        raise _BadArgs(f"--device must be auto, cpu or cuda, got {device!r}")
    if iterations < 3 or warmup_iterations < 0 or script_timeout <= 0:
        raise _BadArgs("--iterations must be >= 3, --warmup-iterations >= 0 and --script-timeout > 0")
    if command and iter_time is not None:
        raise _BadArgs("give either --iter-time or a training script after --, not both")
    if not command and iter_time is None:
        raise _BadArgs("give --iter-time SECONDS (the time of one training iteration), or a training script "
                       "after -- that calls pccheck.tune.report_iteration()")
    if iter_time is not None and not (math.isfinite(iter_time) and iter_time > 0):
        raise _BadArgs(f"--iter-time must be a positive number of seconds, got {iter_time}")


def _parse_sweeps(threads: str, chunks: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """--threads and --chunks as the writer-thread counts and chunk sizes (bytes) to try."""
    try:
        thread_list = _parse_list(threads, int, "--threads")
        chunk_list = _parse_list(chunks, lambda s: parse_size(s, "--chunks"), "--chunks")
    except ValueError as exc:
        raise _BadArgs(str(exc)) from None
    if any(p < 1 or p > 256 for p in thread_list):
        raise _BadArgs(f"--threads must be in [1, 256], got {threads!r}")
    if any(c < 4096 or c % 4096 for c in chunk_list):
        raise _BadArgs(f"--chunks must be multiples of 4096 bytes (4KiB), got {chunks!r}")
    return thread_list, chunk_list


def _workload(command: list[str], m: int | None, iter_time: Optional[float], iterations: int,
              warmup_iterations: int, script_timeout: float, err: Console) -> tuple[int, float, str]:
    """(m, t, where t comes from): from the options, or from timing the script when one is given."""
    t_source = "--iter-time"
    if command:
        t, reported_m, count = _profile_script(command, iterations, warmup_iterations, script_timeout, err)
        t_source = f"script, median of {max(0, count - warmup_iterations - 1)}"
        if m is None:
            if reported_m is None:
                raise _BadArgs("the script did not report state_bytes; give --size (the checkpoint size m)")
            m = reported_m
        elif reported_m is not None and not 0.5 <= reported_m / m <= 2:
            err.print(f"warning: the script reports {reported_m} bytes of state, --size says {m}; using --size")
        iter_time = t
    assert m is not None and iter_time is not None
    if m < 4096:
        raise _BadArgs(f"--size must be at least 4KiB, got {m} bytes")
    return m, iter_time, t_source


def _budgets(m: int, dram_budget: str, storage_budget: Optional[str], max_n: int) -> tuple[int, int]:
    """(M, S) in bytes: --dram-budget and --storage-budget (default room for N up to --max-n)."""
    M = _parse_budget(dram_budget, m, "--dram-budget")
    S = _parse_budget(storage_budget, m, "--storage-budget") if storage_budget is not None else (max_n + 1) * m
    if M < 4096:
        raise _BadArgs(f"--dram-budget must be at least 4KiB, got {M} bytes")
    if S < 2 * m:
        raise _BadArgs(f"--storage-budget ({S} bytes) must hold at least 2 checkpoints of {m} bytes "
                       "(N+1 slots, N >= 1)")
    return M, S


def _profile(spec: ProfileSpec, err: Console) -> Profile:
    """:func:`run_profile` through pccheck's Checkpointer, with a progress bar on ``err``."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task("profiling", total=1)

        def progress(label: str, done: int, total: int) -> None:
            bar.update(task, description=label, completed=done, total=total)

        return run_profile(spec, Checkpointer, progress)


def main() -> None:
    """Entry point of the ``pccheck-tune`` script."""
    app()


if __name__ == "__main__":
    main()
