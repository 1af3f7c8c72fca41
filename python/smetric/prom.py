"""Prometheus text exposition (the emulated worker's ``sglang:`` metrics, the router's own)."""

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
    E2E_BUCKETS = (*TTFT_BUCKETS, 800.0, 1200.0, 2400.0)
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
    return "{" + ",".join(parts) + "}" if parts else ""


def _histogram_lines(full: str, h: Histogram, labels: Mapping[str, str]) -> list[str]:
    lines = [f"# TYPE {full} histogram"]
    cumulative = 0
    for bound, count in zip(h.buckets, h.counts, strict=False):
        cumulative += count
        le = _labels(labels, 'le="' + str(bound) + '"')
        lines.append(f"{full}_bucket{le} {cumulative}")
    le = _labels(labels, 'le="+Inf"')
    lines.append(f"{full}_bucket{le} {h.count}")
    lab = _labels(labels)
    lines.append(f"{full}_sum{lab} {h.total}")
    lines.append(f"{full}_count{lab} {h.count}")
    return lines


def render_metrics(
    labels: Mapping[str, str],
    gauges: Mapping[str, float],
    counters: Mapping[str, float],
    histograms: Mapping[str, Histogram],
    prefix: str = "sglang:",
) -> str:
    """One series per name, all with the same labels."""
    lines = []
    lab = _labels(labels)
    for name, value in gauges.items():
        lines += [f"# TYPE {prefix}{name} gauge", f"{prefix}{name}{lab} {value}"]
    for name, value in counters.items():
        lines += [f"# TYPE {prefix}{name} counter", f"{prefix}{name}{lab} {value}"]
    for name, h in histograms.items():
        lines += _histogram_lines(prefix + name, h, labels)
    return "\n".join(lines) + "\n"


def render_families(
    prefix: str,
    families: Mapping[str, tuple[str, Mapping[tuple[tuple[str, str], ...], float]]],
    histograms: Mapping[str, Histogram],
) -> str:
    """Labelled series: ``families[name] = (type, {((label, value), ...): number})``."""
    lines = []
    for name, (kind, series) in families.items():
        lines.append(f"# TYPE {prefix}{name} {kind}")
        for labels, value in series.items():
            lines.append(f"{prefix}{name}{_labels(dict(labels))} {value}")
    for name, h in histograms.items():
        lines += _histogram_lines(prefix + name, h, {})
    return "\n".join(lines) + "\n"


_SAMPLE_SUFFIXES = frozenset(
    ("", "_bucket", "_sum", "_count", "_total", "_created", "_gcount", "_gsum", "_info")
)


def merge_worker_metrics(answers: Sequence[tuple[str, str]]) -> str:
    """Workers' ``/metrics`` (URL, text) merged into one exposition, as sglang-router's
    ``/engine_metrics`` merges them: each family once (its HELP and TYPE as the first worker to
    declare them gave them), then every worker's samples of it, each labelled ``worker_addr``
    with its worker's URL; ``:`` in names becomes ``_``. A sample belongs to the family declared
    last before it when its name is that family's, or that with a suffix of a sample of one (a
    histogram's ``_bucket``, ``_sum``, ``_count``, ...), to a family of its own otherwise."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # name: (HELP/TYPE lines, samples)
    for url, text in answers:
        worker = 'worker_addr="' + url.replace("\\", "\\\\").replace('"', '\\"') + '"'
        family = None
        for line in text.splitlines():
            line = line.strip()
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2].replace(":", "_")
                    meta = families.setdefault(family, ([], []))[0]
                    if not any(m.startswith(f"# {parts[1]} ") for m in meta):
                        meta.append(" ".join(["#", parts[1], family, *parts[3:]]))
                continue
            ends = (line.find("{"), line.find(" "), line.find("\t"))
            cut = min((i for i in ends if i >= 0), default=len(line))
            name, rest = line[:cut].replace(":", "_"), line[cut:]
            if rest.startswith("{"):
                sep = "" if rest.startswith("{}") else ","
                sample = name + "{" + worker + sep + rest[1:]
            else:
                sample = name + "{" + worker + "}" + rest
            owner = name
            if family is not None and name[len(family) :] in _SAMPLE_SUFFIXES:
                owner = family if name.startswith(family) else name
            families.setdefault(owner, ([], []))[1].append(sample)
    lines: list[str] = []
    for meta, samples in families.values():
        lines += [*meta, *samples, ""]
    return "\n".join(lines)
