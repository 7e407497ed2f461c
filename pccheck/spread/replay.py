"""The CPU shadow optimizer of spread (GoCkpt) mode: replays the live steps on a part's CPU copy.

In spread mode a checkpoint of step k is copied in n parts: part j (parameters together with their
optimizer state) is copied at version k+j-1, before optimizer step k+j runs. From then on, at every
optimizer step, the live training records in the optimizer's step pre-hook the gradients of the
parameters already copied and each param group's hyperparameters (a :class:`StepRecord`). The
pre-hook runs after GradScaler's unscale and after gradient clipping, so the gradients it sees are
the ones the update uses. :class:`ShadowOptimizer` applies those records to the CPU copies with the
real ``torch.optim`` class's ``step()`` (the same kernels, none of the math rewritten here), so each
part reaches version k+n; when training runs on the CPU the result is bit-identical (``torch.equal``)
to the live state after step k+n (papers/gockpt.txt §4.3.1).

Only optimizers whose step is a pure function of (parameter, state, gradient, group
hyperparameters) on the CPU are replayed; :func:`check_replayable` refuses the others when a
spread checkpointer is built, and the message says to use ``spread_steps=1``.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from ..errors import ConfigError, SnapshotError

if TYPE_CHECKING:  # torch is imported where it is used: `import pccheck` must not load it
    import torch

    # One entry of ShadowOptimizer.add_part: (group index, index of the parameter within its
    # group, the parameter's CPU copy, its optimizer state's CPU copies by name).
    PartEntry = tuple[int, int, torch.Tensor, dict[str, Any]]

__all__ = ["StepRecord", "ShadowOptimizer", "check_replayable"]

_log = logging.getLogger(__name__)


def _replayable() -> tuple[type[torch.optim.Optimizer], ...]:
    """The optimizer classes replayed. Exact classes only (``type(opt) in``, never isinstance): a
    subclass may override step(), and AdamW itself is a subclass of Adam in recent torch."""
    import torch

    return (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


@dataclass(frozen=True)
class StepRecord:
    """What one live optimizer step used, as captured in its step pre-hook.

    ``hparams[g]`` is param group g's dict without ``"params"`` (lr, betas, weight_decay, momentum,
    eps, amsgrad, maximize, foreach, nesterov, dampening, ...), as the step read it. ``grads`` maps
    (group index, index within the group) to a CPU copy of that parameter's gradient, for the
    parameters of the parts copied so far that had a gradient at that step. The copies must be taken
    in the pre-hook, not referenced: some steps write into ``p.grad`` (SGD foreach with nesterov
    adds the momentum to it in place), and :meth:`ShadowOptimizer.replay` may do the same to these.
    """

    hparams: list[dict[str, Any]]
    grads: dict[tuple[int, int], torch.Tensor]


def _tensor_hparams(group: Mapping[str, Any]) -> list[str]:
    """Names of the group's hyperparameters that are, or contain, a Tensor."""
    import torch

    out = []
    for name, value in group.items():
        if name == "params":
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, torch.Tensor) for v in values):
            out.append(name)
    return out


def _group_refusal(group: Mapping[str, Any]) -> str | None:
    """Why a param group (live, or recorded) cannot be replayed exactly on the CPU; None if it can."""
    if group.get("fused"):
        return ("fused=True: under a GradScaler the fused kernel unscales the gradients itself and "
                "runs even on a skipped step (found_inf), so the gradients seen before the step are "
                "not the update it applies; use foreach=True instead")
    if group.get("capturable"):
        return ("capturable=True: capturable steps keep their counters on the accelerator and only "
                "run there, not on the CPU copies")
    if group.get("differentiable"):
        return "differentiable=True: a step tracked by autograd is not replayed"
    tensors = _tensor_hparams(group)
    if tensors:
        return (f"{', '.join(tensors)} is a Tensor: LR schedulers update a Tensor hyperparameter in "
                f"place, so a record would alias the live value instead of holding the one the step "
                f"used, and torch takes other kernels for it; pass a float")
    return None


