"""The commands: the top layer, which only parses arguments, runs the layers below and renders.

- ``cli.py``: the ``pccheck`` command (``ls``, ``verify``, ``inspect``, ``export`` over
  :mod:`pccheck.ops`; ``run`` and ``resume`` over :mod:`pccheck.transparent`).
- ``tune_cli.py``: the ``pccheck-tune`` command (profiles through a :class:`pccheck.Checkpointer`,
  chooses with :mod:`pccheck.tuner`, writes ``pccheck-tune.json``).
- ``demo.py``: ``python -m pccheck.demo`` (its face is ``pccheck/demo.py``): a tiny GPT trained,
  killed and resumed bit for bit.

The console scripts in pyproject.toml point here. Invariants owned here: nothing below imports
this folder; exit statuses are the documented ones (0 success, 2 a usage or configuration error
with what to do, ``verify``'s 1 for "latest invalid, an older one valid"); no store is written
except through the Checkpointer or the Supervisor.
"""

__all__: list[str] = []
