"""``pccheck.load_latest``: the newest valid checkpoint, put back in place when given the objects.

Without ``model`` it returns the arrays (numpy) of an arrays checkpoint, or the nested state with
tensors of a PyTorch checkpoint. With ``model`` (and ``optimizer``, ``extra_state``) it restores
them in place, including the RNG states, so training resumes bit for bit at ``r.step + 1``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from .errors import ConfigError
from .persist import recovery
from .persist.recovery import Restored
from .torch_state import TREE_KEY, TorchState, rebuild, unwrap_extra

__all__ = ["load_latest"]


def load_latest(path: str | os.PathLike[str] | None = None, *, model: Any = None, optimizer: Any = None,
                extra_state: Mapping[str, Any] | None = None, map_location: Any = None,
                zero_copy: bool = False, verify: bool = True) -> Restored:
    """Loads the newest valid checkpoint under ``path`` (default ``$PCCHECK_DIR`` or ./checkpoints).

    Returns a :class:`Restored` with ``step``, ``state`` and ``metadata``. Raises
    NoCheckpointError when there is none. See :func:`pccheck.persist.recovery.load_latest` for
    how the checkpoint is picked and validated.
    """
    if (optimizer is not None or extra_state) and model is None:
        raise ConfigError("pass model= together with optimizer= / extra_state=")
    r = recovery.load_latest(path, zero_copy=zero_copy and model is None, verify=verify)
    metadata = dict(r.metadata)
    tree = metadata.pop(TREE_KEY, None)
    if tree is None:
        if model is not None:
            raise ConfigError(f"the checkpoint at step {r.step} holds arrays, not a PyTorch model; "
                              "load it without model=")
        return dataclasses.replace(r, metadata=metadata)
    if model is not None:
        state = TorchState(model, optimizer, extra_state).restore(tree, r.state, r.torch_dtypes, map_location)
    else:
        import torch

        from .arrays import torch_dtype

        def as_tensor(name: str) -> Any:
            t = torch.from_numpy(r.state[name])
            if name in r.torch_dtypes:
                t = t.view(torch_dtype(r.torch_dtypes[name]))
            return t.to(map_location) if map_location is not None else t

        state = unwrap_extra(rebuild({"d": tree}, r.state, as_tensor))
    state["step"] = r.step
    return dataclasses.replace(r, state=state, metadata=metadata)
