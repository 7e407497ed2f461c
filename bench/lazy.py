"""``python -m bench.lazy``: the face of :mod:`bench.modes.lazy` (bench/__init__.py maps the folders)."""

import sys

from bench.modes.lazy import main

if __name__ == "__main__":
    sys.exit(main())
