"""Latency statistics that bench, run and profile report alike: a median alone cannot tell noise
from a result, so every report carries the spread, the samples and the machine's load."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

# p90 more than 20 % above the median: one run in ten was slowed by something else (another
# process, frequency changes); ratios between runners timed in the same rounds still hold.
NOISY_SPREAD = 1.2


@dataclasses.dataclass(frozen=True)
class LatencyStats:
    """Milliseconds over ``count`` timed calls; ``per_s``: calls per second one caller gets."""

    count: int
    min_ms: float
    median_ms: float
    mean_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> LatencyStats:
        if not seconds:
            raise ValueError("no timed calls")
        ms = np.asarray(seconds, dtype=np.float64) * 1e3
        p90, p99 = np.percentile(ms, [90, 99])
        return cls(len(ms), float(ms.min()), float(np.median(ms)), float(ms.mean()), float(p90), float(p99),
                   float(ms.max()))

    @property
    def per_s(self) -> float:
        return 1e3 / self.mean_ms

    @property
    def spread(self) -> float:
        return self.p90_ms / self.median_ms

    @property
    def noisy(self) -> bool:
        return self.count >= 10 and self.spread > NOISY_SPREAD

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "per_s": self.per_s, "p90_over_median": self.spread}

    def line(self) -> str:
        """``min 1.02 / median 1.10 / p90 1.31 / p99 1.52 / max 1.60 ms, 890/s``"""
        return (f"min {self.min_ms:.3f} / median {self.median_ms:.3f} / p90 {self.p90_ms:.3f} / "
                f"p99 {self.p99_ms:.3f} / max {self.max_ms:.3f} ms over {self.count} runs, "
                f"{self.per_s:,.0f} calls/s")


def load_average() -> float:
    """The machine's 1-minute load average (0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def noise_warning(stats: dict[str, LatencyStats], cores: int, load_before: float, load_after: float) -> str | None:
    """One line when the spread or the load says the numbers are noisy; None when they look clean."""
    noisy = [name for name, s in stats.items() if s.noisy]
    busy = max(load_before, load_after) > cores
    if not noisy and not busy:
        return None
    why = []
    if noisy:
        why.append(f"p90 over {NOISY_SPREAD:g}x the median for {', '.join(noisy)}")
    if busy:
        why.append(f"load average {max(load_before, load_after):.1f} on {cores} cores")
    return (f"noisy machine ({'; '.join(why)}): compare ratios measured in the same rounds, "
            "or rerun on a quiet machine")
