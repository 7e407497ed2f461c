"""The cost model: PCcheck §3.4 (equations (1)-(4)) and the Young/Daly form of GoCkpt and PhoenixOS.

Pure functions, no I/O. Units are in every docstring; times are seconds unless a name says
otherwise, intervals are counted in training iterations.

Symbols (PCcheck Table 2):

    t    seconds per training iteration without checkpointing
    m    checkpoint size in bytes
    f    checkpoint interval in iterations (a checkpoint every f iterations)
    N    checkpoints in flight at once (max_concurrent)
    T_w  seconds to write one checkpoint, from the start of its copy until it is durable, when N
         are in flight (the worst case, maximum contention)
    q    the largest acceptable slowdown (runtime with checkpoints / runtime without), q >= 1
    A    iterations in the whole run
    l    seconds to load a checkpoint back (recovery)

One extension beyond the paper: ``blocked`` (B), the seconds per checkpoint during which training
itself cannot run because of the checkpoint (the copy it waits for: ``blocked_copy_s`` +
``cow_wait_s`` in :class:`pccheck.CheckpointStats`). The paper copies on a GPU copy engine that
overlaps compute, so B = 0 there and every function below reduces to the paper's formula. On a
host where the copy competes with training (CPU-only machines, or a copy longer than the forward +
backward pass), B > 0 and the interval must also satisfy ``f*t + B <= q*f*t``.
"""

from __future__ import annotations

import math

__all__ = [
    "runtime_0",
    "runtime_1",
    "runtime_2",
    "interval_eq3",
    "min_interval",
    "expected_slowdown",
    "recovery_bound",
    "young_daly_interval",
    "young_daly_overhead",
    "phoenixos_frequency",
    "waste_fraction",
    "goodput_interval",
    "expected_loss",
]

# ceil() of a quotient that is an integer up to rounding (0.3 / 0.1 = 2.9999999999999996 or
# 3.0000000000000004) must give that integer, not the next one.
_REL_EPS = 1e-9


def _ceil(x: float) -> int:
    return math.ceil(x * (1.0 - _REL_EPS)) if x > 0 else math.ceil(x)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def runtime_0(A: int, t: float) -> float:
    """Seconds to run ``A`` iterations of ``t`` seconds without checkpointing: ``A * t``."""
    return A * t


def runtime_1(A: int, f: int, t: float, tw: float) -> float:
    """§3.4, N = 1: seconds for ``A`` iterations with a checkpoint every ``f`` iterations, each
    taking ``tw`` seconds to become durable, one at a time, written beside training::

        runtime_1 = f*t + max(Tw, f*t) * (A/f - 1) + Tw
    """
    _require(f >= 1 and A >= f, "need 1 <= f <= A")
    return f * t + max(tw, f * t) * (A / f - 1) + tw


def runtime_2(A: int, f: int, t: float, tw: float, n: int) -> float:
    """§3.4, N >= 1 concurrent checkpoints (seconds)::

        runtime_2 = f*t + max(Tw, N*f*t) * (A/(f*N) - 1) + Tw

    With ``n = 1`` this is :func:`runtime_1`.
    """
    _require(n >= 1 and f >= 1 and A >= f * n, "need n >= 1, f >= 1 and A >= f*n")
    return f * t + max(tw, n * f * t) * (A / (f * n) - 1) + tw


def interval_eq3(tw: float, n: int, q: float, t: float) -> int:
    """Equation (3): the smallest interval (iterations) whose stall keeps the slowdown within q::

        f* = ceil(Tw / (N* * q * t))        (at least 1)

    ``tw`` and ``t`` in seconds, ``n`` checkpoints in flight, ``q >= 1`` the slowdown bound.
    """
    _require(tw >= 0 and t > 0 and n >= 1 and q >= 1, "need tw >= 0, t > 0, n >= 1 and q >= 1")
    return max(1, _ceil(tw / (n * q * t)))


def min_interval(tw: float, n: int, q: float, t: float, blocked: float = 0.0) -> int:
    """The smallest interval f (iterations) with :func:`expected_slowdown` <= q.

    ``max(eq. (3), ceil(B / ((q - 1) * t)))``: eq. (3) bounds the stall when N checkpoints are in
    flight (``Tw / N <= q*f*t``); the second term bounds the time training is blocked per
    checkpoint (``f*t + B <= q*f*t``). With ``blocked = 0`` (a GPU copy engine, as in the paper)
    this is exactly eq. (3). Raises ValueError when ``q = 1`` and ``blocked > 0`` (no interval
    can keep a blocking checkpoint free).
    """
    f = interval_eq3(tw, n, q, t)
    _require(blocked >= 0, "need blocked >= 0")
    if blocked > 0:
        _require(q > 1, "with a blocking copy (blocked > 0) the slowdown bound q must be > 1")
        f = max(f, _ceil(blocked / ((q - 1) * t)))
    return f


def expected_slowdown(f: int, t: float, tw: float, n: int, blocked: float = 0.0) -> float:
    """Runtime with checkpoints / runtime without, in steady state (A large; eq. (1) without its
    ``f*t`` term)::

        max(f*t + B, Tw/N) / (f*t)

    Each checkpoint period lasts the f iterations plus the blocked time B, unless N checkpoints
    of ``Tw`` seconds each are still in flight, in which case training stalls until one
    finishes (one period per ``Tw/N``). With ``blocked = 0`` this is ``max(1, Tw/(N*f*t))``,
    i.e. runtime_2 / runtime_0 for large A.
    """
    _require(f >= 1 and t > 0 and n >= 1 and tw >= 0 and blocked >= 0, "need f, t, n >= 1 and tw, blocked >= 0")
    return max(f * t + blocked, tw / n) / (f * t)


