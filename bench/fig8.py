"""``python -m bench.fig8``: the face of :mod:`bench.paper.fig8` (bench/__init__.py maps the folders)."""

import sys

from bench.paper.fig8 import main

if __name__ == "__main__":
    sys.exit(main())
