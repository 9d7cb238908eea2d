"""One model per spawned worker process, for the zoo sweeps: a crash, a hang or a runaway
allocation in one model ends that worker, not the sweep."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from queue import Empty


def run_in_worker(target: Callable, args: tuple, timeout: float) -> tuple[dict | None, str | None]:
    """``target(*args, queue)`` in a spawned process that puts one result dict on ``queue``:
    (that dict, None), or (None, why there is none: a timeout or the worker's death).

    The result is read while the worker runs: a worker whose result is larger than the pipe's
    buffer (slanet-table's, with a schedule rule per kernel) cannot exit until it is read, so
    waiting for its exit first hung until the timeout."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    worker = context.Process(target=target, args=(*args, queue))
    worker.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                result = queue.get(timeout=1.0)
                break
            except Empty:
                if not worker.is_alive():  # it may have put its result just before it ended
                    try:
                        result = queue.get(timeout=1.0)
                        break
                    except Empty:
                        return None, f"worker died (exit code {worker.exitcode})"
                if time.monotonic() > deadline:
                    return None, f"timed out after {timeout:.0f} s"
        worker.join()
        return result, None
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()