def check_replayable(optimizer: torch.optim.Optimizer) -> None:
    """Raises :class:`ConfigError` unless ``optimizer``'s steps can be replayed bit-exactly on CPU.

    Replayable: exactly ``torch.optim.SGD`` (momentum, nesterov, dampening, weight_decay, maximize),
    ``torch.optim.Adam`` and ``torch.optim.AdamW`` (amsgrad, maximize, weight_decay,
    decoupled_weight_decay), each with foreach True, False or None, float hyperparameters, and
    neither fused, capturable nor differentiable. Step hooks are not looked at.
    """
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    replayable = _replayable()
    if cls not in replayable:
        base = next((b for b in cls.__mro__[1:] if b in replayable), None)
        why = (f"it subclasses {base.__name__}, and its step() may differ from the one replayed"
               if base is not None else "only torch.optim.SGD, Adam and AdamW are replayed")
        raise ConfigError(f"spread checkpoints cannot replay {name} on the CPU: {why}; "
                          f"use spread_steps=1")
    for i, group in enumerate(optimizer.param_groups):
        reason = _group_refusal(group)
        if reason is not None:
            raise ConfigError(f"spread checkpoints cannot replay {name} (param group {i}) on the "
                              f"CPU: {reason}; otherwise use spread_steps=1")


def _unhooked_step(cls: type[torch.optim.Optimizer]) -> Callable[[torch.optim.Optimizer], Any]:
    """The class's step() without the step-hook wrapper Optimizer.__init__ put around it."""
    step = cls.step
    # Optimizer._patch_step_function wraps the class's step once (functools.wraps, marked `hooked`)
    # to run the global and per-instance step hooks. The shadow must not run them: the live step
    # already did, and a global pre-hook that edits the gradients ran before the record was taken,
    # so running it again would apply it twice.
    if getattr(step, "hooked", False):
        step = getattr(step, "__wrapped__", step)
    return step


