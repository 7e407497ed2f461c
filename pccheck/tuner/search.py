"""The search of §3.4: from measurements and constraints to N*, p*, b and f*.

* p* and b: the writer-thread count and chunk size with the best T_S, where "best" means within
  ``tol`` (5%) of the fastest measured, preferring pccheck's defaults (2 threads, 64 MiB) and then
  fewer threads / smaller chunks: on a noisy machine the tuner leaves a default alone unless the
  evidence is clear.
* N* and f* (objective "overhead", the paper's): for each N measured, the smallest interval whose
  expected slowdown stays within q (:func:`~pccheck.tuner.model.min_interval`: eq. (3), plus the
  blocked-copy term where the copy blocks training); N* is the N with the smallest such f, then the
  smaller N (less storage). With no blocked time this is the paper's argmin T_w/N.
* With a failure rate (objective "goodput"): the (N, f) that minimises the wasted fraction
  (:func:`~pccheck.tuner.model.waste_fraction`, Young/Daly generalised to N in flight); q is then
  only reported, not enforced.
* ``spread_steps`` (GoCkpt mode, for ``Checkpointer(spread_steps="auto")``): the k of
  :func:`pccheck.spread.plan.auto_steps` from the copy bandwidth T_G, the iteration time less the
  measured update, the update itself, the state and its gradients (default m/3: fp32 parameters
  with Adam's two moments), within the DRAM budget (:func:`pccheck.spread.plan.split_budget`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import ConfigError
from ..spread.plan import auto_steps, modelled_stall, split_budget
from . import model
from .samples import Profile, StorageSample, WriteTimeSample

__all__ = ["Constraints", "Choice", "choose", "pick_storage", "DEFAULT_TOL", "DEFAULT_THREADS_CHOICE",
           "DEFAULT_CHUNK_CHOICE"]

DEFAULT_TOL = 0.05
DEFAULT_THREADS_CHOICE = 2          # pccheck's default writer_threads
DEFAULT_CHUNK_CHOICE = 64 << 20     # pccheck's default chunk_size


@dataclass(frozen=True)
class Constraints:
    """The user's side of Table 2. Bytes, seconds, failures per hour."""

    state_bytes: int                 # m
    iter_time: float                 # t, seconds per iteration without checkpointing
    max_overhead: float = 1.03       # q >= 1
    dram_budget: int | None = None   # M (default 2 m)
    storage_budget: int | None = None  # S
    failure_rate: float | None = None  # failures per hour; switches the objective to goodput
    load_s: float | None = None      # l for eq. (4); default: m / the best T_S (an estimate)
    grad_bytes: int | None = None    # gradient bytes per step, for spread_steps (default m // 3)

    def __post_init__(self) -> None:
        if self.state_bytes <= 0:
            raise ConfigError(f"the state size must be > 0 bytes, got {self.state_bytes}")
        if not self.iter_time > 0:
            raise ConfigError(f"the iteration time must be > 0 seconds, got {self.iter_time}")
        if not self.max_overhead >= 1:
            raise ConfigError(f"the maximum overhead q is a slowdown factor >= 1 (1.03 = 3%), got {self.max_overhead}")
        if self.failure_rate is not None and not self.failure_rate > 0:
            raise ConfigError(f"the failure rate must be > 0 failures per hour, got {self.failure_rate}")
        if self.load_s is not None and not self.load_s >= 0:
            raise ConfigError(f"the load time must be >= 0 seconds, got {self.load_s}")
        if self.grad_bytes is not None and not self.grad_bytes > 0:
            raise ConfigError(f"the gradient size must be > 0 bytes, got {self.grad_bytes}")


