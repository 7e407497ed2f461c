"""The old path of the ``pccheck`` command, kept for one release: use ``python -m pccheck`` (or the
``pccheck`` script). ``python -m pccheck.cli ARGS...`` and ``from pccheck.cli import main`` still
work, with a DeprecationWarning.

Modules that move keep their old path this way for one release: a face at the old path that warns
and hands over to the new one.
"""

import warnings

from .commands.cli import app, main

__all__ = ["app", "main"]

warnings.warn("pccheck.cli moved to pccheck.commands.cli; run `python -m pccheck` (or the `pccheck` script) "
              "instead of `python -m pccheck.cli`; the old path goes in the next release",
              DeprecationWarning, stacklevel=1 if __name__ == "__main__" else 2)

if __name__ == "__main__":
    main()
