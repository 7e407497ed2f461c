"""``python -m pccheck.demo`` (``make demo``): train a tiny GPT, crash it, resume it bit for bit.

A thin face over :mod:`pccheck.commands.demo`, kept so the command stays as the README writes it.
"""

import sys

from .commands.demo import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
