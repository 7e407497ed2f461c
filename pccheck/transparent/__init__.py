"""Transparent mode: checkpoint a whole process tree with CRIU, persisted and committed by pccheck.

CRIU dumps the running process into a tmpfs directory (the snapshot, with ``--leave-running``);
the image files go through the orchestrator like any checkpoint's arrays (the DRAM chunk pool,
the writer threads, the CAS commit), one array per file, so the manifest lists every file with its
size and crc32c. ``resume`` validates the newest image (falling back to an older valid one),
writes it back to tmpfs and restores it.

Modules: :mod:`.criu` (finding and running CRIU), :mod:`.image` (image directory <-> arrays),
:mod:`.openfiles` (files open for writing: recorded at each dump, cut back before a restore),
:mod:`.supervisor` (the supervised process, its dumps and resume). ``pccheck run`` and
``pccheck resume`` are the command line over :class:`Supervisor`.
"""

from __future__ import annotations

from .criu import Criu, find_criu
from .supervisor import DumpStats, Supervisor

__all__ = ["Criu", "DumpStats", "Supervisor", "find_criu"]
