"""``python -m bench.fig12``: the face of :mod:`bench.paper.fig12` (bench/__init__.py maps the folders)."""

import sys

from bench.paper.fig12 import main

if __name__ == "__main__":
    sys.exit(main())
