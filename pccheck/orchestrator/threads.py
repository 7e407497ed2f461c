"""Thread pools whose threads are running before the chunk pool exists.

ThreadPoolExecutor starts a thread at the first submit that finds none idle, i.e. inside the
first checkpoints' ``start``. Mapping a thread stack there waits for the mmap lock, which the
native engine's prefaulter holds while it populates the chunk pool (hundreds of ms per thread
measured on a reopened 1 GiB store). So pccheck's pools (the commit threads, the CPU copy
engine's helpers) start their threads when they are made, before the engine exists.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["started_pool"]


def started_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads, all already running: each is parked on a barrier until all
    ``workers`` are up, which forces a new thread per submit."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    parked = threading.Barrier(workers + 1)
    for _ in range(workers):
        pool.submit(parked.wait)
    parked.wait()
    return pool
