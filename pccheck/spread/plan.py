"""How a spread checkpoint is cut into parts, and how many steps to spread it over.

A *unit* is one parameter with its optimizer state (GoCkpt §4.2.2: a block of model parameters is
followed at once by the optimizer state that belongs to it). Parts follow unit boundaries and are
balanced by bytes; a tensor is never split (a replay over a sub-range could run a different
vector/tail path of the CPU kernels and lose bit-equality).

The stall model (GoCkpt §4.2.3, with this machine's terms): the state of S bytes is copied over a
link of B bytes/s in k parts, one per iteration of t seconds. A part is hidden by its iteration
while S/k <= B*t; what is not hidden stalls: max(0, S/B - k*t) in all. Every part already copied
also needs its gradients captured at each later step (r*S/k bytes per part, r = gradient bytes /
state bytes), which the training thread waits for: r*S/B * (1 + 2 + ... + k)/k = r*S*(k+1)/(2B).
So

    stall(k) = max(0, S/B - k*t) + r*S*(k+1)/(2B)   for k >= 2,   stall(1) = max(0, S/B - t)

(k = 1 is today's soft copy-on-write: the whole state in one step, no gradients). The paper's
mixed-precision case (r = 1/7) has its optimum at 7-8 steps; fp32 AdamW (r = 1/3) at fewer. That
is the paper's model, where the training thread waits for every gradient transfer. pccheck copies
the gradients beside the step instead (GoCkpt-O), so only a part that misses its step stalls:
:func:`stall_overlapped`, which "auto" uses. The captured gradients are replayed as they come (two
steps' worth at most waiting), so their memory does not grow with k; when the replay falls behind,
the capture waits for it: :func:`replay_backpressure`, the term the paper's GPU-side model lacks
(its replay of step j costs j/k of a whole-state CPU optimizer step, (k+1)/2 of them per spread).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

__all__ = ["Unit", "units", "split", "stall", "stall_overlapped", "replay_backpressure", "modelled_stall",
           "auto_steps", "split_budget", "MAX_STEPS", "RECORDS"]

# Steps whose captured gradients may wait for the replay at once (the driver's pre-hook blocks
# beyond it): a spread holds at most RECORDS x one step's gradient bytes.
RECORDS = 2
MAX_STEPS = 8  # the paper's optimum is 7-8; beyond it the gradient traffic outweighs the saving


@dataclass(frozen=True)
class Unit:
    """One parameter and its optimizer state: where it sits in the optimizer, and its bytes."""

    group: int            # index of its param group
    index: int            # index within the group's params
    param: Any            # the live parameter
    state_keys: tuple[str, ...]  # its optimizer state entries that are tensors
    nbytes: int           # parameter + those state tensors

    def tensors(self, state: Any) -> list[tuple[str | None, Any]]:
        """(state key or None for the parameter, live tensor), parameter first."""
        st = state.get(self.param, {})
        return [(None, self.param)] + [(k, st[k]) for k in self.state_keys]


def units(optimizer: Any) -> list[Unit]:
    """Every parameter of ``optimizer`` with its tensor state, in param-group order."""
    import torch

    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            st = optimizer.state.get(p, {})
            keys = tuple(k for k, v in st.items() if isinstance(v, torch.Tensor))
            nbytes = p.numel() * p.element_size() + sum(st[k].numel() * st[k].element_size() for k in keys)
            out.append(Unit(gi, pi, p, keys, nbytes))
    return out


def split(items: list[Unit], k: int) -> list[list[Unit]]:
    """``items`` cut, in order, into at most ``k`` non-empty parts of about equal bytes (a part
    closes once it reaches its share of what is left, so one huge unit does not leave the other
    parts empty)."""
    parts: list[list[Unit]] = []
    left = sum(u.nbytes for u in items)
    cur: list[Unit] = []
    size = 0
    for i, u in enumerate(items):
        cur.append(u)
        size += u.nbytes
        parts_left = k - len(parts)
        units_left = len(items) - i - 1
        if parts_left > 1 and (size >= left / parts_left or units_left < parts_left):
            parts.append(cur)
            left -= size
            cur, size = [], 0
    if cur:
        parts.append(cur)
    return parts


def stall(k: int, state_bytes: float, grad_bytes: float, bandwidth: float, iter_time: float) -> float:
    """Seconds one checkpoint spread over ``k`` steps keeps the training thread waiting (the model
    in the module docstring)."""
    s_b = state_bytes / bandwidth
    hidden = max(0.0, s_b - k * iter_time)
    if k == 1:
        return hidden
    return hidden + grad_bytes * (k + 1) / (2 * bandwidth)


def stall_overlapped(k: int, state_bytes: float, grad_bytes: float, bandwidth: float, iter_time: float,
                     step_time: float) -> float:
    """The stall of pccheck's spread, whose gradient copies run beside the optimizer step
    (``step_time`` u) instead of before it (GoCkpt-O, §4.2.4): step j's gradients of the j parts
    copied so far must cross the link during the update (the post-hook waits for the rest), and
    each part during the forward/backward (``iter_time`` t) before the step that needs it:

        stall(k) = k * max(0, S/(kB) - t) + sum_{j=1}^{k} max(0, G*j/(kB) - u)

    (G: gradient bytes of all parameters)."""
    part = state_bytes / k / bandwidth
    total = k * max(0.0, part - iter_time)
    for j in range(1, k + 1):
        total += max(0.0, grad_bytes * j / k / bandwidth - step_time)
    return total


def replay_backpressure(k: int, iter_time: float, step_time: float, replay_step_s: float) -> float:
    """Seconds the training thread waits for the CPU replay of a spread over ``k`` steps: the
    captured steps arrive one per iteration (the first after ``iter_time`` t, then every t + u),
    one replay thread works through them in order, step j's over j/k of the state (``replay_step_s``
    R: one step's replay over the whole state), and the capture of step j waits until step
    j - RECORDS has been replayed (at most RECORDS steps' gradients wait). Each wait delays the
    later captures. 0 while the replay keeps up (j/k·R <= t + u for every j, roughly)."""
    if k < 2 or replay_step_s <= 0:
        return 0.0
    now, server, waited = 0.0, 0.0, 0.0
    done: list[float] = []
    for j in range(1, k + 1):
        now += iter_time if j == 1 else iter_time + step_time
        if j > RECORDS and done[j - RECORDS - 1] > now:  # back-pressure: too many steps wait
            waited += done[j - RECORDS - 1] - now
            now = done[j - RECORDS - 1]
        server = max(server, now) + replay_step_s * j / k
        done.append(server)
    return waited


def modelled_stall(k: int, state_bytes: float, grad_bytes: float, bandwidth: float, iter_time: float,
                   step_time: float = 0.0, overlapped: bool = True, replay_step_s: float = 0.0) -> float:
    """The stall of a snapshot spread over ``k`` steps: :func:`stall` for k = 1 (one step, no
    gradients) and where the gradients are copied before the update, else :func:`stall_overlapped`;
    for k > 1 plus :func:`replay_backpressure` at ``replay_step_s`` (0: the replay is taken to keep up)."""
    if k == 1:
        return stall(k, state_bytes, grad_bytes, bandwidth, iter_time)
    replay = replay_backpressure(k, iter_time, step_time, replay_step_s)
    if not overlapped:
        return stall(k, state_bytes, grad_bytes, bandwidth, iter_time) + replay
    return stall_overlapped(k, state_bytes, grad_bytes, bandwidth, iter_time, step_time) + replay


def auto_steps(state_bytes: float, grad_bytes: float, bandwidth: float, iter_time: float,
               step_time: float = 0.0, grad_budget: float | None = None, overlapped: bool = True,
               replay_step_s: float = 0.0) -> int:
    """The k in 1..MAX_STEPS with the least :func:`modelled_stall`, the smallest k among equals
    (within 1 ms), leaving out every k > 1 when the captured gradients of the steps that may wait
    for the replay at once (RECORDS) exceed ``grad_budget``."""
    args = (state_bytes, grad_bytes, bandwidth, iter_time, step_time, overlapped, replay_step_s)
    best, best_stall = 1, modelled_stall(1, *args)
    if grad_budget is not None and RECORDS * grad_bytes > grad_budget:
        return best
    for k in range(2, MAX_STEPS + 1):
        s = modelled_stall(k, *args)
        if s < best_stall - 1e-3:
            best, best_stall = k, s
    return best


MIN_POOL = 4096  # the smallest chunk pool (one chunk of one block)


def split_budget(setting: int | str, grad_bytes: int, dram_budget: int | None) -> tuple[int | None, int | None]:
    """``dram_budget`` shared between the chunk pool and a spread's captured gradients:
    (the pool's budget, the gradients' budget), for ``spread_steps=setting`` and ``grad_bytes``
    of gradients per step.

    A spread holds the captured gradients of at most RECORDS steps at once, so it takes RECORDS x
    ``grad_bytes`` off the pool's budget. An explicit ``spread_steps`` whose gradients leave less
    than MIN_POOL raises ConfigError; "auto" takes them only if the pool keeps at least half the
    budget, else it never spreads (gradient budget 0). No ``dram_budget`` (the default pool, 2x
    the state): (None, None), the gradients come on top."""
    if dram_budget is None or setting == 1:
        return dram_budget, None
    need = RECORDS * grad_bytes
    pool = dram_budget - need
    if setting == "auto":
        return (pool, need) if pool >= max(MIN_POOL, dram_budget // 2) else (dram_budget, 0)
    if pool < MIN_POOL:
        raise ConfigError(f"spread_steps={setting} holds up to {need} bytes of captured gradients ({RECORDS} steps), "
                          f"which leave {max(0, pool)} of dram_budget={dram_budget} bytes for the chunk pool "
                          f"(at least {MIN_POOL} needed); raise dram_budget to at least {need + MIN_POOL} "
                          "or use spread_steps=1")
    return pool, need
