"""Load sweeps in the simulator: each policy's peak TPS under SLO (SPEC §4).

For a load factor f, arrivals come f times faster (trace timestamps and session start gaps divided
by f, think times too). A run meets the SLO when at least 90% of requests have TTFT within their
TTFT SLO (k x their TTFT alone on an idle instance, k = 5) and at least 90% have mean TPOT within
the TPOT SLO (100 ms). TPS = prompt + output tokens served / the run's makespan. The sweep raises
f along a geometric ladder, bisects between the last load that met the SLO and the first that did
not, and reports the highest TPS among the runs that met the SLO.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from smetric.engine import GlobalTierConfig
from smetric.perf import Profile
from smetric.policies import make_policy
from smetric.sim import SimRequest, SimResult, policy_route, simulate
from smetric.slo import SLOModel

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
    policy: str, factor: float, result: SimResult, slo: SLOModel, attainment: float = 0.9
) -> Point:
    ok = result.ok()
    n = max(len(result.requests), 1)
    ttft_met = sum(
        1 for r in ok if r.ttft_s is not None and r.ttft_s <= slo.ttft_slo_s(r.prompt_tokens)
    )
    tpot_met = sum(1 for r in ok if (r.tpot_s or 0.0) <= slo.tpot_slo_s)
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    prompt = sum(r.prompt_tokens for r in ok) or 1
    tokens = sum(r.prompt_tokens + r.output_tokens for r in ok)
    return Point(
        policy,
        factor,
        tokens / max(result.makespan_s, 1e-9),
        ttft_met / n,
        tpot_met / n,
        ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else float("inf"),
        sum(r.local_cached_tokens for r in ok) / prompt,
        sum(r.global_cached_tokens for r in ok) / prompt,
        ttft_met / n >= attainment and tpot_met / n >= attainment,
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
) -> dict[str, list[Point]]:
    """Climbs ``ladder`` until the SLO breaks, then bisects ``refine`` times between the last
    load that met it and the first that did not."""
    slo = SLOModel(profile)
    out: dict[str, list[Point]] = {}
    for name in policies:
        points: list[Point] = []

        def run(factor: float, name: str = name, points: list[Point] = points) -> Point:
            result = simulate(
                scale_arrivals(requests, factor),
                policy_route(make_policy(name)),
                profile,
                workers,
                global_tier=global_tier,
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
