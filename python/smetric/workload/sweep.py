"""Load sweeps in the simulator: each policy's peak TPS under SLO (SPEC §4).

For a load factor f, arrivals come f times faster (trace timestamps and session start gaps divided
by f, think times too). A run meets the SLO when at least 90% of requests have TTFT within their
TTFT SLO (k x their TTFT alone on an idle instance, k = 5) and at least 90% have mean TPOT within
the TPOT SLO (100 ms). TPS = prompt + output tokens served / the run's makespan. The sweep raises
f along a geometric ladder, bisects between the last load that met the SLO and the first that did
not, and reports the highest TPS among the runs that met the SLO.

``write_sweep`` saves a sweep as JSON (``sweep.json``, read by ``smetric report``): every point,
and, at one load all policies ran (the highest factor every policy met, else the first step), each
policy's per-instance load over time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from smetric.engine import GlobalTierConfig
from smetric.perf import Profile
from smetric.policies import Policy, PolicyConfig, SMetricConfig, make_policy
from smetric.policies.smetric import SMetric
from smetric.sim import SimRequest, SimResult, policy_route, simulate
from smetric.slo import SLOConfig, SLOModel

ATTAINMENT = 0.9
"""Share of requests that must meet each SLO for a run to count as under SLO (P90)."""
LADDER = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0)


@dataclass(frozen=True)
class Point:
    policy: str
    factor: float
    tps: float
    ttft_attainment: float
    tpot_attainment: float
    ttft_p90_s: float
    local_hit: float
    global_hit: float
    meets_slo: bool
    requests: int = 0
    errors: int = 0
    slo_attainment: float = 0.0
    """Share of requests meeting both their TTFT SLO and the TPOT SLO."""
    ttft_p50_s: float = math.inf
    ttft_p99_s: float = math.inf
    tpot_p50_s: float = math.inf
    tpot_p90_s: float = math.inf
    tpot_p99_s: float = math.inf
    decisions: dict[str, int] = field(default_factory=dict)
    """Routing decisions by reason."""
    migrations: int = 0
    """Decisions whose reason starts with ``migrate``."""
    load_imbalance: float = 1.0
    """Max over mean of the prompt tokens each instance served (1 = even)."""


def load_workload(
    trace: str,
    path: str | None,
    profile: Profile,
    limit: int | None = None,
    closed_loop: bool = False,
    copies: int = 1,
    sessions: int | None = None,
    seed: int = 0,
) -> list[SimRequest]:
    """The requests of ``smetric sweep --trace ...`` at load x1: ``mooncake`` and ``bailian``
    (``path`` required; ``closed_loop``: a next turn waits for its previous answer), ``agents``
    (``path`` or the bundled slice; ``copies`` of each session, started 2 s apart per copy, 2 s
    think time) or ``generated`` (``sessions``, ``seed``). ValueError for a bad combination or
    an unreadable trace (OSError passes through)."""
    if closed_loop and trace not in ("mooncake", "bailian"):
        raise ValueError("--closed-loop is for --trace mooncake or bailian")
    if sessions is not None and (trace != "generated" or sessions < 1):
        raise ValueError("--sessions (>= 1) is for --trace generated")
    if trace in ("mooncake", "bailian"):
        from smetric.workload.bailian import load_bailian
        from smetric.workload.mooncake import load_mooncake
        from smetric.workload.sessions import idle_service_time

        if not path:
            raise ValueError(f"--trace {trace} needs --path")
        load = load_mooncake if trace == "mooncake" else load_bailian
        return load(path, limit, closed_loop, idle_service_time(profile))
    if trace == "generated":
        from smetric.workload.generator import AgentWorkloadSpec, generate

        if limit is not None:
            raise ValueError("--trace generated takes --sessions, not --limit")
        return generate(AgentWorkloadSpec(sessions=sessions or AgentWorkloadSpec.sessions), seed)
    from smetric.workload.agents import load_sessions, replicate, sim_requests

    agents = replicate(load_sessions(path, limit=limit), copies)
    # Sessions start 2 s apart (copies: the same rate per copy), think 2 s between turns.
    return sim_requests(agents, 2.0 / copies, 2.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The value at rank ``int(q * (n - 1))`` of the sorted values (inf when there are none)."""
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))] if ordered else math.inf


def scale_arrivals(requests: Sequence[SimRequest], factor: float) -> list[SimRequest]:
    return [
        replace(
            r,
            arrival_s=None if r.arrival_s is None else r.arrival_s / factor,
            delay_s=r.delay_s / factor,
        )
        for r in requests
    ]


