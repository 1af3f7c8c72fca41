"""Why SMetric does not beat LMetric by the paper's margin: request-by-request evidence.

Runs policies in the simulator on one workload at given load factors (the same deterministic,
seeded workload for every policy), records every routing decision with what the policy saw, and
prints, per policy and factor:

* TPS, tokens, makespan and the arrivals' span (TPS over the makespan is what sweeps report);
* SLO attainment and the misses split by TTFT / TPOT, first turn / follow-up, decision reason;
* the SLO model's predicted TTFT against the actual one, per decision reason;
* hits by tier (local, global tier, recomputed) and the global-tier load time paid;
* load balance over time (per-instance running + waiting, queued prefill) and KV-pool pressure;
* for SMetric and its ablations, how often LMetric, on the very same cluster view, would have
  chosen the same instance (by decision reason);
* with two or more policies, which requests miss under the first and not under another.

Commands (as run for docs/eval/why-margin.md; each a few minutes on this machine)::

    MC="--trace mooncake --path ../shared/traces/mooncake/conversation_trace.jsonl --limit 3000"
    .venv/bin/python scripts/why_margin.py $MC --closed-loop --workers 16 \\
        --policies smetric lmetric --factors 8 9 9.8 10.31 10.84 12
    .venv/bin/python scripts/why_margin.py $MC --closed-loop --workers 16 --detail \\
        --policies smetric lmetric least_load smetric-no-slo-gate smetric-no-migration \\
        smetric-no-turn-detection smetric-load-delay smetric-load-requests --factors 10.31
    .venv/bin/python scripts/why_margin.py --trace agents \\
        --path ../shared/traces/agents/taubench_airline.jsonl --copies 4 --workers 16 \\
        --profile qwen3-30b-a3b-h20 --detail --policies smetric lmetric --factors 12

``--detail`` prints the per-reason and per-request breakdowns; without it, one line per run.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from smetric.cluster import ClusterView, Decision
from smetric.engine import GlobalTierConfig
from smetric.perf import Profile, load_profile
from smetric.policies import Policy
from smetric.policies.lmetric import LMetric
from smetric.policies.smetric import SMetric
from smetric.request import RequestView
from smetric.sim import ClusterState, SimRequest, SimResult, policy_route, simulate
from smetric.slo import SLOConfig, SLOModel
from smetric.workload.sweep import load_workload, scale_arrivals, sweep_policy


@dataclass
class Seen:
    """One routing decision and what the policy saw when it made it."""

    decision: Decision
    chosen_hit_tokens: int
    best_hit_tokens: int
    shared_hit_tokens: int
    global_hit_tokens: int
    prompt_tokens: int
    lmetric_choice: int
    same_as_lmetric: bool
    stick_ttft_s: float | None = None
    """SMetric: predicted TTFT on the best-hit instance (what the SLO gate judged)."""
    chosen_queued: int = 0
    min_queued: int = 0
    chosen_in_flight: int = 0
    min_in_flight: int = 0
    ttft_slo_s: float = 0.0
    chosen_pred_ttft_s: float = 0.0
    """The SLO model's TTFT prediction on the chosen instance (its hits, the tier's loads)."""
    best_pred_ttft_s: float = 0.0
    """The lowest such prediction over all instances: what any router could have had."""


class Recorder:
    """Wraps a policy: records each decision and LMetric's choice on the same view."""

    def __init__(self, inner: Policy, slo: SLOModel) -> None:
        self.inner = inner
        self.slo = slo
        self.name = inner.name
        self.shadow = LMetric()
        self.last: Seen | None = None

    def select(self, req: RequestView, cluster: ClusterView) -> Decision:
        d = self.inner.select(req, cluster)
        ws = cluster.workers
        prompt = req.prompt_tokens
        hits = [cluster.local_hit_tokens(i, prompt) for i in range(len(ws))]
        best = max(range(len(ws)), key=lambda i: hits[i])
        lm = self.shadow.select(req, cluster).worker
        glob = min(int(cluster.global_hit_blocks * cluster.block_tokens), prompt)
        pred = [
            self.slo.predict_ttft_s(w.url, w.queued_prefill_tokens, prompt, h, max(glob - h, 0))
            for w, h in zip(ws, hits, strict=True)
        ]
        stick = None
        if isinstance(self.inner, SMetric):
            stick = self.inner._predict_at(req, cluster, best)[0]
        self.last = Seen(
            d,
            hits[d.worker],
            hits[best],
            min(hits),
            min(int(cluster.global_hit_blocks * cluster.block_tokens), prompt),
            prompt,
            lm,
            lm == d.worker,
            stick,
            ws[d.worker].queued_prefill_tokens,
            min(w.queued_prefill_tokens for w in ws),
            ws[d.worker].in_flight,
            min(w.in_flight for w in ws),
            self.slo.ttft_slo_s(prompt),
            pred[d.worker],
            min(pred),
        )
        return d


