"""``python -m bench.soak``: the face of :mod:`bench.training.soak` (bench/__init__.py maps the folders)."""

import sys

from bench.training.soak import main

if __name__ == "__main__":
    sys.exit(main())
