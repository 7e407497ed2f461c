"""``python -m bench.gockpt``: the face of :mod:`bench.modes.gockpt` (bench/__init__.py maps the folders)."""

import sys

from bench.modes.gockpt import main

if __name__ == "__main__":
    sys.exit(main())
