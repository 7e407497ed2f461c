"""``python -m bench.integrations``: the face of :mod:`bench.training.integrations` (bench/__init__.py maps the folders)."""

import sys

from bench.training.integrations import main

if __name__ == "__main__":
    sys.exit(main())
