"""``python -m bench.tuner``: the face of :mod:`bench.paper.tuner` (bench/__init__.py maps the folders)."""

import sys

from bench.paper.tuner import main

if __name__ == "__main__":
    sys.exit(main())
