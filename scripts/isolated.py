"""One model per spawned worker process, for the zoo sweeps: a crash, a hang or a runaway
allocation in one model ends that worker, not the sweep."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable


def run_in_worker(target: Callable, args: tuple, timeout: float) -> tuple[dict | None, str | None]:
    """``target(*args, queue)`` in a spawned process that puts one result dict on ``queue``:
    (that dict, None), or (None, why there is none: a timeout or the worker's death)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    worker = context.Process(target=target, args=(*args, queue))
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        worker.kill()
        worker.join()
        return None, f"timed out after {timeout:.0f} s"
    if worker.exitcode != 0 and queue.empty():
        return None, f"worker died (exit code {worker.exitcode})"
    return queue.get(), None
