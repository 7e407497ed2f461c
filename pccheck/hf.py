"""``pccheck.hf``: pccheck for the Hugging Face ``Trainer`` and for Accelerate.

    cb = pccheck.hf.Callback("ckpt", interval=10)              # transformers.Trainer callback
    trainer = transformers.Trainer(..., callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.latest())

    hooks = pccheck.hf.register_accelerate(accelerator, "ckpt")  # Accelerator.save_state/load_state

The implementations live in :mod:`pccheck.integrations.hf` and
:mod:`pccheck.integrations.accelerate`; each is imported on first use, so Accelerate alone is
enough for ``register_accelerate``. ``import pccheck`` imports neither
(``pip install 'pccheck[hf]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and editors; at run time each is imported on first use
    from .integrations.accelerate import AccelerateHooks, register_accelerate
    from .integrations.hf import Callback

__all__ = ["Callback", "register_accelerate", "AccelerateHooks"]


def __getattr__(name: str) -> Any:
    if name == "Callback":
        from .integrations.hf import Callback

        return Callback
    if name in ("register_accelerate", "AccelerateHooks"):
        from .integrations import accelerate

        return getattr(accelerate, name)
    raise AttributeError(f"module 'pccheck.hf' has no attribute {name!r}")