def evaluate(
    policy: str, factor: float, result: SimResult, slo: SLOModel, attainment: float = ATTAINMENT
) -> Point:
    ok = result.ok()
    n = max(len(result.requests), 1)
    ttft_ok = {
        r.rid for r in ok if r.ttft_s is not None and r.ttft_s <= slo.ttft_slo_s(r.prompt_tokens)
    }
    tpot_ok = {r.rid for r in ok if (r.tpot_s or 0.0) <= slo.tpot_slo_s}
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    prompt = sum(r.prompt_tokens for r in ok) or 1
    tokens = sum(r.prompt_tokens + r.output_tokens for r in ok)
    # Instances the policy chose among: all of them, or the prefill ones in PD (named p<i>).
    chosen = [w for w in result.load if not w.startswith("d")] or list(result.load)
    served = dict.fromkeys(chosen, 0)
    for r in ok:
        served[r.worker] = served.get(r.worker, 0) + r.prompt_tokens
    mean_served = sum(served.values()) / max(len(served), 1)
    return Point(
        policy,
        factor,
        tokens / max(result.makespan_s, 1e-9),
        len(ttft_ok) / n,
        len(tpot_ok) / n,
        percentile(ttfts, 0.9),
        sum(r.local_cached_tokens for r in ok) / prompt,
        sum(r.global_cached_tokens for r in ok) / prompt,
        len(ttft_ok) / n >= attainment and len(tpot_ok) / n >= attainment,
        requests=len(result.requests),
        errors=len(result.requests) - len(ok),
        slo_attainment=len(ttft_ok & tpot_ok) / n,
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p99_s=percentile(ttfts, 0.99),
        tpot_p50_s=percentile(tpots, 0.5),
        tpot_p90_s=percentile(tpots, 0.9),
        tpot_p99_s=percentile(tpots, 0.99),
        decisions=dict(sorted(result.decisions.items())),
        migrations=sum(c for reason, c in result.decisions.items() if reason.startswith("migrate")),
        load_imbalance=max(served.values()) / mean_served if mean_served else 1.0,
    )


ABLATIONS: dict[str, dict[str, Any]] = {
    "smetric-no-slo-gate": {"slo_gate": False},
    "smetric-no-migration": {"migration": False},
    "smetric-no-turn-detection": {"turn_detection": False},
    "smetric-load-delay": {"load_metric": "delay"},
    "smetric-load-requests": {"load_metric": "requests"},
}
"""SMetric's ablations under sweepable names (the router's ablation flags, one each)."""


def sweep_policy(
    name: str,
    profile: Profile,
    global_tier: GlobalTierConfig | None,
    slo_config: SLOConfig = SLOConfig(),
) -> Policy:
    """A policy by name, or an SMetric ablation from ``ABLATIONS``. SMetric gets the sweep's own
    profile, SLOs and global tier (or none), as the router's flags give them to it."""
    ablation = ABLATIONS.get(name)
    if name != "smetric" and ablation is None:
        return make_policy(name)
    slo = replace(
        slo_config,
        global_tier=global_tier is not None,
        global_load_bytes_per_s=(global_tier or GlobalTierConfig()).load_bytes_per_s,
        global_load_latency_s=(global_tier or GlobalTierConfig()).load_latency_s,
    )
    cfg = SMetricConfig(profile=profile.name, slo=slo, **(ablation or {}))
    return SMetric(PolicyConfig(smetric=cfg), profile)


def run_at(
    requests: Sequence[SimRequest],
    policy: str,
    factor: float,
    profile: Profile,
    workers: int,
    global_tier: GlobalTierConfig | None,
    slo_config: SLOConfig = SLOConfig(),
    pd: tuple[int, int] | None = None,
    routed_index: bool = True,
) -> SimResult:
    """One simulated run of ``policy`` at load factor ``factor`` (deterministic). With ``pd``,
    the policy picks prefill workers and decode goes to the least loaded decode worker. Policies
    see hits as the router does (``routed_index``, see ``policy_route``) unless told otherwise."""
    return simulate(
        scale_arrivals(requests, factor),
        policy_route(
            sweep_policy(policy, profile, global_tier, slo_config), routed_index=routed_index
        ),
        profile,
        workers,
        global_tier=global_tier,
        pd=pd,
    )


