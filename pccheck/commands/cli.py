"""The ``pccheck`` command: look into a store directory, check it, and get checkpoints out of it.

    pccheck ls      [PATH]                              generations and slots: status, step, age
    pccheck verify  [PATH]                              fsck: every meta record and array crc32c
    pccheck inspect [PATH] [--step N]                   a checkpoint's arrays: name, dtype, shape
    pccheck export  [PATH] [--step N] --format safetensors|torch --out FILE
    pccheck export  [PATH] [--step N] --format hf --out DIR [--dtype keep|bf16|fp32]
                    [--max-shard-size 5GB] [--config config.json]   the model, as from_pretrained reads it
    pccheck run     [--every S] [--path P] -- CMD ARGS...    checkpoint a whole process with CRIU
    pccheck resume  [--path P] [--every S]                  restore the newest valid CRIU image

PATH defaults to ``$PCCHECK_DIR``, else ./checkpoints. Every command takes ``--json`` and then
prints one JSON document on stdout instead of tables. Exit status: 0 success; ``verify``: 1 when
the latest checkpoint is invalid but an older one is valid, 2 when none is; any other command:
2 on an error (the message says what to do). All commands only read the store, so they are safe
to run while training writes to it (a slot being rewritten shows up as free or invalid).

This module only parses arguments and renders; the work is in :mod:`pccheck.ops.inventory`,
:mod:`pccheck.ops.export`, :mod:`pccheck.ops.hf_export` and :mod:`pccheck.transparent` (``run`` and ``resume`` need root and CRIU).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from ..version import __version__
from ..errors import ConfigError, PCCheckError
from ..tiers.remote.inventory import remote_url
from ..ops.export import export_checkpoint
from ..ops.inventory import (GenerationInfo, VerifyReport, find_stores, load, locate, resolve_directory, resolve_store,
                        survey, verify)

__all__ = ["app", "main"]

app = typer.Typer(name="pccheck", add_completion=False, no_args_is_help=True,
                  help="Inspect, verify and export pccheck checkpoint stores.")

PathArg = Annotated[Optional[Path], typer.Argument(help="store directory, or one above it (a Lightning dirpath, a distributed job's root; default: $PCCHECK_DIR or ./checkpoints), or s3://bucket/prefix (the remote tier)",
                                                   show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON document instead of tables")]
StepOpt = Annotated[Optional[int], typer.Option("--step", help="this step instead of the latest checkpoint")]


class ExportFormat(str, Enum):
    safetensors = "safetensors"
    torch = "torch"
    hf = "hf"


class ExportDtype(str, Enum):
    keep = "keep"
    bf16 = "bf16"
    fp32 = "fp32"


def _out() -> Console:
    return Console(highlight=False, soft_wrap=False)


def _emit_json(doc: Any) -> None:
    typer.echo(json.dumps(doc, indent=2, default=_json_default))


def _json_default(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def _guard(as_json: bool, fn: Callable[[], int | None]) -> None:
    """Runs a command; a PCCheckError becomes a message (or {"error": ...}) and exit status 2."""
    try:
        code = fn()
    except PCCheckError as exc:
        if as_json:
            _emit_json({"error": str(exc), "type": type(exc).__name__})
        else:
            Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {exc}", markup=True)
        raise typer.Exit(2) from None
    if code:
        raise typer.Exit(code)


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "min"), (172800, 3600, "h")):
        if s < limit:
            return f"{s / div:.0f} {unit}" if unit != "s" else f"{s:.1f} s"
    return f"{s / 86400:.1f} d"


def _text(x: Any) -> str:
    return "-" if x is None else str(x)


# -- ls -------------------------------------------------------------------------------------------

def _remote_ls(url: str, as_json: bool, check: bool) -> int:
    """``ls`` / ``verify`` of an s3:// prefix: its committed steps, newest first (verify: each
    fully checked; exit 0 / 1 / 2 as for a store)."""
    import time

    from ..tiers.remote import inventory as remote

    steps, code = remote.verify(url) if check else (remote.survey(url), 0)
    if as_json:
        _emit_json({"url": url, "steps": [s.as_dict() for s in steps], **({"exit_code": code} if check else {})})
        return code
    table = Table(title=url)
    for col in ("generation", "step", "ranks", "size", "age", "", "status"):
        table.add_column(col)
    for s in steps:
        age = time.time() - s.unix_time if s.unix_time else None
        status = s.problem if s.problem else ("valid" if check else "committed")
        table.add_row(str(s.generation), str(s.step), str(s.world_size), _bytes(s.nbytes), _age(age),
                      "latest" if s.pointer else "", status)
    _out().print(table)
    return code



def _stores(path: Path | None) -> list[Path]:
    """The stores at or below PATH; with none, resolve_store's NoCheckpointError says so."""
    return find_stores(path) or [resolve_store(path)]


