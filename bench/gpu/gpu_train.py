"""The training side of ``python -m bench.gpu``: the GPT it trains and the checkpointing systems
compared in its loop (none, pccheck, DCP ``async_save``, ``torch.save``). The method is described
in bench/gpu/gpu.py's docstring; how each system saves is :mod:`bench.harness.systems`'s."""

import shutil
import time
from pathlib import Path
from typing import Any

from bench.harness.common import median_or_none as _med
from bench.harness.systems import dcp_async_save, dcp_upload, dcp_writer, quiet_dcp_warnings, torch_save_durable

__all__ = ["VOCAB", "D_MODEL", "N_HEAD", "SEQ", "BATCH", "CHUNK", "Trainer", "System", "PCCheck", "DCPAsync",
           "TorchSave", "engine_info"]

_GIB = 1 << 30
CHUNK = 64 << 20  # pccheck's chunk_size in the training runs
VOCAB, D_MODEL, N_HEAD, SEQ, BATCH = 32768, 1536, 12, 1024, 8


def engine_info(ck: Any) -> dict[str, Any]:
    """The Checkpointer's copy engine: its name and whether its chunk pool is pinned."""
    eng = ck.copy_engine
    return {"name": getattr(eng, "name", None), "pinned": getattr(eng, "pinned", None)}


class Trainer:
    """The GPT, its optimizer, ``train(step)`` (one iteration) and the next step number."""

    def __init__(self, state_gib: float, accum: int = 1) -> None:
        self.accum = accum
        import torch
        import torch.nn.functional as F
        from torch import nn

        class GPT(nn.Module):
            def __init__(self, n_layer: int, d: int = D_MODEL) -> None:
                super().__init__()
                self.tok, self.pos, self.ln_f = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d), nn.LayerNorm(d)
                self.blocks = nn.ModuleList(nn.ModuleDict({
                    "ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d),
                    "ln2": nn.LayerNorm(d), "fc": nn.Linear(d, 4 * d), "out": nn.Linear(4 * d, d)}) for _ in range(n_layer))
                nn.init.normal_(self.tok.weight, std=0.02)

            def forward(self, idx: Any) -> Any:  # pre-LN blocks: causal attention, then a 4x GELU MLP
                b, t = idx.shape
                x = self.tok(idx) + self.pos.weight[:t]
                for m in self.blocks:
                    q, k, v = (z.view(b, t, N_HEAD, -1).transpose(1, 2) for z in m["qkv"](m["ln1"](x)).split(D_MODEL, 2))
                    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
                    x = x + m["proj"](y)
                    x = x + m["out"](F.gelu(m["fc"](m["ln2"](x))))
                return F.linear(self.ln_f(x), self.tok.weight)  # lm head tied to the token embedding

        fixed = VOCAB * D_MODEL + SEQ * D_MODEL + 2 * D_MODEL  # embeddings, final LN; a layer: 12 d^2 + 13 d
        self.n_layer = max(1, -int(-(state_gib * _GIB / 12 - fixed) // (12 * D_MODEL**2 + 13 * D_MODEL)))
        with torch.device("cuda"):  # built on the GPU: no multi-second CPU initialisation
            self.model = GPT(self.n_layer)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        toks = torch.randint(0, VOCAB, (4, BATCH, SEQ + 1), generator=torch.Generator("cuda").manual_seed(0), device="cuda")
        self.batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks]
        self.stream, self.step, self._torch, self._F = torch.cuda.current_stream(), 0, torch, F

    def train(self, step: int) -> None:
        """One iteration. ``self.last``: where its time went, as (launch_s: the CPU queuing the work,
        opt_s: of which ``opt.step()``, sync_s: waiting for the GPU after that, gpu_s: the training
        stream's own time between two events at its start and end), read by ``timings()``."""
        cuda, perf = self._torch.cuda, time.perf_counter
        ev0, ev1 = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        t0 = perf()
        ev0.record(self.stream)
        self.opt.zero_grad(set_to_none=True)
        for j in range(self.accum):  # gradient accumulation: accum micro-batches per optimizer step
            x, y = self.batches[(step * self.accum + j) % len(self.batches)]
            with self._torch.autocast("cuda", dtype=self._torch.bfloat16):
                loss = self._F.cross_entropy(self.model(x).view(-1, VOCAB), y.view(-1))
            (loss / self.accum).backward()
        t1 = perf()
        self.opt.step()
        ev1.record(self.stream)
        t2 = perf()
        self.stream.synchronize()  # the training stream only: see the module docstring
        self.last = (t2 - t0, t2 - t1, perf() - t2, ev0, ev1)

    def timings(self) -> dict[str, float]:
        """The last iteration's breakdown (see ``train``), its events read once it is done."""
        launch, opt, sync, ev0, ev1 = self.last
        return {"launch_s": launch, "opt_s": opt, "sync_s": sync, "gpu_s": ev0.elapsed_time(ev1) / 1e3}

    def state_dict(self) -> dict[str, Any]:
        # Plain dicts and lists: DCP's DefaultStager (torch 2.11) fails on any value it must rebuild
        # through __reduce_ex__ (KeyError: <class 'type'>): the OrderedDict that state_dict() returns
        # and AdamW's betas tuple. The bytes saved are the same.
        osd = self.opt.state_dict()
        groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in osd["param_groups"]]
        return {"model": dict(self.model.state_dict()), "optim": {"state": osd["state"], "param_groups": groups}}

