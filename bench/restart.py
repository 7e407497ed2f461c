"""``python -m bench.restart``: the face of :mod:`bench.training.restart` (bench/__init__.py maps the folders)."""

import sys

from bench.training.restart import main

if __name__ == "__main__":
    sys.exit(main())