@dataclass
class Run:
    policy: str
    factor: float
    result: SimResult
    seen: dict[str, Seen]
    requests: dict[str, SimRequest]
    extra: dict[str, Any] = field(default_factory=dict)


def run_one(
    requests: Sequence[SimRequest],
    policy: str,
    factor: float,
    profile: Profile,
    workers: int,
    tier: GlobalTierConfig | None,
    slo_config: SLOConfig,
) -> Run:
    tiered = replace(
        slo_config,
        global_tier=tier is not None,
        global_load_bytes_per_s=(tier or GlobalTierConfig()).load_bytes_per_s,
    )
    rec = Recorder(sweep_policy(policy, profile, tier, slo_config), SLOModel(profile, tiered))
    inner = policy_route(rec, routed_index=True)
    seen: dict[str, Seen] = {}

    def route(sim: SimRequest, state: ClusterState) -> str:
        name = inner(sim, state)
        assert rec.last is not None
        seen[sim.rid] = rec.last
        return name

    scaled = scale_arrivals(requests, factor)
    result = simulate(scaled, route, profile, workers, global_tier=tier)
    return Run(policy, factor, result, seen, {r.rid: r for r in scaled})


def pct(a: float, b: float) -> str:
    return f"{100.0 * a / b:5.1f}%" if b else "    -"


def summary(
    run: Run, slo: SLOModel, tier: GlobalTierConfig | None, profile: Profile
) -> dict[str, Any]:
    ok = run.result.ok()
    n = len(run.result.requests)
    ttft_miss = {
        r.rid for r in ok if r.ttft_s is None or r.ttft_s > slo.ttft_slo_s(r.prompt_tokens)
    }
    ttft_miss |= {r.rid for r in run.result.requests if r.error is not None}
    tpot_miss = {r.rid for r in ok if (r.tpot_s or 0.0) > slo.tpot_slo_s}
    tpot_miss |= {r.rid for r in run.result.requests if r.error is not None}
    tokens = sum(r.prompt_tokens + r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok) or 1
    local = sum(r.local_cached_tokens for r in ok)
    glob = sum(r.global_cached_tokens for r in ok)
    load_s = 0.0
    if tier is not None:
        load_s = sum(
            profile.kv_move_time_s(
                r.global_cached_tokens, tier.load_bytes_per_s, tier.load_latency_s
            )
            for r in ok
            if r.global_cached_tokens
        )
    last_arrival = max(r.arrival_s for r in run.result.requests)
    # Load over time, until the last arrival: per sample, max / mean of running + waiting.
    names = list(run.result.load)
    samples = len(run.result.load[names[0]])
    imb, qcv, used, waiting_share = [], [], [], []
    for t in range(samples):
        if run.result.load[names[0]][t].t_s > last_arrival:
            break  # the drain: a few instances finish the last turns
        rw = [run.result.load[w][t].running + run.result.load[w][t].waiting for w in names]
        q = [run.result.load[w][t].queued_prefill_tokens for w in names]
        if sum(rw) == 0:
            continue
        imb.append(max(rw) / (sum(rw) / len(rw)))
        mq = sum(q) / len(q)
        if mq > 0:
            qcv.append(statistics.pstdev(q) / mq)
        pool = profile.kv_pool_tokens
        used.append(max(run.result.load[w][t].used_tokens for w in names) / pool)
        waiting_share.append(sum(run.result.load[w][t].waiting for w in names) / sum(rw))
    return {
        "n": n,
        "tokens": tokens,
        "makespan": run.result.makespan_s,
        "last_arrival": last_arrival,
        "tps": tokens / run.result.makespan_s,
        "tps_arrivals": tokens / last_arrival if last_arrival else math.nan,
        "ttft_att": 1 - len(ttft_miss) / n,
        "tpot_att": 1 - len(tpot_miss) / n,
        "ttft_miss": ttft_miss,
        "tpot_miss": tpot_miss,
        "local": local / prompt,
        "global": glob / prompt,
        "recomputed": 1 - (local + glob) / prompt,
        "load_s": load_s,
        "imbalance": statistics.mean(imb) if imb else 1.0,
        "queue_cv": statistics.mean(qcv) if qcv else 0.0,
        "max_pool_used": statistics.mean(used) if used else 0.0,
        "waiting_share": statistics.mean(waiting_share) if waiting_share else 0.0,
        "migrations": sum(c for k, c in run.result.decisions.items() if k.startswith("migrate")),
    }