@app.command("ls")
def ls_cmd(path: PathArg = None, as_json: JsonOpt = False) -> None:
    """List every store generation and slot: status, step, counter, size and age.

    PATH may be the directory a framework was given: the stores below it are listed (a Lightning
    dirpath's .pccheck/, each rank-r/ of a distributed job).
    """
    def run() -> int | None:
        if remote_url(path) is not None:  # the remote tier: FORMAT.md §12
            return _remote_ls(remote_url(path), as_json, check=False)
        found = [(d, survey(d)) for d in _stores(path)]
        if as_json:
            docs = [{"directory": str(d), "generations": [_gen_doc(g) for g in gens]} for d, gens in found]
            _emit_json(docs[0] if len(docs) == 1 else {"stores": docs})
            return
        con = _out()
        for d, gens in found:
            if len(found) > 1 or d != resolve_directory(path):
                con.print(f"[bold]store {d}[/]")
            for g in gens:
                _render_generation(con, g)

    _guard(as_json, run)


def _gen_doc(g: GenerationInfo) -> dict[str, Any]:
    doc = dataclasses.asdict(g)
    doc["path"] = str(g.path)
    if g.check_word is not None:
        doc["check_addr"] = {"slot": g.check_word & 0xFF, "counter": g.check_word >> 8} if g.check_word else None
    return doc


def _render_generation(con: Console, g: GenerationInfo) -> None:
    if g.problem is not None:
        con.print(f"generation {g.generation}  {g.path.name}  [bold red]unreadable[/]: {g.problem}")
        return
    word = (f"CHECK_ADDR slot {g.check_word & 0xFF} counter {g.check_word >> 8}" if g.check_word
            else "CHECK_ADDR 0 (no commit)")
    con.print(f"generation {g.generation}  {g.path.name}  {g.num_slots} slots x {_bytes(g.slot_capacity)}  "
              f"{_bytes(g.file_bytes)}  {word}")
    t = Table(show_edge=False, pad_edge=False)
    for col, just in (("slot", "right"), ("status", "left"), ("step", "right"), ("counter", "right"),
                      ("size", "right"), ("age", "right"), ("problem", "left")):
        t.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
    for s in g.slots:
        style = {"latest": "bold green", "invalid": "red"}.get(s.status, "")
        t.add_row(str(s.slot), f"[{style}]{s.status}[/]" if style else s.status, _text(s.step), _text(s.counter),
                  _bytes(s.data_bytes), _age(s.age_s), s.problem or "")
    con.print(t)


# -- verify ---------------------------------------------------------------------------------------


def _name(c: Any) -> str:
    if c is None:
        return "none"
    if c.slot < 0:
        return f"generation {c.generation}"
    step = f"step {c.step}, " if c.step is not None else ""
    return f"{step}counter {c.counter} (generation {c.generation}, slot {c.slot})"


def _verdict_line(r: VerifyReport) -> str:
    if r.exit_code == 0:
        return f"OK: the latest checkpoint, {_name(r.latest)}, is valid"
    if r.exit_code == 1:
        return (f"DAMAGED: the latest checkpoint, {_name(r.latest)}, is invalid ({r.latest_problem}); "
                f"the newest valid one is {_name(r.newest_valid)}, which load_latest will return")
    if r.latest is None:
        return "NO CHECKPOINT: no slot holds a checkpoint"
    return f"NO VALID CHECKPOINT: the latest, {_name(r.latest)}, is invalid ({r.latest_problem}) and nothing older is valid"


@app.command("verify")
def verify_cmd(path: PathArg = None, as_json: JsonOpt = False) -> None:
    """Check every slot: meta record, manifest and every array's crc32c (an fsck).

    Exit status 0: the latest checkpoint is valid; 1: it is not, but an older one is; 2: none is.
    With several stores below PATH (a distributed job's ranks), each is checked and the worst counts.
    """
    def run() -> int:
        if remote_url(path) is not None:
            return _remote_ls(remote_url(path), as_json, check=True)
        reports = [verify(d) for d in _stores(path)]
        if as_json:
            docs = [_verify_doc(r) for r in reports]
            worst = max(r.exit_code for r in reports)
            _emit_json(docs[0] if len(docs) == 1 else {"exit_code": worst, "stores": docs})
            return worst
        con = _out()
        for r in reports:
            if len(reports) > 1 or r.directory != resolve_directory(path):
                con.print(f"[bold]store {r.directory}[/]")
            _render_verify(con, r)
        return max(r.exit_code for r in reports)

    _guard(as_json, run)