class System:
    """A checkpointing system in the loop (this base: ``none``). Call order: ``warmup(tr)``; per window
    ``interval`` set, ``call(step)`` after each iteration, ``drain()``, ``details(lo, hi)``; ``close()``.
    With a ``_save(step)`` it saves every ``interval`` steps; ``stalls[step]``: what that save blocked."""

    name, _save, interval = "none", None, 10

    def __init__(self) -> None:
        self.stalls: dict[int, float] = {}

    def warmup(self, tr: Trainer) -> None:
        if self._save is not None:
            tr.train(tr.step)
            self._save(tr.step)
            self.drain()
            tr.step += 1

    def call(self, step: int) -> bool:
        if self._save is None or step % self.interval:
            return False
        self._save(step)
        return True

    def drain(self) -> None:
        pass

    def details(self, lo: int, hi: int) -> dict[str, Any]:
        stalls = [v for s, v in self.stalls.items() if lo <= s < hi]
        return {} if self._save is None else {"median_stall_s": _med(stalls), "stall_s": stalls}

    close = drain

class PCCheck(System):
    """pccheck N = 2 to the disk; ``reserve``: with device_reserve="auto"; ``memory``: also the memory
    tier every iteration (``memory_interval=1``, a tmpfs store under ``memory``); ``remote``: also the
    remote tier (an ``s3://`` URL), every disk checkpoint queued for upload (``remote_every=1``)."""

    def __init__(self, tr: Trainer, path: Path, reserve: bool, memory: Path | None = None,
                 remote: str | None = None) -> None:
        import pccheck
        super().__init__()
        self.name = ("pccheck_reserve" if reserve else "pccheck_memory" if memory
                     else "pccheck_remote" if remote else "pccheck_N2")
        extra: dict[str, Any] = {"device_reserve": "auto"} if reserve else {}
        if memory is not None:
            extra.update(memory_interval=1, memory_dir=memory)
        if remote is not None:
            extra.update(remote=remote, remote_every=1, remote_keep_last=2)
        self.ck = pccheck.Checkpointer(tr.model, tr.opt, path=path, interval=self.interval, max_concurrent=2,
                                       writer_threads=4, chunk_size=CHUNK, **extra)

    def warmup(self, tr: Trainer) -> None:
        for _ in range(3):  # N+1 back to back: every slot written once; no timed write meets an unwritten extent
            tr.train(tr.step)
            if not self.ck.checkpoint(tr.step):
                raise RuntimeError(f"{self.name}: warm-up checkpoint of step {tr.step} was skipped")
            tr.step += 1
        self.ck.wait()
        if self.ck._memory is not None:  # memory checkpoints alone: each slot written (and registered) once
            self.ck.interval = 10**9
            for _ in range(3):
                tr.train(tr.step)
                self.ck.maybe_checkpoint(tr.step)
                tr.step += 1
            self.ck.wait()

    def call(self, step: int) -> bool:
        self.ck.interval = self.interval  # maybe_checkpoint reads it (no online tuner with an int interval)
        return self.ck.maybe_checkpoint(step)

    def drain(self) -> None:
        self.ck.wait()

    def details(self, lo: int, hi: int) -> dict[str, Any]:
        d = self.ck.stats().as_dict()
        win = [c for c in d["checkpoints"] if lo <= c["step"] < hi and c["outcome"] != "failed"]
        stalls = [c["stall_s"] + c["prepare_s"] + c["blocked_copy_s"] + c["cow_wait_s"] for c in win]
        return {"median_stall_s": _med(stalls), "stall_s": stalls, "reserve_bytes": [c.get("reserve_bytes") for c in win],
                **{f"median_{k}": _med([c[k] for c in win]) for k in ("cow_wait_s", "copy_s", "persist_s")},
                "checkpoints_in_window": win, "summary": d["summary"], "copy_engine": engine_info(self.ck),
                "tiers": d.get("tiers"), **self._memory_timings(lo, hi)}  # summary: the remote tier's figures

    def _memory_timings(self, lo: int, hi: int) -> dict[str, Any]:
        """The memory tier's checkpoints in the window: copy, back-pressure and persist seconds."""
        recent = [c for c in getattr(self.ck._memory, "recent", ()) if lo <= c.step < hi]
        if not recent:
            return {}
        keys = ("copy_s", "backpressure_s", "persist_s", "stall_s", "prepare_s", "blocked_copy_s", "cow_wait_s",
                "slot_wait_s", "copied_s", "nbytes")  # where a memory checkpoint's call and the next step wait
        return {"memory_tier": {"writer_threads": self.ck._memory._engine.writer_threads, "count": len(recent),
                                **{f"median_{k}": _med([getattr(c, k) for c in recent]) for k in keys},
                                "gbps": [c.gbps for c in recent]}}

    def close(self) -> None:
        self.ck.close(remote_timeout=30)  # the remote tier's last upload: not what the window measures

