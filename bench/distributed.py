"""``python -m bench.distributed``: the face of :mod:`bench.modes.distributed` (bench/__init__.py maps the folders)."""

import sys

from bench.modes.distributed import main

if __name__ == "__main__":
    sys.exit(main())