def _verify_doc(r: VerifyReport) -> dict[str, Any]:
    return {"exit_code": r.exit_code, "verdict": _verdict_line(r), "directory": str(r.directory),
            "latest": r.latest, "latest_problem": r.latest_problem, "newest_valid": r.newest_valid,
            "slots": list(r.checks),
            "generation_problems": [{"generation": g, "problem": p} for g, p in r.generation_problems]}


def _render_verify(con: Console, r: VerifyReport) -> None:
    t = Table(show_edge=False, pad_edge=False)
    for col, just in (("gen", "right"), ("slot", "right"), ("step", "right"), ("counter", "right"),
                      ("verdict", "left"), ("arrays", "right"), ("problem", "left")):
        t.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
    for c in r.checks:
        mark = " (latest)" if r.latest is not None and (c.generation, c.slot) == (r.latest.generation, r.latest.slot) else ""
        verdict = {"ok": "[green]ok[/]", "bad": "[bold red]BAD[/]"}.get(c.verdict, c.verdict) + mark
        t.add_row(str(c.generation), str(c.slot), _text(c.step), _text(c.counter), verdict, _text(c.arrays),
                  c.problem or "")
    con.print(t)
    for g, p in r.generation_problems:
        con.print(f"generation {g}: [bold red]unreadable[/]: {p}")
    colour = ("green", "yellow", "red")[r.exit_code]
    con.print(f"[bold {colour}]{_verdict_line(r)}[/]")


# -- inspect --------------------------------------------------------------------------------------


def _descr(dtype: np.dtype) -> Any:
    return np.lib.format.dtype_to_descr(dtype)


@app.command("inspect")
def inspect_cmd(path: PathArg = None, step: StepOpt = None, as_json: JsonOpt = False) -> None:
    """Show a checkpoint's arrays: name, dtype, shape and bytes.

    Reads only the manifest (checked against its crc32c); `pccheck verify` checks the array data.
    """
    def run() -> None:
        url = remote_url(path)
        if url is not None:  # the remote tier: rank 0's manifest of the step (FORMAT.md §12.2)
            from ..tiers.remote.inventory import manifest_of

            generation, _, man = manifest_of(url, step)
            slot, where = 0, url
        else:
            loc = locate(path, step)
            man, generation, slot, where = loc.manifest, loc.generation, loc.slot, str(loc.image.path)
        arrays = [{"name": e.name, "dtype": _descr(e.dtype), "torch_dtype": getattr(e, "torch_dtype", None),
                   "shape": list(e.shape), "nbytes": e.nbytes, "offset": e.offset, "crc32c": f"{crc:08x}",
                   # an incremental checkpoint: the slot whose cell holds the bytes (FORMAT.md §14)
                   **({"cell": man.cells.cells[i]} if getattr(man, "cells", None) is not None else {})}
                  for i, (e, crc) in enumerate(zip(man.arrays, man.crcs))]
        if as_json:
            _emit_json({"step": man.step, "counter": man.counter, "generation": generation, "slot": slot,
                        "path": where, "data_bytes": man.data_len, "metadata": man.metadata, "arrays": arrays})
            return
        con = _out()
        con.print(f"step {man.step}  counter {man.counter}  generation {generation}  slot {slot}  "
                  f"{len(arrays)} arrays  {_bytes(sum(a['nbytes'] for a in arrays))}")
        if man.metadata:
            meta = json.dumps(man.metadata, separators=(",", ":"))
            con.print(f"metadata: {meta if len(meta) <= 400 else meta[:400] + ' ...'}", markup=False)
        t = Table(show_edge=False, pad_edge=False)
        for col, just in (("name", "left"), ("dtype", "left"), ("shape", "left"), ("bytes", "right")):
            t.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
        for e, a in zip(man.arrays, arrays):
            dt = a["torch_dtype"] or str(e.dtype)
            t.add_row(e.name, dt, "(" + ", ".join(map(str, e.shape)) + ("," if len(e.shape) == 1 else "") + ")",
                      str(e.nbytes))
        con.print(t, markup=False)

    _guard(as_json, run)


