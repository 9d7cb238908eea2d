"""Which kernel gets the next tuning batch, and when the run stops (budget, time, Ctrl-C)."""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.task_scheduler import PyTaskScheduler

from .progress import TuningProgress


@derived_object
class BudgetScheduler(PyTaskScheduler):
    """Picks the next kernel: each once in turn, then where the most time is, within budget.

    After a first pass over all kernels, the next batch goes to the kernel with the largest
    ``calls x best latency`` (its share of the model's time), discounted by the batches it
    already had. Kernels at their cap are retired; past the deadline nothing new starts.
    """

    def __init__(self, progress: TuningProgress, deadline: float | None):
        super().__init__()
        self.progress = progress
        self.deadline = deadline
        self.stopped_by = "budget"
        self.interrupted = False
        self._batches: dict[int, int] = {}
        self._sent: set[int] = set()

    def next_task_id(self) -> int:
        outer = self._outer()
        records = outer.tasks_
        for task_id in sorted(self._sent):  # serial: a batch is measured before the next starts
            self._sent.discard(task_id)
            if not records[task_id].is_terminated:
                outer.join_running_task(task_id)
        for task_id, record in enumerate(records):
            state = self.progress.tasks[task_id]
            if not record.is_terminated and state.trials >= state.cap:
                outer.terminate_task(task_id)
            if records[task_id].is_terminated:
                self.progress.finished(task_id)
        if self.interrupted:
            self.stopped_by = "interrupted"
            return -1
        if self.progress.trials >= self.progress.budget:  # hand re-measurements count too
            self.stopped_by = "budget"
            return -1
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.stopped_by = "time limit"
            return -1
        live = [i for i, record in enumerate(records) if not record.is_terminated]
        if not live:
            self.stopped_by = "every kernel reached its cap or exhausted its search space"
            return -1
        fresh = [i for i in live if i not in self._batches]
        choice = fresh[0] if fresh else max(live, key=self._priority)
        self._batches[choice] = self._batches.get(choice, 0) + 1
        self._sent.add(choice)
        return choice

    def _priority(self, task_id: int) -> float:
        task = self.progress.tasks[task_id]
        best = task.best_overall_us
        share = task.weight * (best if math.isfinite(best) else 1e9)
        return share / (1 + self._batches[task_id])


@contextlib.contextmanager
def stop_on_sigint(scheduler, say):
    """First Ctrl-C: start no new batch (the one being measured is kept); second: stop at once.

    A KeyboardInterrupt raised inside MetaSchedule's C++ loop is swallowed there, so the
    scheduler is asked to stop instead; every record measured so far is already on disk.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def first(_signum, _frame):
        scheduler.interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        say("interrupted: finishing the batch being measured (Ctrl-C again stops at once)")

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
