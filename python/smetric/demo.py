"""``smetric demo``: the router in front of an emulated SGLang cluster, on real agent sessions.

Starts 4 emulated workers (time-scaled; no GPU needed) sharing a global KV tier, then, for each
policy in turn, a fresh router in front of them and a fresh cache, replays the bundled slice of
real tau-bench agent sessions (streaming chat with tools, each turn after the previous answer plus
its think time), and prints the policies side by side. Everything runs in this one process and
stops with it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from smetric import GLOBAL_TIER
from smetric.emulator import EmulatedCluster
from smetric.perf import load_profile
from smetric.router import Router, RouterConfig, listen
from smetric.slo import SLOModel
from smetric.workload.agents import Session, load_sessions
from smetric.workload.replay import TurnResult, replay_sessions

DEFAULT_POLICIES = ("smetric", "lmetric", "cache_aware")


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


def summarize(
    policy: str, results: list[TurnResult], slo: SLOModel, wall_s: float, workers: Sequence[str]
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    prompt = sum(r.prompt_tokens for r in ok) or 1
    met = sum(
        1
        for r in ok
        if r.ttft_s <= slo.ttft_slo_s(r.prompt_tokens) and (r.tpot_s or 0.0) <= slo.tpot_slo_s
    )
    per_worker = Counter({w: 0 for w in workers})
    per_worker.update(r.worker for r in ok if r.worker)
    reasons = Counter(r.reason for r in ok)
    return {
        "policy": policy,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50_ms": 1e3 * _pct(ttft, 0.5),
        "reasons": dict(reasons),
        "ttft_p90_ms": 1e3 * _pct(ttft, 0.9),
        "tpot_p90_ms": 1e3 * _pct(tpot, 0.9),
        "slo_attainment": met / max(len(ok), 1),
        "cached": sum(r.cached_tokens for r in ok) / prompt,
        "spread": f"{min(per_worker.values(), default=0)}-{max(per_worker.values(), default=0)}",
        "migrations": reasons.get("migrate_slo", 0) + reasons.get("migrate_over_slo", 0),
        "wall_s": wall_s,
    }


async def run_policy(
    cluster: EmulatedCluster,
    policy: str,
    sessions: list[Session],
    profile_name: str,
    start_gap_s: float,
    time_scale: float,
) -> tuple[list[TurnResult], float]:
    for w in cluster.workers:
        w.engine.flush_cache()
    if cluster.cluster.global_tier is not None:
        cluster.cluster.index.clear(GLOBAL_TIER)
    config = RouterConfig(
        worker_urls=list(cluster.urls),
        policy=policy,
        profile=profile_name,
        port=0,
        health_check_interval_secs=5.0,
    )
    router = Router(config)
    server = await listen(router, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}"
    t0 = time.perf_counter()
    try:
        results = await replay_sessions(
            url, sessions, start_gap_s=start_gap_s, time_scale=time_scale
        )
    finally:
        await server.close()
    return results, time.perf_counter() - t0


async def _main(
    policies: Sequence[str],
    workers: int,
    profile_name: str,
    time_scale: float,
    start_gap_s: float,
    sessions: int,
) -> list[dict[str, Any]]:
    profile = load_profile(profile_name)
    data = load_sessions(limit=sessions)
    turns = sum(len(s.turns) for s in data)
    cluster = EmulatedCluster(profile, workers=workers, time_scale=time_scale)
    await cluster.start()
    slo = SLOModel(profile)
    rows = []
    print(
        f"{len(data)} real agent sessions (tau-bench airline, bundled), {turns} chat requests;"
        f" {workers} emulated workers ({profile.name}, x{time_scale:g} time), global KV tier",
        flush=True,
    )
    try:
        for policy in policies:
            print(f"  replaying through the router with --policy {policy} ...", end="", flush=True)
            results, wall = await run_policy(
                cluster, policy, data, profile_name, start_gap_s, time_scale
            )
            rows.append(summarize(policy, results, slo, wall, cluster.urls))
            print(f" {wall:.1f} s", flush=True)
    finally:
        await cluster.stop()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"\n{'policy':<12} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p90':>9} {'SLO met':>8} "
        f"{'cached':>7} {'req/worker':>11} {'migrations':>11} {'errors':>7}"
    )
    print(head)
    print("-" * (len(head) - 1))
    for r in rows:
        print(
            f"{r['policy']:<12} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p90_ms']:>7.0f}ms "
            f"{r['tpot_p90_ms']:>7.1f}ms {r['slo_attainment']:>7.1%} {r['cached']:>6.1%} "
            f"{r['spread']:>11} {r['migrations']:>11} {r['errors']:>7}"
        )
    print(
        "\nLatencies in the emulated model's seconds. SLO met: TTFT <= 5x the request's idle TTFT"
        " and TPOT <= 100 ms."
    )


def main(
    policies: Sequence[str] = DEFAULT_POLICIES,
    workers: int = 4,
    profile: str = "qwen3-30b-a3b-h20",
    time_scale: float = 4.0,
    start_gap_s: float = 0.5,
    sessions: int = 24,
) -> int:
    rows = asyncio.run(_main(policies, workers, profile, time_scale, start_gap_s, sessions))
    print_table(rows)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
