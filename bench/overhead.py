"""``python -m bench.overhead``: the face of :mod:`bench.training.overhead` (bench/__init__.py maps the folders)."""

import sys

from bench.training.overhead import main

if __name__ == "__main__":
    sys.exit(main())
