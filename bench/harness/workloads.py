"""The training workloads the throughput benchmarks checkpoint: a model, its optimizer, one iteration.

``emulated`` (:func:`make_emulated`): **the GPU is emulated**. One iteration waits ``iter_time``
seconds with ``time.sleep`` (as the host waits for a GPU's forward/backward), then
``optimizer.step()`` of a ``torch.optim.SGD`` (lr 1e-3, no momentum, so the optimizer holds no
tensors) updates all of the state in place: ``p -= lr * grad`` over ``nbytes`` of float32 parameters
(4 ``nn.Parameter`` of a small ``nn.Module``; grads are set once, untimed). The update is a real
memory-bandwidth pass and runs through ``optimizer.step()``, so pccheck's copy-on-write pre-hook
guards it.

``real`` (:func:`make_real`): an MLP (1024-2048-2048-2048-1024-10, ~12.6 M parameters) trained on the
CPU on a fixed synthetic data set: forward + cross-entropy + backward + Adam. Nothing is emulated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench.harness.common import format_size

__all__ = ["Workload", "make_emulated", "make_real", "N_PARAMS", "LR"]

N_PARAMS = 4  # parameters of the emulated model
LR = 1e-3     # the emulated model's SGD learning rate


class Workload:
    """A model, its optimizer and one training iteration (``step()``)."""

    def __init__(self, name: str, model: Any, optimizer: Any, step: Callable[[], None], describe: str) -> None:
        self.name, self.model, self.optimizer, self.step, self.describe = name, model, optimizer, step, describe

    def tensors(self) -> list[tuple[str, Any]]:
        """Every tensor of the model's and the optimizer's state, in a fixed order: the model's under
        their state_dict keys, the optimizer's as ``optim.{param id}.{key}``."""
        import torch

        out = list(self.model.state_dict().items())
        for pid, st in self.optimizer.state_dict()["state"].items():
            out += [(f"optim.{pid}.{k}", v) for k, v in st.items() if isinstance(v, torch.Tensor)]
        return out

    def state_bytes(self) -> int:
        """Bytes of tensors in the model's and the optimizer's state_dict."""
        return sum(t.numel() * t.element_size() for _, t in self.tensors())


def make_emulated(nbytes: int, iter_time: float) -> Workload:
    """Emulated GPU iteration: sleep ``iter_time``, then SGD (no momentum) updates every parameter."""
    import torch

    elems = nbytes // 4
    base, extra = divmod(elems, N_PARAMS)
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.full((base + (i < extra),), 0.5)) for i in range(N_PARAMS)])
    for p in model.parameters():  # set once, outside timing; full_like touches every page
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)

    def step() -> None:
        time.sleep(iter_time)  # the host waiting for the (emulated) GPU's forward/backward
        opt.step()             # the update: every byte of the state mutated in place

    return Workload("emulated", model, opt, step,
                    f"GPU EMULATED: sleep {iter_time * 1e3:g} ms, then torch.optim.SGD(momentum=0).step() "
                    f"over {format_size(nbytes)} of float32 in {N_PARAMS} Parameters")


def make_real(batch: int = 128, seed: int = 0) -> Workload:
    """A real MLP trained on the CPU with Adam on a fixed synthetic data set."""
    import torch

    torch.manual_seed(seed)
    dims = (1024, 2048, 2048, 2048, 1024)
    layers: list[Any] = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(dims[-1], 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    xs = torch.randn(8, batch, dims[0])
    ys = torch.randint(0, 10, (8, batch))
    it = [0]

    def step() -> None:
        i = it[0] % len(xs)
        it[0] += 1
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(xs[i]), ys[i])
        loss.backward()
        opt.step()

    for _ in range(2):  # Adam creates its state lazily: make it exist before any checkpointer sees it
        step()
    nparams = sum(p.numel() for p in model.parameters())
    return Workload("real", model, opt, step,
                    f"REAL CPU training: MLP {'-'.join(map(str, dims))}-10 ({nparams / 1e6:.1f} M params), "
                    f"batch {batch}, Adam, synthetic data")
