"""Long, heavy agent sessions: does SMetric beat LMetric once sticky sessions overload holders?

Tests docs/eval/why-margin.md §6: with SWE-agent-like sessions (30-100 turns, contexts growing to
30-100 K tokens), a follow-up's holder should get overloaded; LMetric prices a move as a full
recompute (prompt - local hit) even when the global tier holds the prefix, so it should stay
stuck, while SMetric migrates for a tier load. The script generates such a workload with
``AgentWorkloadSpec``, runs ``smetric.workload.sweep.sweep`` on it (the load ladder, bisection and
SLO scoring of ``smetric sweep``) at 16 instances with a global tier, then re-runs every policy
at one load (the highest factor both ``smetric`` and ``lmetric`` met) for what the sweep's points
do not say: how often follow-ups leave their previous turn's instance, what a move loads from
the tier, and how unevenly the instances are loaded over time.

    .venv/bin/python scripts/heavy_sessions.py               # ~8 min on one core
    .venv/bin/python scripts/heavy_sessions.py --sessions 100 --ladder 4 32 \\
        --profile qwen2.5-7b-h200

The workload (``--sessions`` sessions, seed ``--seed``), from the shared traces README's
SWE-bench / mini-swe-agent facts where it has them:

* turns: log-normal, median 40, p90 80, clipped to [30, 100]. README: 13-145 turns, median 16-36;
  the long end (30-100), to make holders overload.
* growth per turn: the previous answer plus tool output, log-normal median 500, p90 1,500 tokens
  (clipped to [20, 16,000]). README: each turn is ~97-98% of the previous prompt, i.e. +2-3%; at
  the 20-50 K contexts of a session's middle turns that is ~500-1,500 tokens. Final contexts
  come out at ~25-105 K tokens (median ~43 K), heavier than the README's median 14 K / p90 31 K
  tokens per prompt, on purpose.
* opening: 1,500 tokens shared by every session (agent system prompt + instructions) and a
  first user message (the issue) log-normal median 2,000, p90 5,000 tokens. Not in the README;
  assumed.
* answers: log-normal median 150, p90 500 tokens (a thought and one shell command). Not in the
  README; assumed.
* tool time between turns: the README's mini-swe-agent measurement, median 0.27 s, p90 1.14 s,
  max 64 s (``AgentWorkloadSpec``'s default). Model time comes from the simulator.
* sessions start 2 s apart at load x1 (Poisson), as ``smetric sweep --trace agents`` does; a load
  factor f divides start gaps and tool times by f (``scale_arrivals``).

Profile: ``qwen3-30b-a3b-h20`` by default, the one the README's agents runs use. Its KV pool
holds ~239 K tokens per instance, about five of these contexts, so 200 sessions on 16 instances
already overload whoever holds them. On ``qwen2.5-7b-h200`` (a 1.9 M-token pool, and tier loads
of 40-130 ms for 16-56 K tokens), 500 of these sessions started within 16 s (24 K requests, x64)
still had LMetric meet both SLOs for 100% of requests with 97% local hits: no holder gets
overloaded at a size this machine can simulate in the time box.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from smetric.engine import GlobalTierConfig
from smetric.perf import Profile, load_profile
from smetric.sim import SimRequest, SimResult
from smetric.slo import SLOConfig, SLOModel
from smetric.workload.generator import AgentWorkloadSpec, LogNormal, generate
from smetric.workload.sweep import Point, evaluate, peak_tps, percentile, run_at, sweep

POLICIES = ("smetric", "lmetric", "least_load", "cache_aware", "kv_cost", "smetric-no-migration")
LADDER = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


def heavy_spec(sessions: int) -> AgentWorkloadSpec:
    """SWE-agent-like sessions (see the module docstring for where each number comes from)."""
    return AgentWorkloadSpec(
        sessions=sessions,
        turns=LogNormal(40, 80, 30, 100),
        system_prompt_tokens=1500,
        first_user_tokens=LogNormal(2000, 5000, 300, 15000),
        tool_output_tokens=LogNormal(500, 1500, 20, 16000),
        output_tokens=LogNormal(150, 500, 10, 4000),
        tool_time_s=LogNormal(0.27, 1.14, 0.0, 64.0),
        session_gap_s=2.0,
    )


def describe(requests: Sequence[SimRequest]) -> str:
    by_session: dict[str, list[SimRequest]] = {}
    for r in requests:
        by_session.setdefault(r.session or r.rid, []).append(r)
    turns = [len(v) for v in by_session.values()]
    final = [v[-1].prompt_tokens for v in by_session.values()]
    prompts = [r.prompt_tokens for r in requests]
    kept = [
        a.prompt_tokens / b.prompt_tokens
        for v in by_session.values()
        for a, b in itertools.pairwise(v)
    ]
    return (
        f"{len(by_session)} sessions, {len(requests)} requests; turns median "
        f"{statistics.median(turns):g} (min {min(turns)}, max {max(turns)}); final context "
        f"median {statistics.median(final):,.0f}, p90 {percentile(final, 0.9):,} (min "
        f"{min(final):,}, max {max(final):,}) tokens; prompts median "
        f"{statistics.median(prompts):,.0f}, p90 {percentile(prompts, 0.9):,}; a turn's prompt "
        f"is median {statistics.median(kept):.1%} of the next one's; "
        f"{sum(prompts) / 1e6:.0f} M prompt tokens in all"
    )


@dataclass
class Diagnosis:
    """What one run did beyond the sweep's point."""

    makespan_s: float
    moves: int
    """Follow-ups served on another instance than their previous turn."""
    follow_ups: int
    move_tier_share: float
    """Of moved follow-ups' prompt tokens, the share loaded from the global tier."""
    move_local_share: float
    inflight_imbalance: float
    """Mean over load samples (until the last arrival) of max / mean running + waiting."""
    waiting_share: float
    """Mean share of in-flight requests waiting (for a prefill slot or KV memory)."""
    pool_used_max: float
    """Mean over samples of the fullest instance's KV-pool use."""
    followup_ttft_p50_s: float
    followup_ttft_miss: float