def recovery_bound(f: int, t: float, tw: float, n: int, load_s: float = 0.0) -> float:
    """Equation (4): the worst-case recovery time in seconds (load plus recomputation)::

        recovery <= l + f*t + t * min(N*f, Tw/t)

    ``load_s`` (l) is the time to load the checkpoint back. CheckFreq/Gemini's bound, for
    comparison, is ``l + 2*f*t``; a stalling checkpointer's (GPM) ``l + f*t``.
    """
    _require(f >= 1 and t > 0 and n >= 1 and tw >= 0 and load_s >= 0, "need f, t, n >= 1 and tw, load_s >= 0")
    return load_s + f * t + t * min(n * f, tw / t)


def young_daly_interval(ckpt_s: float, failure_rate: float, step_s: float) -> float:
    """GoCkpt §3 (Young/Daly): the interval in iterations that minimises the wasted fraction::

        N* = sqrt(2 * T_ckpt / (p * T_step**2))

    ``ckpt_s`` (T_ckpt): seconds training is blocked per checkpoint; ``failure_rate`` (p):
    failures per second (1 / MTBF); ``step_s`` (T_step): seconds per iteration. Not rounded.
    """
    _require(ckpt_s > 0 and failure_rate > 0 and step_s > 0, "need ckpt_s, failure_rate and step_s > 0")
    return math.sqrt(2.0 * ckpt_s / (failure_rate * step_s * step_s))


def young_daly_overhead(ckpt_s: float, failure_rate: float, load_s: float = 0.0) -> float:
    """GoCkpt: the minimal wasted-time ratio at N*, ``P* = sqrt(2*p*T_ckpt) + p*T_load``
    (dimensionless; the GPU-utilisation loss is ``P*/(P*+1)``). Seconds and failures/second."""
    _require(ckpt_s >= 0 and failure_rate >= 0 and load_s >= 0, "need non-negative arguments")
    return math.sqrt(2.0 * failure_rate * ckpt_s) + failure_rate * load_s


def phoenixos_frequency(failures_per_hour: float, overhead_s: float) -> float:
    """PhoenixOS §A.1: the optimal checkpoint frequency in checkpoints per hour::

        f* = sqrt(N*F / (2*O))

    ``failures_per_hour`` is N*F (N GPUs failing F times an hour each); ``overhead_s`` (O) the
    seconds one checkpoint costs training. (O is converted to hours inside.) This is the Young/Daly
    optimum again: ``3600 / (young_daly_interval(O, NF/3600, t) * t)`` for any t.
    """
    _require(failures_per_hour > 0 and overhead_s > 0, "need failures_per_hour > 0 and overhead_s > 0")
    return math.sqrt(failures_per_hour / (2.0 * overhead_s / 3600.0))


def expected_loss(f: int, t: float, tw: float, n: int, load_s: float = 0.0, blocked: float = 0.0) -> float:
    """Expected seconds lost per failure (uniform failure time): the load, plus the work since
    the newest *durable* checkpoint, which started on average half a period plus ``Tw`` earlier.
    The period is ``max(f*t + B, Tw/N)`` (see :func:`expected_slowdown`)."""
    period = max(f * t + blocked, tw / n)
    return load_s + period / 2.0 + tw


def waste_fraction(f: int, t: float, tw: float, n: int, failure_rate: float, load_s: float = 0.0,
                   blocked: float = 0.0) -> float:
    """Wasted time per second of useful training (GoCkpt's P, generalised to N in flight)::

        P(f) = (slowdown(f) - 1) + p * slowdown(f) * loss(f)

    the checkpointing overhead plus, per second of wall time, ``p`` failures (per second) each
    losing :func:`expected_loss` seconds. With ``tw = 0``, ``n = 1`` and ``blocked = T_ckpt`` it
    is GoCkpt's ``T_ckpt/(N*T_step) + p*N*T_step/2 + p*T_load`` up to second-order terms, whose
    minimum is at :func:`young_daly_interval`. Goodput (useful fraction) is ``1 / (1 + P)``.
    """
    s = expected_slowdown(f, t, tw, n, blocked)
    return (s - 1.0) + failure_rate * s * expected_loss(f, t, tw, n, load_s, blocked)


def goodput_interval(t: float, tw: float, n: int, failure_rate: float, load_s: float = 0.0,
                     blocked: float = 0.0, f_max: int = 1_000_000) -> int:
    """The interval (iterations) that minimises :func:`waste_fraction`, i.e. maximises goodput.

    Searched exactly over integers around the Young/Daly point (the function is unimodal in f:
    a decreasing checkpoint term plus an increasing loss term)."""
    _require(failure_rate > 0, "need failure_rate > 0 (failures per second)")
    lo, hi = 1, f_max
    def w(f: int) -> float:
        return waste_fraction(f, t, tw, n, failure_rate, load_s, blocked)

    while hi - lo > 2:  # ternary search on a unimodal integer function
        a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if w(a) <= w(b):
            hi = b
        else:
            lo = a
    return min(range(lo, hi + 1), key=lambda f: (w(f), f))
