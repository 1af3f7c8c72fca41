"""``smetric report``: a markdown table and PNG plots from one or more sweeps (``sweep.json``, as
``smetric sweep --out`` writes them).

For each sweep (a workload at one SLO setting) and policy: the peak TPS under SLO and its ratio
to the best baseline (every policy but ``smetric`` and its ablations, ``smetric*``); and, at the
sweep's common load, P50/P90/P99 TTFT and TPOT, SLO attainment, cache hit by tier, migrations and
load imbalance. Plots per sweep: TPS against P90 TTFT, SLO attainment against the load factor, and
the per-instance load over time of ``smetric`` and the best baseline.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from smetric.workload.sweep import SWEEP_FORMAT

REPORT_NAME = "report.md"


def is_baseline(policy: str) -> bool:
    return not policy.startswith("smetric")


def load_sweep(path: str | Path) -> dict[str, Any]:
    """A sweep document, checked enough that the report can rely on its shape."""
    p = Path(path)
    if p.is_dir():
        p = p / "sweep.json"
    try:
        raw = p.read_bytes()
        doc = json.loads(gzip.decompress(raw) if p.suffix == ".gz" else raw)
    except FileNotFoundError:
        raise ValueError(f"{p}: no such file (write one with smetric sweep --out)") from None
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: not readable JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != SWEEP_FORMAT:
        raise ValueError(f"{p}: not a sweep (expected format {SWEEP_FORMAT!r})")
    try:
        _check(doc)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{p}: malformed sweep ({e})") from e
    doc["_path"] = str(p)
    return doc


def _check(doc: dict[str, Any]) -> None:
    _require(doc, "workload", "workers", "profile", "slo", "common_factor", "policies", where="")
    _require(doc["workload"], "name", where="workload")
    _require(doc["slo"], "tpot_slo_ms", where="slo")
    if not doc["policies"]:
        raise ValueError("no policies")
    for name, entry in doc["policies"].items():
        _require(entry, "peak_tps", "points", "load_over_time", where=name)
        _require(entry["load_over_time"], "t_s", "instances", where=name)
        if not entry["points"]:
            raise ValueError(f"{name}: no points")
        for point in entry["points"]:
            _require(point, "factor", "tps", "meets_slo", where=name)


def _cluster(doc: dict[str, Any]) -> str:
    pd = doc.get("pd")
    if pd:
        return f"PD {pd['prefill']} prefill + {pd['decode']} decode workers"
    return f"{doc['workers']} workers"


def _require(obj: Any, *keys: str, where: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where or 'the document'} must be an object")
    if missing := [k for k in keys if k not in obj]:
        raise ValueError(f"{where + ': ' if where else ''}missing {', '.join(missing)}")


def label(doc: dict[str, Any]) -> str:
    slo = doc["slo"]
    ttft = (
        f"TTFT <= {slo['ttft_slo_ms']:g} ms"
        if slo.get("ttft_slo_ms") is not None
        else f"TTFT <= {slo['ttft_slo_scale']:g}x idle"
    )
    return f"{doc['workload']['name']}, {_cluster(doc)}, {ttft}"


def best_baseline(doc: dict[str, Any]) -> str | None:
    peaks = {name: e["peak_tps"] for name, e in doc["policies"].items() if is_baseline(name)}
    return max(peaks, key=lambda name: peaks[name]) if peaks else None


def point_at(entry: dict[str, Any], factor: float) -> dict[str, Any]:
    """The point run at ``factor``; else the nearest one (for sweeps cut short)."""
    points: list[dict[str, Any]] = entry["points"]
    return min(points, key=lambda p: abs(p["factor"] - factor))


def rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per policy: peak, ratio to the best baseline, the point at the common load."""
    best = best_baseline(doc)
    best_peak = doc["policies"][best]["peak_tps"] if best else 0.0
    out = []
    for name, entry in doc["policies"].items():
        out.append(
            {
                "policy": name,
                "peak_tps": entry["peak_tps"],
                "ratio": entry["peak_tps"] / best_peak if best_peak else None,
                "max_load": max(
                    (p["factor"] for p in entry["points"] if p["meets_slo"]), default=0.0
                ),
                "at": point_at(entry, doc["common_factor"]),
            }
        )
    return out


def _num(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, fmt)


