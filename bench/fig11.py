"""``python -m bench.fig11``: the face of :mod:`bench.paper.fig11` (bench/__init__.py maps the folders)."""

import sys

from bench.paper.fig11 import main

if __name__ == "__main__":
    sys.exit(main())
