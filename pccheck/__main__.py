"""``python -m pccheck ARGS...`` is the ``pccheck`` command (:mod:`pccheck.commands.cli`), for
environments where the console script is not on PATH."""

from .commands.cli import main

if __name__ == "__main__":
    main()
