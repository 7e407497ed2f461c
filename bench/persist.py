"""``python -m bench.persist``: the face of :mod:`bench.micro.persist` (bench/__init__.py maps the folders)."""

import sys

from bench.micro.persist import main

if __name__ == "__main__":
    sys.exit(main())