@dataclass(frozen=True)
class Choice:
    """What the tuner chose, with the numbers it chose from (bytes, seconds)."""

    objective: str                   # "overhead" (max slowdown q) or "goodput" (failure rate)
    max_concurrent: int              # N*
    writer_threads: int              # p*
    chunk_size: int                  # b
    chunks: int                      # c = M / b
    interval: int                    # f*
    interval_eq3: int                # eq. (3) alone: ceil(T_w / (N* q t))
    interval_blocked: int            # ceil(B / ((q-1) t)), the blocked-copy term (0 if B = 0)
    iter_time: float                 # t
    tw_s: float                      # T_w at N*
    blocked_s: float                 # B at N* (the largest median measured at N <= N*)
    copy_bytes_per_s: float          # T_G at b
    storage_bytes_per_s: float       # T_S at (p*, b)
    expected_slowdown: float
    recovery_bound_s: float          # eq. (4)
    load_s: float
    load_estimated: bool
    storage_bytes: int               # (N*+1) m
    dram_bytes: int                  # c * b
    max_overhead: float              # q
    failure_rate: float | None = None        # per hour
    young_daly_interval: float | None = None  # GoCkpt's N* with T_ckpt = B (goodput objective)
    waste_fraction: float | None = None
    goodput: float | None = None             # useful fraction of the time, 1 / (1 + P)
    paper_n: int | None = None               # argmin T_w / N (the paper's N*, without B)
    spread_steps: int = 1                    # k for spread_steps="auto" (GoCkpt mode)
    grad_bytes: int = 0                      # the gradient bytes per step k was chosen for
    whole_stall_s: float = 0.0               # modelled stall per checkpoint copied in one step
    spread_stall_s: float = 0.0              # modelled stall per checkpoint spread over k steps
    notes: tuple[str, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d


def pick_storage(samples: Sequence[StorageSample], tol: float = DEFAULT_TOL) -> tuple[int, int]:
    """(writer threads p*, chunk size b) from T_S samples: the thread count first (over all
    samples), then the chunk size among samples with p*; each within ``tol`` of the best,
    preferring pccheck's default, then the smaller value."""
    if not samples:
        raise ConfigError("no storage bandwidth samples to choose from")
    p = _pick(samples, lambda s: s.writer_threads, DEFAULT_THREADS_CHOICE, tol)
    mine = [s for s in samples if s.writer_threads == p]
    b = _pick(mine, lambda s: s.chunk_size, DEFAULT_CHUNK_CHOICE, tol)
    return p, b


def _pick(samples: Sequence[StorageSample], key: Callable[[Any], int], prefer: int, tol: float) -> int:
    best = max(s.bytes_per_s for s in samples)
    ok = sorted({key(s) for s in samples if s.bytes_per_s >= best * (1.0 - tol)})
    return prefer if prefer in ok else ok[0]


def _effective_chunk(chunk: int, state_bytes: int, dram_budget: int) -> int:
    block = 4096
    state = max(block, (state_bytes + block - 1) // block * block)
    return max(block, min(chunk // block * block, state, dram_budget // block * block))


def choose(profile: Profile, c: Constraints, tol: float = DEFAULT_TOL) -> Choice:
    """Picks N*, p*, b and f* from ``profile`` under the constraints ``c``."""
    if not profile.write:
        raise ConfigError("the profile has no T_w measurement; profile at least N = 1")
    m, t, q = c.state_bytes, c.iter_time, c.max_overhead
    dram = c.dram_budget if c.dram_budget is not None else 2 * m
    p, b = pick_storage(profile.storage, tol)
    ts = max(s.bytes_per_s for s in profile.storage if s.writer_threads == p and s.chunk_size == b)
    tg_by_chunk = {s.chunk_size: s.bytes_per_s for s in profile.copy}
    tg = tg_by_chunk.get(b) or (max(tg_by_chunk.values()) if tg_by_chunk else 0.0)
    best_ts = max(s.bytes_per_s for s in profile.storage)
    load_s, load_est = (c.load_s, False) if c.load_s is not None else (m / best_ts, True)
    writes = _affordable_writes(profile.write, c)
    paper_n = min(writes, key=lambda w: (w.tw_per_n, w.n)).n
    blocked = _blocked_by_n(profile, writes)
    notes: list[str] = []
    if c.failure_rate is None:
        pick = _pick_overhead(writes, blocked, q, t, notes)
    else:
        pick = _pick_goodput(writes, blocked, c, load_s, notes)
    w, f = pick.write, pick.interval
    eq3 = model.interval_eq3(w.tw_s, w.n, q, t)
    b_star = blocked[w.n]
    fb = model.min_interval(0.0, 1, q, t, b_star) if (b_star > 0 and q > 1) else 0
    notes += _why_notes(pick, paper_n, eq3, fb, b_star)
    g = c.grad_bytes if c.grad_bytes is not None else max(1, m // 3)
    k, whole, spread = _pick_spread(m, g, tg, t, profile.update_s, dram)
    chunk_eff = _effective_chunk(b, m, dram)
    count = max(1, dram // chunk_eff)
    return Choice(
        objective=pick.objective,
        max_concurrent=w.n,
        writer_threads=p,
        chunk_size=b,
        chunks=count,
        interval=f,
        interval_eq3=eq3,
        interval_blocked=fb,
        iter_time=t,
        tw_s=w.tw_s,
        blocked_s=b_star,
        copy_bytes_per_s=tg,
        storage_bytes_per_s=ts,
        expected_slowdown=model.expected_slowdown(f, t, w.tw_s, w.n, b_star),
        recovery_bound_s=model.recovery_bound(f, t, w.tw_s, w.n, load_s),
        load_s=load_s,
        load_estimated=load_est,
        storage_bytes=(w.n + 1) * m,
        dram_bytes=count * chunk_eff,
        max_overhead=q,
        failure_rate=c.failure_rate,
        young_daly_interval=pick.young_daly,
        waste_fraction=pick.waste,
        goodput=pick.goodput,
        paper_n=paper_n,
        spread_steps=k,
        grad_bytes=g,
        whole_stall_s=whole,
        spread_stall_s=spread,
        notes=tuple(notes),
    )


def _pick_spread(m: int, g: int, tg: float, t: float, update_s: float, dram: int) -> tuple[int, float, float]:
    """(k, modelled stall in one step, modelled stall over k steps) for GoCkpt mode: the copy of
    m bytes at T_G hides in the iteration less its update; the gradients ride beside the update."""
    if tg <= 0:
        return 1, 0.0, 0.0
    fwd_bwd = max(0.0, t - update_s)
    _, grad_budget = split_budget("auto", g, dram)
    k = auto_steps(m, g, tg, fwd_bwd, update_s, grad_budget)
    return k, modelled_stall(1, m, g, tg, fwd_bwd, update_s), modelled_stall(k, m, g, tg, fwd_bwd, update_s)


@dataclass(frozen=True)
class _Pick:
    """The N (its T_w sample) and interval one objective picked, with what that objective reports."""

    objective: str                   # "overhead" or "goodput"
    write: WriteTimeSample
    interval: int
    waste: float | None = None       # goodput objective only
    goodput: float | None = None
    young_daly: float | None = None


def _affordable_writes(writes: Sequence[WriteTimeSample], c: Constraints) -> Sequence[WriteTimeSample]:
    """The T_w samples whose N+1 slots fit the storage budget (the smallest N when none does)."""
    if c.storage_budget is None:
        return writes
    m = c.state_bytes
    return [w for w in writes if (w.n + 1) * m <= c.storage_budget] or [min(writes, key=lambda w: w.n)]


def _blocked_by_n(profile: Profile, writes: Sequence[WriteTimeSample]) -> dict[int, float]:
    """B(N) for every N of ``writes``, in seconds.

    B, what one checkpoint costs training apart from waiting for another: measured end to end
    with spaced checkpoints when the profile has it (profile.blocked), else from the T_w runs.
    It cannot shrink when more checkpoints may be in flight (more contention, never less), so
    B(N) is the largest value measured at any N' <= N; a larger N wins only through eq. (3).
    """
    blocked: dict[int, float] = {}
    for w in sorted(writes, key=lambda w: w.n):
        own = profile.blocked.blocked_s if profile.blocked is not None else w.blocked_s
        blocked[w.n] = max([own] + [v for k, v in blocked.items() if k < w.n])
    return blocked


def _pick_overhead(writes: Sequence[WriteTimeSample], blocked: dict[int, float], q: float, t: float,
                   notes: list[str]) -> _Pick:
    """The paper's objective: the N with the smallest interval whose slowdown stays within q."""
    if q == 1.0 and any(blocked[w.n] > 0 for w in writes):
        notes.append("q = 1 allows no blocked copy at all; the blocked time is ignored (eq. (3) only)")

    def f_of(w: WriteTimeSample) -> int:
        if q == 1.0:
            return model.interval_eq3(w.tw_s, w.n, q, t)
        return model.min_interval(w.tw_s, w.n, q, t, blocked[w.n])

    w = min(writes, key=lambda w: (f_of(w), w.n))
    return _Pick("overhead", w, f_of(w))


def _pick_goodput(writes: Sequence[WriteTimeSample], blocked: dict[int, float], c: Constraints, load_s: float,
                  notes: list[str]) -> _Pick:
    """With a failure rate: the (N, f) that wastes the least time; q is only reported."""
    assert c.failure_rate is not None
    lam = c.failure_rate / 3600.0
    t = c.iter_time

    def f_of(w: WriteTimeSample) -> int:
        return model.goodput_interval(t, w.tw_s, w.n, lam, load_s, blocked[w.n])

    def waste_of(w: WriteTimeSample) -> float:
        return model.waste_fraction(f_of(w), t, w.tw_s, w.n, lam, load_s, blocked[w.n])

    w = min(writes, key=lambda w: (waste_of(w), w.n))
    f = f_of(w)
    b = blocked[w.n]
    yd = model.young_daly_interval(b, lam, t) if b > 0 else None  # GoCkpt's, with T_ckpt = B
    slow = model.expected_slowdown(f, t, w.tw_s, w.n, b)
    if slow > c.max_overhead:
        notes.append(f"goodput objective: expected slowdown {slow:.3f} exceeds q = {c.max_overhead:g} (not enforced)")
    waste = waste_of(w)
    return _Pick("goodput", w, f, waste=waste, goodput=1.0 / (1.0 + waste), young_daly=yd)


def _why_notes(pick: _Pick, paper_n: int, eq3: int, fb: int, b_star: float) -> list[str]:
    """Notes on what set the interval and why N* differs from the paper's argmin T_w/N."""
    notes = []
    if pick.objective == "overhead" and fb > eq3:
        notes.append(f"each checkpoint costs training {b_star * 1e3:.1f} ms: "
                     f"f >= B/((q-1) t) = {fb} sets the interval, not eq. (3) ({eq3})")
    if pick.write.n != paper_n:
        gain = "a smaller or equal interval" if pick.objective == "overhead" else "less or equal wasted time"
        notes.append(f"N = {paper_n} has the lowest T_w/N, but N = {pick.write.n} reaches {gain}")
    return notes
