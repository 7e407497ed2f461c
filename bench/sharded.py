"""``python -m bench.sharded``: the face of :mod:`bench.modes.sharded` (bench/__init__.py maps the folders)."""

import sys

from bench.modes.sharded import main

if __name__ == "__main__":
    sys.exit(main())
