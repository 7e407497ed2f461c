"""The compiled core. See the C++ sources beside this file; docs/FORMAT.md is their spec.

There is deliberately no pure-Python fallback for the hot path: if the extension is missing,
importing pccheck fails with a message that says how to build it.
"""

from __future__ import annotations

from ..errors import NativeExtensionError

try:
    from . import _native
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise NativeExtensionError(
        "pccheck's native core (pccheck.native._native) is not built or does not load "
        f"({exc}). Build it with `pip install .` from the source tree (needs a C++17 compiler, "
        "cmake and the Python headers; optionally `apt-get install libpmem-dev`), or run `make setup`. "
        "If you run from a source checkout, make sure the installed package, not the source "
        "directory, is first on sys.path."
    ) from exc

__all__ = ["_native"]