def diagnose(
    result: SimResult, requests: Sequence[SimRequest], slo: SLOModel, profile: Profile
) -> Diagnosis:
    worker = {r.rid: r.worker for r in result.ok()}
    moves = follow_ups = moved_prompt = moved_tier = moved_local = 0
    served = {r.rid: r for r in result.ok()}
    for r in requests:
        if r.after is None or r.rid not in served or r.after not in worker:
            continue
        follow_ups += 1
        if worker[r.rid] != worker[r.after]:
            moves += 1
            got = served[r.rid]
            moved_prompt += got.prompt_tokens
            moved_tier += got.global_cached_tokens
            moved_local += got.local_cached_tokens
    last_arrival = max(r.arrival_s for r in result.requests)
    names = list(result.load)
    imbalance, waiting, used = [], [], []
    for t in range(len(result.load[names[0]])):
        if result.load[names[0]][t].t_s > last_arrival:
            break
        rw = [result.load[w][t].running + result.load[w][t].waiting for w in names]
        if sum(rw) == 0:
            continue
        imbalance.append(max(rw) / (sum(rw) / len(rw)))
        waiting.append(sum(result.load[w][t].waiting for w in names) / sum(rw))
        used.append(max(result.load[w][t].used_tokens for w in names) / profile.kv_pool_tokens)
    follow = [r for r in result.ok() if not r.rid.endswith("#0") and r.ttft_s is not None]
    misses = sum(
        r.ttft_s is not None and r.ttft_s > slo.ttft_slo_s(r.prompt_tokens) for r in follow
    )
    return Diagnosis(
        result.makespan_s,
        moves,
        follow_ups,
        moved_tier / moved_prompt if moved_prompt else 0.0,
        moved_local / moved_prompt if moved_prompt else 0.0,
        statistics.mean(imbalance) if imbalance else 1.0,
        statistics.mean(waiting) if waiting else 0.0,
        statistics.mean(used) if used else 0.0,
        percentile([r.ttft_s for r in follow if r.ttft_s is not None], 0.5),
        misses / len(follow) if follow else 0.0,
    )


