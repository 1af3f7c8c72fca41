"""Prometheus text exposition of the emulated worker's ``sglang:`` metrics."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence


class Histogram:
    # SGLang's buckets (seconds), abridged.
    TTFT_BUCKETS = (
        0.1,
        0.2,
        0.4,
        0.6,
        0.8,
        1.0,
        2.0,
        4.0,
        6.0,
        8.0,
        10.0,
        20.0,
        40.0,
        60.0,
        80.0,
        100.0,
        200.0,
        400.0,
    )
    E2E_BUCKETS = (
        0.1,
        0.2,
        0.4,
        0.6,
        0.8,
        1.0,
        2.0,
        4.0,
        6.0,
        8.0,
        10.0,
        20.0,
        40.0,
        60.0,
        80.0,
        100.0,
        200.0,
        400.0,
        800.0,
        1200.0,
        2400.0,
    )
    ITL_BUCKETS = (
        0.002,
        0.004,
        0.006,
        0.008,
        0.010,
        0.015,
        0.020,
        0.025,
        0.030,
        0.035,
        0.040,
        0.060,
        0.080,
        0.100,
        0.200,
        0.400,
        0.600,
        0.800,
        1.0,
        2.0,
        4.0,
        6.0,
        8.0,
    )

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


def _labels(labels: Mapping[str, str], extra: str = "") -> str:
    parts = [f'{k}="{v}"' for k, v in labels.items()]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}"


def render_metrics(
    labels: Mapping[str, str],
    gauges: Mapping[str, float],
    counters: Mapping[str, float],
    histograms: Mapping[str, Histogram],
) -> str:
    lines = []
    lab = _labels(labels)
    for name, value in gauges.items():
        lines += [f"# TYPE sglang:{name} gauge", f"sglang:{name}{lab} {value}"]
    for name, value in counters.items():
        lines += [f"# TYPE sglang:{name} counter", f"sglang:{name}{lab} {value}"]
    for name, h in histograms.items():
        lines.append(f"# TYPE sglang:{name} histogram")
        cumulative = 0
        for bound, count in zip(h.buckets, h.counts, strict=False):
            cumulative += count
            le = _labels(labels, 'le="' + str(bound) + '"')
            lines.append(f"sglang:{name}_bucket{le} {cumulative}")
        le = _labels(labels, 'le="+Inf"')
        lines.append(f"sglang:{name}_bucket{le} {h.count}")
        lines.append(f"sglang:{name}_sum{lab} {h.total}")
        lines.append(f"sglang:{name}_count{lab} {h.count}")
    return "\n".join(lines) + "\n"
