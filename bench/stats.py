"""Small statistics over measured samples."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(samples: Sequence[float], pct: float) -> float:
    """The `pct` percentile (nearest rank) of `samples`; NaN when there are none."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def latency_summary(seconds: Sequence[float]) -> dict[str, float | int]:
    """p50, p99 and max in milliseconds, and the sample count."""
    return {
        "p50_ms": round(percentile(seconds, 50) * 1000, 4),
        "p99_ms": round(percentile(seconds, 99) * 1000, 4),
        "max_ms": round(max(seconds) * 1000, 4) if seconds else math.nan,
        "samples": len(seconds),
    }


def rate(count: int, seconds: float) -> float:
    """Items per second, rounded."""
    return round(count / seconds, 1) if seconds > 0 else math.nan
