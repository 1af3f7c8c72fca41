"""Checks the evaluation itself: the simulator and the emulated cluster (end to end, through our
router) on the same small sweep, point by point, and each policy's peak TPS under SLO both ways.

    python scripts/sim_vs_emulator.py                          # smetric and least_load, x1 2 4
    python scripts/sim_vs_emulator.py --policies lmetric --ladder 1 2 --time-scale 2

The workload is the bundled agent sessions (``--sessions``, ``--copies``), paced as
``smetric sweep --trace agents`` paces them; the simulator runs the same policy code on the same
engine model. The emulator runs in real time by default: on a small machine, a faster emulated
clock is starved of CPU by the replay client, router and workers sharing it, and its latencies
grow with that, not with the policy.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from smetric.engine import GlobalTierConfig
from smetric.perf import load_profile
from smetric.slo import SLOModel
from smetric.workload.agents import load_sessions, replicate, sim_requests
from smetric.workload.e2e_sweep import RouterSpec, SweepConfig, run_point
from smetric.workload.sweep import evaluate, run_at


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sim_vs_emulator", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+", default=["smetric", "least_load"])
    ap.add_argument("--ladder", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--profile", default="qwen3-30b-a3b-h20")
    ap.add_argument("--sessions", type=int, default=12, help="first N bundled sessions")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=1.0)
    args = ap.parse_args(argv)

    profile = load_profile(args.profile)
    slo = SLOModel(profile)
    cfg = SweepConfig(
        workers=args.workers,
        profile=args.profile,
        time_scale=args.time_scale,
        copies=args.copies,
        sessions=args.sessions,
    )
    sessions = replicate(load_sessions(limit=args.sessions), args.copies)
    requests = sim_requests(sessions, cfg.session_gap_s, cfg.think_s)
    print(
        f"{len(sessions)} sessions ({len(requests)} requests), {args.workers} workers "
        f"({profile.name}), emulator at x{args.time_scale:g} time, global tier on"
    )
    print(
        f"{'policy':<12} {'load':>5} {'sim TPS':>9} {'emu TPS':>9} {'emu/sim':>8} "
        f"{'sim p90 TTFT':>13} {'emu p90 TTFT':>13} {'sim SLO':>8} {'emu SLO':>8}"
    )
    worst = 0.0
    for policy in args.policies:
        peaks = [0.0, 0.0]
        for factor in args.ladder:
            sim = evaluate(
                policy,
                factor,
                run_at(requests, policy, factor, profile, args.workers, GlobalTierConfig()),
                slo,
            )
            emu = asyncio.run(run_point(RouterSpec("smetric", policy), sessions, factor, cfg))
            if sim.meets_slo:
                peaks[0] = max(peaks[0], sim.tps)
            if emu.meets_slo:
                peaks[1] = max(peaks[1], emu.tps)
            print(
                f"{policy:<12} x{factor:<4g} {sim.tps:>9.0f} {emu.tps:>9.0f} "
                f"{emu.tps / sim.tps:>7.3f}x {sim.ttft_p90_s * 1e3:>10.0f} ms "
                f"{emu.ttft_p90_s * 1e3:>10.0f} ms {'ok' if sim.meets_slo else 'miss':>8} "
                f"{'ok' if emu.meets_slo else 'miss':>8}",
                flush=True,
            )
        ratio = peaks[1] / peaks[0] if peaks[0] else 0.0
        worst = max(worst, abs(ratio - 1.0))
        print(
            f"{policy:<12} peak TPS under SLO: simulator {peaks[0]:.0f}, emulator {peaks[1]:.0f} "
            f"({ratio:.3f}x)",
            flush=True,
        )
    print(f"largest peak disagreement: {worst:.1%} (target: within 10%)")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
