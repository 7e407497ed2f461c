"""``python -m bench.call_cost``: the face of :mod:`bench.micro.call_cost` (bench/__init__.py maps the folders)."""

import sys

from bench.micro.call_cost import main

if __name__ == "__main__":
    sys.exit(main())
