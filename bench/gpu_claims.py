"""``python -m bench.gpu_claims``: the face of :mod:`bench.gpu.gpu_claims` (bench/__init__.py maps the folders)."""

import sys

from bench.gpu.gpu_claims import main

if __name__ == "__main__":
    sys.exit(main())
