"""``python -m bench.goodput``: the face of :mod:`bench.paper.goodput` (bench/__init__.py maps the folders)."""

import sys

from bench.paper.goodput import main

if __name__ == "__main__":
    sys.exit(main())
