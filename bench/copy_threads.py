"""``python -m bench.copy_threads``: the face of :mod:`bench.micro.copy_threads` (bench/__init__.py maps the folders)."""

import sys

from bench.micro.copy_threads import main

if __name__ == "__main__":
    sys.exit(main())