# -- export ---------------------------------------------------------------------------------------


@app.command("export")
def export_cmd(out: Annotated[Path, typer.Option("--out", help="file to write (replaced atomically); with --format hf "
                                                 "the model directory")],
               path: PathArg = None, step: StepOpt = None,
               fmt: Annotated[ExportFormat, typer.Option("--format", help="file format to write")] = ExportFormat.safetensors,
               skip_unsupported: Annotated[bool, typer.Option(
                   "--skip-unsupported", help="leave out arrays the format cannot hold instead of failing")] = False,
               dtype: Annotated[ExportDtype, typer.Option(
                   "--dtype", help="--format hf: floating tensors as saved (keep), bf16 or fp32")] = ExportDtype.keep,
               max_shard_size: Annotated[str, typer.Option(
                   "--max-shard-size", help="--format hf: the largest safetensors shard (5GB, 500MiB, bytes)")] = "5GB",
               config: Annotated[Optional[Path], typer.Option(
                   "--config", help="--format hf: the model's config.json, copied into the directory",
                   show_default=False)] = None,
               as_json: JsonOpt = False) -> None:
    """Write a checkpoint's arrays as a safetensors file or a torch state dict, or (--format hf)
    its model weights as a Hugging Face model directory that from_pretrained loads.

    safetensors/torch: the checkpoint is fully verified first; a torch file loads with
    torch.load(weights_only=True). hf: every store kind (one process, DDP, FSDP2/DTensor shards
    consolidated, a memory tier's directory, s3://); only the model, under its state_dict names,
    in model.safetensors or model-0000x-of-0000n.safetensors + model.safetensors.index.json; each
    byte checked against its crc32c before it is written.
    """
    def run() -> None:
        if fmt is ExportFormat.hf:
            _export_hf(out, path, step, dtype.value, max_shard_size, config, as_json)
            return
        if dtype is not ExportDtype.keep or config is not None or max_shard_size != "5GB":
            raise ConfigError("--dtype, --max-shard-size and --config belong to --format hf")
        url = remote_url(path)
        if url is not None:
            from ..tiers.remote.inventory import load_step

            r = load_step(url, step)
        else:
            r = load(path, step)
        skipped = export_checkpoint(r, out, fmt.value, skip_unsupported=skip_unsupported)
        written = [n for n in r.state if n not in skipped]
        nbytes = sum(int(r.state[n].nbytes) for n in written)
        if as_json:
            _emit_json({"out": str(out), "format": fmt.value, "step": r.step, "counter": r.counter,
                        "generation": r.generation, "slot": r.slot, "arrays": len(written), "bytes": nbytes,
                        "skipped": skipped})
            return
        con = _out()
        con.print(f"wrote {out} ({fmt.value}): {len(written)} arrays, {_bytes(nbytes)} from step {r.step} "
                  f"(counter {r.counter}, generation {r.generation}, slot {r.slot})", markup=False)
        if skipped:
            con.print(f"left out (dtype not supported by {fmt.value}): {', '.join(skipped)}", markup=False)

    _guard(as_json, run)


def _export_hf(out: Path, path: Path | None, step: int | None, dtype: str, max_shard_size: str,
               config: Path | None, as_json: bool) -> None:
    from ..ops.hf_export import export_hf

    src: Any = remote_url(path) or path
    r = export_hf(src, out, step=step, dtype=dtype, max_shard_size=max_shard_size, config=config)
    if as_json:
        _emit_json({"out": str(r.out), "format": "hf", "step": r.step, "files": list(r.files), "tensors": r.tensors,
                    "bytes": r.bytes, "bytes_read": r.bytes_read, "dtype": r.dtype, "seconds": r.seconds,
                    "peak_rss": r.peak_rss})
        return
    _out().print(f"wrote {r.out} (hf, dtype {r.dtype}): {r.tensors} tensors, {_bytes(r.bytes)} in "
                 f"{len(r.files)} file(s) from step {r.step} in {r.seconds:.2f} s; peak RSS {_bytes(r.peak_rss)}",
                 markup=False)
    if config is None:
        _out().print(f"from_pretrained also needs the model's config.json in {r.out} (--config copies one)",
                     markup=False)


# -- transparent mode (CRIU) ---------------------------------------------------------------------------

EveryOpt = Annotated[Optional[float], typer.Option("--every", help="seconds between dumps (default: only the "
                                                   "final dump at SIGTERM)", show_default=False)]
