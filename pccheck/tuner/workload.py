"""The profiling workload: an :class:`EmulatedState` of ``m`` bytes and one emulated training update.

The state is ``m`` bytes of float32 parameters, touched once when created (first touch of memory
is slow and must never be timed). One emulated training iteration lasts ``t`` seconds: the host
sleeps (waiting for the accelerator's forward and backward pass), then the update mutates the
whole state in place exactly as ``SGD(momentum=0).step()`` does (``p -= lr * grad``: it reads m
bytes of parameters and m of gradients and writes m; on a CPU-only host this is real work, which
the copy and the writers compete with, and it is the part of t the background copy cannot
overlap; on a GPU it is a kernel on the device). When torch is installed the state is a
``torch.nn.Module`` whose parameters share the arrays' memory, with an optimizer that performs the
update, so the Checkpointer runs with soft copy-on-write exactly as in training (the copy overlaps
the next iteration; the optimizer step waits for what is left). Without torch the state is a
mapping of numpy arrays, whose copy blocks ``maybe_checkpoint``. With ``device="cuda"`` (torch
with CUDA) the parameters live on the GPU and the copy is device → pinned DRAM.

:mod:`pccheck.tuner.profile` measures with it; it knows nothing of the profilers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError

__all__ = ["EmulatedState", "BLOCK"]

BLOCK = 4096     # the smallest state, and the unit chunk sizes round to
_N_ARRAYS = 4


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


class EmulatedState:
    """``nbytes`` of float32 parameters to checkpoint, touched once, and one cheap mutation.

    Args:
        nbytes: state size m in bytes (rounded down to a multiple of 4, at least 4 KiB).
        device: "cpu", "cuda" (torch tensors on the GPU), or "auto" (cuda if torch sees one).
        use_torch: on the CPU, wrap the arrays in a torch Module + optimizer (soft copy-on-write,
            as in training). Default: when torch is installed. False: a mapping of numpy arrays.

    ``checkpointer_args()`` gives the positional arguments for :class:`pccheck.Checkpointer`;
    ``mutate()`` is the update of one emulated iteration; ``host_bytes()`` a flat uint8 view of the
    state for the CPU copy profiler; ``device_bytes()`` the same on the GPU.
    """

    def __init__(self, nbytes: int, device: str = "cpu", use_torch: bool | None = None) -> None:
        if nbytes < BLOCK:
            raise ConfigError(f"the state to profile must be at least {BLOCK} bytes, got {nbytes}")
        # torch is imported only when it may be used (it takes seconds to import)
        torch = None if (device == "cpu" and use_torch is False) else _torch()
        if device == "auto":
            device = "cuda" if torch is not None and torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
        if device == "cuda" and (torch is None or not torch.cuda.is_available()):
            raise ConfigError("device='cuda' needs torch with a CUDA device; use device='cpu'")
        self.device = device
        self.nbytes = nbytes // 4 * 4
        elems = self.nbytes // 4
        base, extra = divmod(elems, _N_ARRAYS)
        sizes = [base + (1 if i < extra else 0) for i in range(_N_ARRAYS)]
        sizes = [s for s in sizes if s > 0]
        self.use_torch = device == "cuda" or (torch is not None if use_torch is None else bool(use_torch))
        if self.use_torch and torch is None:
            raise ConfigError("use_torch=True but torch is not installed")
        self.arrays: dict[str, Any] = {}
        self.module: Any = None
        self.optimizer: Any = None
        self._grads: list[Any] = []
        # Parameters, and a gradient of the same size (lr already applied) for an SGD-like update.
        if device == "cuda":
            self._flat_dev = torch.full((elems,), 0.5, dtype=torch.float32, device="cuda")
            parts = list(torch.split(self._flat_dev, sizes))
            grads = list(torch.split(torch.full((elems,), 1e-6, dtype=torch.float32, device="cuda"), sizes))
            self._flat_host: np.ndarray | None = None
        else:
            self._flat_host = np.full(elems, 0.5, dtype=np.float32)  # touches every page once
            cuts = np.cumsum(sizes)[:-1]
            parts = list(np.split(self._flat_host, cuts))
            grads = list(np.split(np.full(elems, 1e-6, dtype=np.float32), cuts))
            self._flat_dev = None
        if self.use_torch:
            self.module = torch.nn.Module()
            for i, part in enumerate(parts):
                tensor = part if device == "cuda" else torch.from_numpy(part)
                self.module.register_parameter(f"p{i}", torch.nn.Parameter(tensor, requires_grad=False))
            tgrads = [g if device == "cuda" else torch.from_numpy(g) for g in grads]
            self.optimizer = _sgd_optimizer(torch, list(self.module.parameters()), tgrads)
            self.arrays = dict(self.module.named_parameters())
        else:
            self.arrays = {f"p{i}": a for i, a in enumerate(parts)}
            self._grads = grads

    def checkpointer_args(self) -> tuple[Any, Any]:
        """(state, optimizer) for ``Checkpointer(state, optimizer, path=...)``."""
        if self.use_torch:
            return self.module, self.optimizer
        return self.arrays, None

    def checkpointer_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments for the Checkpointer: none. Its defaults are what training runs
        with (for a torch state that includes capturing the RNG states, a few ms per checkpoint)."""
        return {}

    def mutate(self) -> None:
        """The update of one iteration, as ``SGD(momentum=0).step()``: ``p -= lr * grad`` in place
        for every parameter (reads the parameters and the gradients, writes the parameters),
        through the optimizer when there is one, so its step pre-hook guards the copy."""
        if self.optimizer is not None:
            self.optimizer.step()
        else:
            for a, g in zip(self.arrays.values(), self._grads):
                a -= g

    def host_bytes(self) -> np.ndarray:
        """The CPU state as one flat uint8 array (no copy). Only for device == "cpu"."""
        assert self._flat_host is not None
        return self._flat_host.view(np.uint8)

    def device_bytes(self) -> Any:
        """The GPU state as one flat uint8 tensor (no copy). Only for device == "cuda"."""
        assert self._flat_dev is not None
        return self._flat_dev.view(_torch().uint8)

    def close(self) -> None:
        """Drops the references (the memory goes back when nothing else holds it)."""
        self.arrays, self.module, self.optimizer, self._grads = {}, None, None, []
        self._flat_host = self._flat_dev = None


def _sgd_optimizer(torch: Any, params: list[Any], grads: list[Any]) -> Any:
    class _SGD(torch.optim.Optimizer):
        """``p -= g`` for every parameter and its fixed gradient (lr applied): SGD(momentum=0)'s
        memory traffic, through step(), so the Checkpointer's step pre-hook guards it."""

        def __init__(self) -> None:
            super().__init__(params, {})
            self._grads = grads

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for p, g in zip(self.param_groups[0]["params"], self._grads):
                p.sub_(g)

    return _SGD()