def one_line(run: Run, s: dict[str, Any]) -> str:
    meets = s["ttft_att"] >= 0.9 and s["tpot_att"] >= 0.9
    return (
        f"{run.policy:<26} x{run.factor:<6g} {'ok ' if meets else 'SLO'} "
        f"TTFT {s['ttft_att']:6.1%} TPOT {s['tpot_att']:6.1%} | TPS {s['tps']:>8.0f} "
        f"tokens {s['tokens']:>10d} makespan {s['makespan']:6.1f}s last arrival "
        f"{s['last_arrival']:6.1f}s (TPS over arrivals {s['tps_arrivals']:>8.0f}) | hit local "
        f"{s['local']:5.1%} tier {s['global']:5.1%} | migr {s['migrations']:4d} | "
        f"imb {s['imbalance']:.2f} qCV {s['queue_cv']:.2f} pool {s['max_pool_used']:.0%} "
        f"waiting {s['waiting_share']:.0%} | tier load {s['load_s']:.1f}s"
    )


def detail(run: Run, s: dict[str, Any], slo: SLOModel) -> None:
    res = {r.rid: r for r in run.result.requests}
    by_reason: dict[str, list[str]] = defaultdict(list)
    for rid, seen in run.seen.items():
        by_reason[seen.decision.reason].append(rid)
    print(f"  by decision reason ({run.policy} x{run.factor:g}):")
    print(
        f"    {'reason':<26}{'n':>6}{'TTFT miss':>10}{'TPOT miss':>10}{'=LMetric':>9}"
        f"{'hit@chosen':>11}{'hit@best':>9}{'pred/SLO':>9}{'act/SLO':>8}{'act/pred':>9}"
        f"{'q-chosen':>9}{'q-min':>7}{'bs-ch':>6}{'bs-min':>7}"
    )
    for reason, rids in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        picks = [run.seen[r] for r in rids]
        got = [res[r] for r in rids]
        ratios = [
            g.ttft_s / x.decision.predicted_ttft_s
            for g, x in zip(got, picks, strict=True)
            if g.ttft_s and x.decision.predicted_ttft_s
        ]
        pred = [
            x.decision.predicted_ttft_s / slo.ttft_slo_s(x.prompt_tokens)
            for x in picks
            if x.decision.predicted_ttft_s is not None
        ]
        act = [g.ttft_s / slo.ttft_slo_s(g.prompt_tokens) for g in got if g.ttft_s is not None]
        prompt = sum(x.prompt_tokens for x in picks) or 1

        def med(v: list[float]) -> str:
            return f"{statistics.median(v):.2f}" if v else "-"

        print(
            f"    {reason:<26}{len(rids):>6}"
            f"{pct(sum(r in s['ttft_miss'] for r in rids), len(rids)):>10}"
            f"{pct(sum(r in s['tpot_miss'] for r in rids), len(rids)):>10}"
            f"{pct(sum(x.same_as_lmetric for x in picks), len(rids)):>9}"
            f"{pct(sum(x.chosen_hit_tokens for x in picks), prompt):>11}"
            f"{pct(sum(x.best_hit_tokens for x in picks), prompt):>9}"
            f"{med(pred):>9}{med(act):>8}{med(ratios):>9}"
            f"{statistics.mean(x.chosen_queued for x in picks):>9.0f}"
            f"{statistics.mean(x.min_queued for x in picks):>7.0f}"
            f"{statistics.mean(x.chosen_in_flight for x in picks):>6.1f}"
            f"{statistics.mean(x.min_in_flight for x in picks):>7.1f}"
        )
    # The SLO gate: sticks whose actual TTFT missed (too lenient), and migrations whose stick
    # prediction was over the SLO.
    sticks = by_reason.get("stick", [])
    if sticks:
        lenient = [r for r in sticks if r in s["ttft_miss"]]
        print(
            f"  SLO gate: {len(lenient)} of {len(sticks)} sticks predicted within the TTFT SLO "
            f"missed it ({pct(len(lenient), len(sticks)).strip()})"
        )
    migs = by_reason.get("migrate_slo", [])
    if migs:
        over = [
            (run.seen[r].stick_ttft_s or 0.0) / slo.ttft_slo_s(run.seen[r].prompt_tokens)
            for r in migs
        ]
        print(
            f"  migrations: {len(migs)}; the holder's predicted TTFT / SLO, median "
            f"{statistics.median(over):.2f}; migrated requests' own TTFT miss "
            f"{pct(sum(r in s['ttft_miss'] for r in migs), len(migs)).strip()}"
        )
    # Each TTFT miss, judged at its decision: had the chosen instance a predicted TTFT within the
    # SLO (the miss came later), had another (a routing miss), or had none (no router could)?
    misses = [r for r in s["ttft_miss"] if r in run.seen]
    chosen_ok = sum(run.seen[r].chosen_pred_ttft_s <= run.seen[r].ttft_slo_s for r in misses)
    none_ok = sum(run.seen[r].best_pred_ttft_s > run.seen[r].ttft_slo_s for r in misses)
    print(
        f"  TTFT misses at decision time: chosen instance predicted within the SLO "
        f"{chosen_ok}, another instance was (routing) {len(misses) - chosen_ok - none_ok}, none "
        f"was {none_ok} (of {len(misses)})"
    )
    edges = (0, 2048, 4096, 8192, 16384, 32768, 1 << 40)
    cells = []
    for lo, hi in itertools.pairwise(edges):
        rids = [r for r, x in run.requests.items() if lo <= x.prompt_tokens < hi]
        if rids:
            cells.append(
                f"<{hi // 1024 if hi < 1 << 40 else 'inf'}K: {len(rids)} "
                f"{pct(sum(r in s['ttft_miss'] for r in rids), len(rids)).strip()}"
            )
    print("  TTFT misses by prompt size: " + ", ".join(cells))
    first = [r for r, x in run.requests.items() if x.is_first_turn]
    follow = [r for r, x in run.requests.items() if x.is_first_turn is False]
    routed = [r for r in follow if r in run.seen]
    if routed:
        stay = [r for r in routed if run.seen[r].chosen_hit_tokens >= run.seen[r].best_hit_tokens]
        lm_stay = [r for r in routed if run.seen[r].lmetric_choice == run.seen[r].decision.worker]
        print(
            f"  follow-ups sent to their best-hit instance: {pct(len(stay), len(routed)).strip()}"
            f"; LMetric on the same views would send {pct(len(lm_stay), len(routed)).strip()} "
            f"to the same instance as {run.policy}"
        )
    all_prompt = sum(x.prompt_tokens for x in run.requests.values())
    for label, rids in (("first turns", first), ("follow-ups", follow)):
        if rids:
            print(
                f"  {label:<12} {len(rids):>6}: TTFT miss "
                f"{pct(sum(r in s['ttft_miss'] for r in rids), len(rids))}, TPOT miss "
                f"{pct(sum(r in s['tpot_miss'] for r in rids), len(rids))}, prompt tokens "
                f"{pct(sum(run.requests[r].prompt_tokens for r in rids), all_prompt)}"
            )