class ShadowOptimizer:
    """Replays live optimizer steps on the CPU copies of a spread checkpoint's parts.

    Call order::

        shadow = ShadowOptimizer(live_optimizer)     # check_replayable, then an empty twin
        shadow.add_part(entries of part 1)           # copied at version k, before step k+1
        shadow.replay(record of step k+1)
        shadow.add_part(entries of part 2)           # copied at version k+1, before step k+2
        shadow.replay(record of step k+2)
        ...                                          # every part now at version k+n

    Records are replayed in step order, each after every part copied before its step was added;
    a step that did not run (GradScaler skipped it) has no record. Not thread-safe.

    Memory: the shadow holds no tensors of its own. Its parameters and state are the caller's CPU
    copies, updated in place (they are the checkpoint's buffers: never reallocated; see
    :meth:`replay`). The only other tensors alive are the gradients of the record being replayed
    (attached as ``.grad`` for the step and detached after it), and the state the optimizer creates
    at the first step of a parameter whose copied state was empty; that state lands in the caller's
    state dict.
    """

    def __init__(self, live: torch.optim.Optimizer) -> None:
        """A twin of ``live``: same class, same ``defaults``, one empty group per live group."""
        check_replayable(live)
        cls = type(live)
        accepted = inspect.signature(cls.__init__).parameters
        # AdamW's defaults carry decoupled_weight_decay, which its __init__ does not take.
        kwargs = {k: v for k, v in live.defaults.items() if k in accepted and k != "params"}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []}
                  for g in live.param_groups]
        self._opt: torch.optim.Optimizer = cls(groups, **kwargs)
        self._step = _unhooked_step(cls)
        self._sizes = [len(g["params"]) for g in live.param_groups]
        self._required = set(live.defaults)  # every key a step reads; each record must carry them
        # (group, index) -> the caller's parameter copy and its state dict. The state dict is the
        # very object in self._opt.state[param]: the step reads and writes it.
        self._params: dict[tuple[int, int], torch.Tensor] = {}
        self._states: dict[tuple[int, int], dict[str, Any]] = {}

    @property
    def keys(self) -> frozenset[tuple[int, int]]:
        """The (group, index) of every parameter added so far."""
        return frozenset(self._params)

    def add_part(self, entries: Iterable[PartEntry]) -> None:
        """Adds the CPU copies of a part just copied: (group, index, param copy, state copy).

        The caller keeps ownership of the tensors; :meth:`replay` updates them in place. The state
        dict itself becomes the shadow's state of that parameter. Either every entry is added or,
        on a ConfigError, none.
        """
        import torch

        entries = list(entries)
        seen_ids = {id(p) for p in self._params.values()}
        new: set[tuple[int, int]] = set()
        for g, i, param, state in entries:
            key = (g, i)
            if not (0 <= g < len(self._sizes) and 0 <= i < self._sizes[g]):
                raise ConfigError(f"part entry {key}: the live optimizer has no parameter {i} in "
                                  f"param group {g} (group sizes {self._sizes})")
            if key in self._params or key in new:
                raise ConfigError(f"part entry {key} was already added: each parameter belongs to "
                                  f"exactly one part")
            if not isinstance(param, torch.Tensor) or not param.is_leaf:
                raise ConfigError(f"part entry {key}: the parameter copy must be a leaf Tensor "
                                  f"(pass param.detach() copies)")
            if id(param) in seen_ids:  # optimizer state is keyed by tensor identity
                raise ConfigError(f"part entry {key}: this tensor is already another entry's copy")
            if not isinstance(state, dict):
                raise ConfigError(f"part entry {key}: the state copy must be a dict, "
                                  f"got {type(state).__name__}")
            new.add(key)
            seen_ids.add(id(param))
        for g, i, param, state in entries:
            self._params[(g, i)] = param
            self._states[(g, i)] = state
            self._opt.state[param] = state
        # Each group lists its parameters in live order (the kernels treat each tensor alone; the
        # order only keeps the twin readable).
        for g, group in enumerate(self._opt.param_groups):
            group["params"] = [self._params[k] for k in sorted(self._params) if k[0] == g]
        _log.debug("spread replay: part of %d tensors added, %d of %d parameters held",
                   len(entries), len(self._params), sum(self._sizes))

    def replay(self, record: StepRecord) -> None:
        """Applies one recorded optimizer step to the shadow parameters that have a gradient in it.

        Each group's hyperparameters are first set from the record; parameters without a gradient
        in the record get ``grad=None`` and are untouched (their ``step`` counters do not move,
        exactly as in the live step). Raises ConfigError for a record that does not fit (group
        count, missing hyperparameters, a gradient of a parameter no part added, an unreplayable
        group) and SnapshotError if the step replaced a state tensor instead of updating it in
        place (that checkpoint must be discarded).
        """
        groups = self._opt.param_groups
        if len(record.hparams) != len(groups):
            raise ConfigError(f"step record has {len(record.hparams)} param groups, the optimizer "
                              f"{len(groups)}")
        unknown = sorted(k for k in record.grads if k not in self._params)
        if unknown:
            raise ConfigError(f"step record has gradients of parameters no part added yet: "
                              f"{unknown[:8]}; add a part before replaying steps that follow it")
        for g, (group, hp) in enumerate(zip(groups, record.hparams)):
            missing = sorted(self._required - hp.keys())
            reason = _group_refusal(hp)
            if missing or reason is not None:
                raise ConfigError(f"step record, param group {g}: "
                                  f"{reason or f'hyperparameters {missing} missing'}")
            group.update((k, v) for k, v in hp.items() if k != "params")
        # name -> tensor of every state entry before the step: the step must update these objects.
        before = {k: dict(self._states[k]) for k in record.grads}
        try:
            for key, param in self._params.items():
                param.grad = record.grads.get(key)
            self._step(self._opt)
        finally:
            for param in self._params.values():
                param.grad = None  # the record's gradients are not kept past its step
        self._check_in_place(before)
        _log.debug("spread replay: one step over %d of %d held parameters",
                   len(record.grads), len(self._params))

    def _check_in_place(self, before: dict[tuple[int, int], dict[str, Any]]) -> None:
        for key, old in before.items():
            state = self._states[key]
            replaced = [n for n, t in old.items() if state.get(n) is not t]
            # Invariant: the caller's dict is the optimizer's state of the parameter, and every
            # tensor it held before the step is still the one it holds (only a first step adds).
            if self._opt.state[self._params[key]] is not state or replaced:
                raise SnapshotError(f"the CPU replay of parameter {key} replaced its optimizer state "
                                    f"{replaced or 'dict'} instead of updating it in place; this "
                                    f"spread checkpoint is discarded (use spread_steps=1)")
