"""``python -m bench.gpu``: runs :mod:`bench.gpu.gpu` (the GPU sections; bench/gpu/__init__.py maps the folder)."""

import sys

from bench.gpu.gpu import main

if __name__ == "__main__":
    sys.exit(main())