def sweep(
    requests: Sequence[SimRequest],
    policies: Sequence[str],
    profile: Profile,
    workers: int = 16,
    global_tier: GlobalTierConfig | None = GlobalTierConfig(),
    ladder: Sequence[float] = LADDER,
    refine: int = 3,
    progress: Callable[[Point], None] | None = None,
    slo_config: SLOConfig = SLOConfig(),
    pd: tuple[int, int] | None = None,
    routed_index: bool = True,
) -> dict[str, list[Point]]:
    """Climbs ``ladder`` until the SLO breaks, then bisects ``refine`` times between the last
    load that met it and the first that did not."""
    slo = SLOModel(profile, slo_config)
    out: dict[str, list[Point]] = {}
    for name in policies:
        points: list[Point] = []

        def run(factor: float, name: str = name, points: list[Point] = points) -> Point:
            result = run_at(
                requests, name, factor, profile, workers, global_tier, slo_config, pd, routed_index
            )
            point = evaluate(name, factor, result, slo)
            points.append(point)
            if progress:
                progress(point)
            return point

        good = None
        for factor in ladder:
            if not run(factor).meets_slo:
                if good is not None:
                    lo, hi = good, factor
                    for _ in range(refine):
                        mid = (lo * hi) ** 0.5
                        lo, hi = (mid, hi) if run(mid).meets_slo else (lo, mid)
                break
            good = factor
        out[name] = points
    return out


def peak_tps(points: Sequence[Point]) -> float:
    return max((p.tps for p in points if p.meets_slo), default=0.0)


def common_factor(results: dict[str, list[Point]]) -> float:
    """The highest load factor every policy ran and met the SLO at; else the lowest factor run
    (the ladder's first step, which every policy runs)."""
    met = [{p.factor for p in points if p.meets_slo} for points in results.values()]
    shared = set.intersection(*met) if met else set()
    if shared:
        return max(shared)
    return min((p.factor for points in results.values() for p in points), default=1.0)


def load_over_time(result: SimResult, max_samples: int = 300) -> dict[str, Any]:
    """Per-instance load samples of a run, thinned evenly to at most ``max_samples``."""
    first = next(iter(result.load.values()), [])
    stride = max(1, math.ceil(len(first) / max_samples))
    return {
        "t_s": [s.t_s for s in first[::stride]],
        "instances": {
            name: {
                "running": [s.running for s in samples[::stride]],
                "waiting": [s.waiting for s in samples[::stride]],
                "used_tokens": [s.used_tokens for s in samples[::stride]],
                "queued_prefill_tokens": [s.queued_prefill_tokens for s in samples[::stride]],
            }
            for name, samples in result.load.items()
        },
    }


def _finite(value: Any) -> Any:
    """JSON has no infinity: a metric with no data (inf) is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


SWEEP_FORMAT = "smetric-sweep/1"


def write_sweep(
    out_dir: str | Path,
    workload: dict[str, Any],
    requests: Sequence[SimRequest],
    results: dict[str, list[Point]],
    profile: Profile,
    workers: int,
    global_tier: GlobalTierConfig | None,
    slo_config: SLOConfig = SLOConfig(),
    ladder: Sequence[float] = LADDER,
    refine: int = 3,
    pd: tuple[int, int] | None = None,
    routed_index: bool = True,
) -> Path:
    """Writes ``out_dir/sweep.json``; re-runs each policy at the common load (runs are
    deterministic) for its per-instance load over time. Returns the file's path."""
    factor = common_factor(results)
    policies: dict[str, Any] = {}
    for name, points in results.items():
        run = run_at(
            requests, name, factor, profile, workers, global_tier, slo_config, pd, routed_index
        )
        policies[name] = {
            "peak_tps": peak_tps(points),
            "points": [asdict(p) for p in points],
            "load_over_time": load_over_time(run),
        }
    doc = {
        "format": SWEEP_FORMAT,
        "workload": workload,
        "workers": workers,
        "pd": None if pd is None else {"prefill": pd[0], "decode": pd[1]},
        "hits_seen_as": "router" if routed_index else "engines",
        "profile": profile.name,
        "global_tier": None if global_tier is None else asdict(global_tier),
        "slo": {
            "ttft_slo_scale": slo_config.ttft_slo_scale,
            "ttft_slo_ms": slo_config.ttft_slo_ms,
            "tpot_slo_ms": slo_config.tpot_slo_ms,
            "attainment": ATTAINMENT,
        },
        "ladder": list(ladder),
        "refine": refine,
        "common_factor": factor,
        "policies": policies,
    }
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    path = path / "sweep.json"
    path.write_text(json.dumps(_finite(doc), indent=1) + "\n", encoding="utf-8")
    return path
