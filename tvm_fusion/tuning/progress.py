"""Live tuning progress: tasks done, trials, best latency per task, elapsed and ETA.

On a terminal the block is redrawn in place; otherwise (CI logs, pipes) one summary line is
printed per measured batch. MetaSchedule's own tables go to the store's logs/ instead.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import TextIO

from ..report import table


@dataclasses.dataclass
class TaskProgress:
    name: str
    weight: int
    cap: int              # trials this run may spend on it
    before: int           # trials already in the log when this run started
    hand_us: float | None
    trials: int = 0       # measured in this run
    best_us: float = math.inf
    done: bool = False

    @property
    def best_overall_us(self) -> float:
        return min(self.best_us, self.hand_us if self.hand_us is not None else math.inf)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _us(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.1f}"


class TuningProgress:
    """Collects per-task results; ``show`` draws them (quietly does nothing when disabled)."""

    def __init__(self, tasks: list[TaskProgress], budget: int, time_limit_s: float | None,
                 enabled: bool = True, live: bool | None = None):
        self.tasks = tasks
        self.budget = budget
        self.time_limit_s = time_limit_s
        self.enabled = enabled
        self.live = live if live is not None else sys.stderr.isatty()
        self.started = time.monotonic()
        self._drawn_lines = 0
        self._last: TaskProgress | None = None

    @property
    def trials(self) -> int:
        return sum(task.trials for task in self.tasks)

    def measured(self, index: int, latencies_us: list[float | None]) -> None:
        task = self._last = self.tasks[index]
        task.trials += len(latencies_us)
        for latency in latencies_us:
            if latency is not None:
                task.best_us = min(task.best_us, latency)
        self.show()

    def hand_measured(self, index: int, latency_us: float | None) -> None:
        """A re-measurement of the hand schedule: a trial, and maybe a better hand time."""
        task = self.tasks[index]
        task.trials += 1
        if latency_us is not None:
            task.hand_us = latency_us if task.hand_us is None else min(task.hand_us, latency_us)

    def finished(self, index: int) -> None:
        self.tasks[index].done = True

    def eta_s(self) -> float:
        elapsed = time.monotonic() - self.started
        if self.trials == 0:
            return math.inf
        eta = elapsed / self.trials * max(self.budget - self.trials, 0)
        if self.time_limit_s:
            eta = min(eta, max(self.time_limit_s - elapsed, 0.0))
        return eta

    def summary_line(self) -> str:
        elapsed = time.monotonic() - self.started
        done = sum(task.done for task in self.tasks)
        return (f"[{_duration(elapsed):>6}] tasks done {done}/{len(self.tasks)}  "
                f"trials {self.trials}/{self.budget}  ETA {_duration(self.eta_s())}")

    def table(self) -> str:
        rows = [[task.name, task.weight, f"{task.before + task.trials}/{task.before + task.cap}",
                 _us(task.hand_us), _us(task.best_us),
                 "done" if task.done else ""] for task in self.tasks]
        return table(["kernel", "calls", "trials", "hand us", "tuned us", ""], rows, "lrrrrl")

    @property
    def stream(self) -> TextIO:
        """Looked up on each draw: native-log capture swaps sys.stderr while tuning runs."""
        return sys.stderr

    def show(self) -> None:
        if not self.enabled:
            return
        if not self.live:
            latest = self._last
            detail = (f"  {latest.name}: {latest.before + latest.trials} trials, best "
                      f"{_us(latest.best_overall_us)} us" if latest else "")
            print(self.summary_line() + detail, file=self.stream, flush=True)
            return
        block = [self.summary_line(), *self.table().splitlines()]
        if self._drawn_lines:
            self.stream.write(f"\x1b[{self._drawn_lines}F")
        self.stream.write("".join(f"\x1b[2K{line}\n" for line in block))
        self.stream.flush()
        self._drawn_lines = len(block)