def _triple_ms(point: dict[str, Any], metric: str) -> str:
    return " / ".join(_num(point.get(f"{metric}_{q}_s"), ".1f", 1e3) for q in ("p50", "p90", "p99"))


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def render_markdown(docs: Sequence[dict[str, Any]], plots: dict[int, list[Path]]) -> str:
    lines = [
        "# Evaluation report",
        "",
        "Simulated load sweeps (`smetric sweep`). **Peak TPS under SLO**: the highest tokens/s "
        "(prompt + output) at which P90 TTFT <= the TTFT SLO and P90 TPOT <= the TPOT SLO "
        "(SPEC §4). Ratios are to the best baseline, i.e. the best policy other than `smetric` "
        "and its ablations. After each: the highest load factor run that met the SLO (TPS is "
        "measured over the makespan, which near saturation the last requests' drain decides; "
        "the load factor is the steadier measure of capacity).",
        "",
        "## Peak TPS under SLO (ratio to the best baseline) · highest load under SLO",
        "",
    ]
    labels = [label(d) for d in docs]
    policies = list(dict.fromkeys(name for d in docs for name in d["policies"]))
    lines.append("| policy | " + " | ".join(labels) + " |")
    lines.append("|---|" + "---:|" * len(docs))
    table = [{r["policy"]: r for r in rows(d)} for d in docs]
    for name in policies:
        cells = []
        for t in table:
            r = t.get(name)
            cells.append(
                ""
                if r is None
                else f"{r['peak_tps']:.0f} ({_ratio(r['ratio'])}) · x{r['max_load']:.3g}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for i, (doc, lab) in enumerate(zip(docs, labels, strict=True)):
        slo = doc["slo"]
        tier = "on" if doc.get("global_tier") else "off"
        lines += [
            "",
            f"## {lab}",
            "",
            f"From `{doc['_path']}`: {doc['workload'].get('requests', '?')} requests, "
            f"{_cluster(doc)}, profile `{doc['profile']}`, global KV tier {tier}; "
            f"TPOT SLO {slo['tpot_slo_ms']:g} ms, {slo.get('attainment', 0.9):.0%} of requests "
            f"within each SLO. Latencies, hits, migrations and imbalance at the common load "
            f"x{doc['common_factor']:g} (the highest load every policy met, else the lowest run). "
            "Load imbalance: max / mean prompt tokens served per instance.",
            "",
            "| policy | peak TPS | vs best baseline | TTFT P50 / P90 / P99 ms "
            "| TPOT P50 / P90 / P99 ms | SLO attained | local hit | global hit | migrations "
            "| load imbalance |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows(doc):
            p = r["at"]
            lines.append(
                f"| {r['policy']} | {r['peak_tps']:.0f} | {_ratio(r['ratio'])} "
                f"| {_triple_ms(p, 'ttft')} | {_triple_ms(p, 'tpot')} "
                f"| {_num(p.get('slo_attainment'), '.1%')} | {_num(p.get('local_hit'), '.1%')} "
                f"| {_num(p.get('global_hit'), '.1%')} | {p.get('migrations', '-')} "
                f"| {_num(p.get('load_imbalance'), '.2f')} |"
            )
        if plots.get(i):
            lines.append("")
            lines += [f"![{path.stem}]({path.name})" for path in plots[i]]
    return "\n".join(lines) + "\n"


# ---- plots ----------------------------------------------------------------------------------


def _figure(width: float, height: float) -> Any:
    # The Agg canvas directly: no pyplot, so no global backend state and no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _by_factor(entry: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(entry["points"], key=lambda p: p["factor"])


def plot_tps_vs_ttft(doc: dict[str, Any], path: Path) -> None:
    fig = _figure(6.4, 4.4)
    ax = fig.add_subplot()
    for name, entry in doc["policies"].items():
        pts = [p for p in _by_factor(entry) if p.get("ttft_p90_s") is not None]
        ax.plot(
            [1e3 * p["ttft_p90_s"] for p in pts], [p["tps"] for p in pts], marker="o", label=name
        )
    ax.set_xscale("log")
    ax.set_xlabel("P90 TTFT (ms)")
    ax.set_ylabel("TPS (prompt + output tokens/s)")
    ax.set_title(label(doc), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path)


def plot_attainment(doc: dict[str, Any], path: Path) -> None:
    fig = _figure(6.4, 4.4)
    ax = fig.add_subplot()
    for name, entry in doc["policies"].items():
        pts = _by_factor(entry)
        ax.plot(
            [p["factor"] for p in pts],
            [p.get("slo_attainment", 0.0) for p in pts],
            marker="o",
            label=name,
        )
    ax.axhline(doc["slo"].get("attainment", 0.9), color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("load factor (arrivals x f)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.02)
    ax.set_title(label(doc), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path)


def plot_load(doc: dict[str, Any], path: Path) -> None:
    """Requests in the system and queued prefill per instance, for smetric and the best
    baseline side by side."""
    names = [n for n in ("smetric", best_baseline(doc)) if n and n in doc["policies"]]
    names = names or list(doc["policies"])[:1]
    fig = _figure(5.0 * len(names), 6.0)
    axes = fig.subplots(2, len(names), squeeze=False, sharex="col", sharey="row")
    for col, name in enumerate(names):
        series = doc["policies"][name]["load_over_time"]
        t = series["t_s"]
        for inst, s in series["instances"].items():
            in_system = [r + w for r, w in zip(s["running"], s["waiting"], strict=True)]
            axes[0][col].plot(t, in_system, linewidth=1, drawstyle="steps-post", label=inst)
            axes[1][col].plot(
                t, s["queued_prefill_tokens"], linewidth=1, drawstyle="steps-post", label=inst
            )
        axes[0][col].set_title(f"{name} at x{doc['common_factor']:g}", fontsize=9)
        axes[1][col].set_xlabel("time (s)")
    axes[0][0].set_ylabel("requests running + waiting")
    axes[1][0].set_ylabel("queued prefill tokens")
    if len(next(iter(doc["policies"].values()))["load_over_time"]["instances"]) <= 16:
        axes[0][-1].legend(fontsize=7, ncol=2)
    fig.suptitle(label(doc), fontsize=9)
    fig.savefig(path)


def write_report(out_dir: str | Path, sweeps: Sequence[str | Path]) -> Path:
    """Reads the sweeps, writes ``out_dir/report.md`` and its PNGs; returns the report's path."""
    if not sweeps:
        raise ValueError("no sweeps to report on")
    docs = [load_sweep(s) for s in sweeps]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots: dict[int, list[Path]] = {}
    for i, doc in enumerate(docs):
        suffix = f"-{i + 1}" if len(docs) > 1 else ""
        plots[i] = []
        for kind, draw in (
            ("tps-vs-p90-ttft", plot_tps_vs_ttft),
            ("slo-attainment", plot_attainment),
            ("load-over-time", plot_load),
        ):
            path = out / f"{kind}{suffix}.png"
            draw(doc, path)
            plots[i].append(path)
    report = out / REPORT_NAME
    report.write_text(render_markdown(docs, plots), encoding="utf-8")
    return report