class DCPAsync(System):
    """DCP ``async_save``: ``pinned`` with a DefaultStager(pinned, async, non-blocking), else DCP's
    default staging; ``best``: DCP's "zero-overhead" set-up (torch >= 2.9): DefaultStager(pinned,
    shared memory, async, non-blocking) and the save in DCP's own checkpoint process
    (``AsyncCheckpointerType.PROCESS``, a one-rank gloo group on 127.0.0.1), the stager kept across
    saves where the installed torch allows it (else one per save, recorded in ``staging``)."""

    name, _upload, _staged = "dcp_async", None, None  # futures of the save in flight

    def __init__(self, tr: Trainer, path: Path, pinned: bool, best: bool = False) -> None:
        super().__init__()
        quiet_dcp_warnings()
        self.tr, self.dir, self.stager, self._last, self._dirs = tr, path, None, -1, []
        self.staging = "DefaultStager(pinned, not shared, async, non-blocking)" if pinned else "DCP's default"
        self.pinned, self.best, self.reuse = pinned or best, best, best
        if best:
            self.name = "dcp_best"
            self.staging = "DefaultStager(pinned, shared, async, non-blocking), PROCESS checkpointer"
            _one_rank_group()
        self._hook = tr.opt.register_step_pre_hook(self._before_step)

    def warmup(self, tr: Trainer) -> None:
        super().warmup(tr)
        if self.best:  # a second save through the same stager: kept if the installed torch allows it
            try:
                super().warmup(tr)
            except KeyError as exc:
                self.reuse = False
                self.staging += f"; a new stager per save (reusing one failed: KeyError {exc})"
                self._staged = self._upload = None
                super().warmup(tr)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._staged is not None:  # the update must not overwrite what is being staged
            t0 = time.perf_counter()
            self._staged.result()
            self._staged = None
            self.stalls[self._last] = self.stalls.get(self._last, 0.0) + time.perf_counter() - t0

    def _save(self, step: int) -> None:
        t0 = time.perf_counter()
        self.drain()  # at most one in flight, as users write it
        self._dirs.append(self.dir / f"step-{step}")
        if self.pinned and not (self.reuse and self.stager is not None):
            # A new stager per save (dcp_async, or dcp_best where reuse failed): torch 2.11's
            # DefaultStager closes its StateDictStager after each stage, which drops the pinned cache
            # and clears the deepcopy dispatch table, so a second stage() of any dict raises
            # "KeyError: <class 'type'>" (the first GPU run's error).
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            if self.stager is not None:
                self.stager.close()
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=self.best,
                                                       use_async_staging=True, use_non_blocking_copy=True))
        resp = dcp_async_save(self.tr.state_dict(), dcp_writer(self._dirs[-1]), self.stager, process=self.best)
        self._upload = dcp_upload(resp)
        self._staged, self._last = getattr(resp, "staging_completion", None), step
        self.stalls[step] = time.perf_counter() - t0

    def drain(self) -> None:
        for fut in (self._staged, self._upload):
            if fut is not None:
                fut.result()
        self._staged = self._upload = None
        while len(self._dirs) > 1:  # the newest completed checkpoint stays
            shutil.rmtree(self._dirs.pop(0), ignore_errors=True)

    def details(self, lo: int, hi: int) -> dict[str, Any]:
        return {**super().details(lo, hi), "staging": self.staging}

    def close(self) -> None:
        self._hook.remove()
        self.drain()
        if self.stager is not None:
            self.stager.close()  # its thread pool and any cached pinned copy

def _one_rank_group() -> None:
    """The default process group DCP's checkpoint process needs: one gloo rank on 127.0.0.1."""
    import os
    import socket

    import torch.distributed as dist
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's process rendezvous address, else the host's name
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


class TorchSave(System):
    name = "torch_save"

    def __init__(self, tr: Trainer, path: Path) -> None:
        super().__init__()
        self.tr, self.dir, self._prev = tr, path, None
        path.mkdir(parents=True, exist_ok=True)

    def _save(self, step: int) -> None:
        t0, path = time.perf_counter(), self.dir / f"ckpt-{step}.pt"
        torch_save_durable(self.tr.state_dict(), path)
        if self._prev is not None:  # the newest durable checkpoint stays
            self._prev.unlink()
        self._prev, self.stalls[step] = path, time.perf_counter() - t0