def compare(a: Run, sa: dict[str, Any], b: Run, sb: dict[str, Any]) -> None:
    for kind in ("ttft_miss", "tpot_miss"):
        only_a = sa[kind] - sb[kind]
        only_b = sb[kind] - sa[kind]
        reasons = Counter(a.seen[r].decision.reason for r in only_a if r in a.seen)
        first = sum(bool(a.requests[r].is_first_turn) for r in only_a)
        print(
            f"  {kind.replace('_', ' ')}: {len(only_a)} only under {a.policy} ({first} first "
            f"turns; {a.policy}'s reasons {dict(reasons)}), {len(only_b)} only under "
            f"{b.policy}, {len(sa[kind] & sb[kind])} under both"
        )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", choices=["mooncake", "agents"], default="mooncake")
    p.add_argument("--path", default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--closed-loop", action="store_true")
    p.add_argument("--copies", type=int, default=1)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--profile", default="qwen2.5-7b-h200")
    p.add_argument("--ttft-slo-scale", type=float, default=5.0)
    p.add_argument("--no-global-tier", action="store_true")
    p.add_argument("--tier-gbps", type=float, default=25.0, help="global tier GB/s (default 25)")
    p.add_argument("--policies", nargs="+", default=["smetric", "lmetric"])
    p.add_argument("--factors", type=float, nargs="+", required=True)
    p.add_argument("--detail", action="store_true")
    args = p.parse_args(argv)
    profile = load_profile(args.profile)
    tier = None if args.no_global_tier else GlobalTierConfig(load_bytes_per_s=args.tier_gbps * 1e9)
    slo_config = SLOConfig(ttft_slo_scale=args.ttft_slo_scale)
    slo = SLOModel(profile, slo_config)
    requests = load_workload(
        args.trace, args.path, profile, args.limit, args.closed_loop, args.copies
    )
    firsts = sum(bool(r.is_first_turn) for r in requests)
    print(
        f"{len(requests)} requests, {firsts} first turns, {len(requests) - firsts} follow-ups; "
        f"{args.workers} workers, {profile.name}, tier "
        f"{'off' if tier is None else f'{args.tier_gbps:g} GB/s'}",
        flush=True,
    )
    for factor in args.factors:
        runs = []
        for name in args.policies:
            run = run_one(requests, name, factor, profile, args.workers, tier, slo_config)
            s = summary(run, slo, tier, profile)
            runs.append((run, s))
            print(one_line(run, s), flush=True)
            if args.detail:
                detail(run, s, slo)
        if args.detail and len(runs) > 1:
            print(f"  misses, {runs[0][0].policy} vs each other policy at x{factor:g}:")
            for run, s in runs[1:]:
                compare(runs[0][0], runs[0][1], run, s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
