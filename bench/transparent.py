"""``python -m bench.transparent``: the face of :mod:`bench.modes.transparent` (bench/__init__.py maps the folders)."""

import sys

from bench.modes.transparent import main

if __name__ == "__main__":
    sys.exit(main())
