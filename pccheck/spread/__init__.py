"""GoCkpt mode: spread one snapshot over several steps, rebuild a consistent state on the CPU.

A checkpoint of step k is copied in parts during steps k+1 .. k+n; the CPU then replays the
optimizer steps each part missed (``replay.py``) so that every part reaches version k+n
(papers/gockpt.txt §4.3).
"""

__all__: list[str] = []