StorePathOpt = Annotated[Optional[Path], typer.Option("--path", help="store directory (default: $PCCHECK_DIR or "
                                                      "./checkpoints)", show_default=False)]
MaxConcurrentOpt = Annotated[int, typer.Option("--max-concurrent", help="dumps persisting at once")]
WhenBusyOpt = Annotated[str, typer.Option("--when-busy", help="when N dumps persist: block or skip")]


def _usage(msg: str) -> None:
    Console(stderr=True, highlight=False).print(f"usage error: {msg}", markup=False)
    raise typer.Exit(2)


def _supervise(make: Callable[[], Any]) -> None:
    """Runs a Supervisor to the end: SIGTERM or SIGINT (a preemption notice) makes one final
    dump, commits it and stops the process; the process's exit code becomes ours."""
    import signal
    import threading

    err = Console(stderr=True, highlight=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        sup = make()
    except PCCheckError as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from None
    try:
        code = None
        while code is None:
            if stop.is_set():
                err.print("pccheck: stopping: a final dump, then the process", markup=False)
                code = sup.stop(final_dump=True)
                break
            code = sup.wait(0.2)
    except PCCheckError as exc:  # e.g. the writers failed: stop the process, keep the last image
        err.print(f"error: {exc}", markup=False)
        sup.stop(final_dump=False)
        code = 2
    finally:
        sup.close()
    for e in sup.errors:
        err.print(f"pccheck: a dump failed (the last committed image stayed): {e}", markup=False)
    done = [d for d in sup.stats() if d.outcome == "committed"]
    if done:
        last = done[-1]
        err.print(f"pccheck: {len(done)} image(s) committed, the last of step {last.step}: {_bytes(last.image_bytes)}, "
                  f"process frozen {last.freeze_s:.3f} s", markup=False)
    raise typer.Exit(code if code is not None and code >= 0 else 128 + abs(code or 0))


@app.command("run", context_settings={"allow_interspersed_args": False})
def run_cmd(cmd: Annotated[Optional[list[str]], typer.Argument(help="after --: the command to run and checkpoint",
                                                               show_default=False)] = None,
            every: EveryOpt = None, path: StorePathOpt = None, max_concurrent: MaxConcurrentOpt = 2,
            when_busy: WhenBusyOpt = "block") -> None:
    """Run a command and checkpoint the whole process with CRIU (transparent mode, needs root).

    Each dump freezes the process while CRIU writes it to tmpfs; pccheck persists and commits the
    image in the background. The command's output goes to PATH/output.log and to stdout. SIGTERM:
    one final dump, then the process is stopped. Exit status: the command's.
    """
    if not cmd:
        _usage("give the command to run after --, e.g. pccheck run --every 30 -- python train.py")
    if every is not None and not every > 0:
        _usage(f"--every must be a positive number of seconds, got {every}")
    if when_busy not in ("block", "skip"):
        _usage(f"--when-busy takes block or skip, got {when_busy!r}")
    from ..persist.files import default_path
    from ..transparent.supervisor import Supervisor

    _supervise(lambda: Supervisor.start(cmd, path or default_path(), every=every, max_concurrent=max_concurrent,
                                        when_busy=when_busy, forward=True))


@app.command("resume")
def resume_cmd(path: StorePathOpt = None, every: EveryOpt = None, max_concurrent: MaxConcurrentOpt = 2,
               when_busy: WhenBusyOpt = "block") -> None:
    """Restore the newest valid CRIU image at PATH (every crc checked; a damaged newest falls back
    to an older one) and go on supervising it as `pccheck run` did."""
    if every is not None and not every > 0:
        _usage(f"--every must be a positive number of seconds, got {every}")
    if when_busy not in ("block", "skip"):
        _usage(f"--when-busy takes block or skip, got {when_busy!r}")
    from ..persist.files import default_path
    from ..transparent.supervisor import Supervisor

    _supervise(lambda: Supervisor.resume(path or default_path(), every=every, max_concurrent=max_concurrent,
                                         when_busy=when_busy, forward=True))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"pccheck {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print the version and exit")] = False) -> None:
    """Inspect, verify and export pccheck checkpoint stores."""


def main() -> None:
    """Entry point of the ``pccheck`` script."""
    # Recovery logs why it skips a damaged slot; show that on stderr, stdout stays clean for --json.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
    app(prog_name="pccheck")  # the same name in the help whether run as `pccheck` or `python -m pccheck`


if __name__ == "__main__":
    main()
