"""``python -m bench.recovery``: the face of :mod:`bench.micro.recovery` (bench/__init__.py maps the folders)."""

import sys

from bench.micro.recovery import main

if __name__ == "__main__":
    sys.exit(main())