def highest_met(points: Sequence[Point]) -> float | None:
    return max((p.factor for p in points if p.meets_slo), default=None)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="heavy_sessions", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--profile", default="qwen3-30b-a3b-h20")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--ladder", type=float, nargs="+", default=list(LADDER))
    ap.add_argument("--refine", type=int, default=3, help="bisections after the SLO breaks")
    ap.add_argument(
        "--diag-factor",
        type=float,
        default=None,
        help="load of the diagnostic re-runs (default: the highest factor both smetric and "
        "lmetric met, else the ladder's first)",
    )
    args = ap.parse_args(argv)
    if args.sessions < 1 or min(args.ladder) <= 0 or args.ladder != sorted(set(args.ladder)):
        ap.error("--sessions must be >= 1 and --ladder increasing factors > 0")
    start = time.monotonic()
    profile = load_profile(args.profile)
    tier = GlobalTierConfig()
    slo_config = SLOConfig()
    slo = SLOModel(profile, slo_config)
    requests = generate(heavy_spec(args.sessions), args.seed)
    print(describe(requests))
    print(
        f"{args.workers} instances, {profile.name} (KV pool {profile.kv_pool_tokens:,} tokens "
        f"each), global tier {tier.load_bytes_per_s / 1e9:g} GB/s (50 K tokens load in "
        f"{profile.kv_move_time_s(50_000, tier.load_bytes_per_s, tier.load_latency_s):.2f} s; "
        f"their TTFT SLO is {slo.ttft_slo_s(50_000):.1f} s), ladder {args.ladder}",
        flush=True,
    )

    def show(p: Point) -> None:
        print(
            f"  {p.policy:<22} x{p.factor:<6.3g} {'ok ' if p.meets_slo else 'SLO'} TPS "
            f"{p.tps:>9.0f} TTFT {p.ttft_attainment:6.1%} TPOT {p.tpot_attainment:6.1%} hit "
            f"{p.local_hit:5.1%} + tier {p.global_hit:5.1%} migrations {p.migrations:5d} "
            f"({time.monotonic() - start:.0f} s)",
            flush=True,
        )

    results = sweep(
        requests,
        args.policies,
        profile,
        args.workers,
        tier,
        ladder=args.ladder,
        refine=args.refine,
        progress=show,
        slo_config=slo_config,
    )
    factor = args.diag_factor
    if factor is None:
        met = [highest_met(results[p]) for p in ("smetric", "lmetric") if p in results]
        factor = min((m for m in met if m is not None), default=args.ladder[0])
    print(f"\ndiagnostic re-runs at x{factor:g}", flush=True)
    diag: dict[str, tuple[Point, Diagnosis]] = {}
    for name in args.policies:
        result = run_at(requests, name, factor, profile, args.workers, tier, slo_config)
        diag[name] = (evaluate(name, factor, result, slo), diagnose(result, requests, slo, profile))

    best = max((peak_tps(v) for k, v in results.items() if not k.startswith("smetric")), default=0)
    print(
        f"\n{'policy':<22} {'peak TPS':>9} {'vs best':>7} {'max x':>6} | at x{factor:<5g}"
        f"{'TPS':>9} {'makespan':>8} {'TTFT':>6} {'TPOT':>6} {'local':>6} {'tier':>6} "
        f"{'migr':>5} {'moves':>6} {'mv tier':>7} {'imbal':>5} {'wait':>5} {'pool':>5} "
        f"{'fu p50':>6} {'fu miss':>7}"
    )
    for name, points in results.items():
        peak = peak_tps(points)
        top = highest_met(points)
        p, d = diag[name]
        print(
            f"{name:<22} {peak:>9.0f} {f'{peak / best:.3f}' if best else '-':>7} "
            f"{'-' if top is None else f'{top:.3g}':>6} | {'ok ' if p.meets_slo else 'SLO'}"
            f"{'':<6}{p.tps:>9.0f} {d.makespan_s:>7.0f}s {p.ttft_attainment:>6.1%} "
            f"{p.tpot_attainment:>6.1%} {p.local_hit:>6.1%} {p.global_hit:>6.1%} "
            f"{p.migrations:>5d} {d.moves / max(d.follow_ups, 1):>6.1%} "
            f"{d.move_tier_share:>7.1%} {d.inflight_imbalance:>5.2f} {d.waiting_share:>5.0%} "
            f"{d.pool_used_max:>5.0%} {d.followup_ttft_p50_s:>5.2f}s {d.followup_ttft_miss:>7.1%}"
        )
    print(
        "\npeak TPS: highest TPS (tokens / makespan) among runs meeting the SLO (90% within the "
        "TTFT SLO, 5x idle, and the 100 ms TPOT SLO); max x: highest load factor run that met "
        "it. At the diagnostic load: migr = SMetric's migrate_* decisions; moves = follow-ups "
        "served elsewhere than their previous turn; mv tier = share of moved prompts loaded "
        "from the tier; imbal = mean max/mean in-flight per instance until the last arrival; "
        "wait = share of in-flight requests waiting; pool = fullest KV pool; fu = follow-ups' "
        "TTFT median and SLO misses."
    )
    for name in ("smetric", "smetric-no-migration"):
        if name in diag:
            print(f"{name} decisions at x{factor:g}: {diag[name][0].decisions}")
    print(f"run time {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
