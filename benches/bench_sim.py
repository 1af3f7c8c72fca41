"""Simulator speed: requests simulated per CPU-second.

    python benches/bench_sim.py            # the whole Mooncake conversation trace, 16 instances

Under pytest it replays a 1,000-request slice (the CI keeps it from rotting).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from smetric.perf import PRESETS
from smetric.sim import least_loaded, simulate
from smetric.workload.mooncake import load_mooncake

TRACE = (
    Path(__file__).resolve().parents[2]
    / "shared"
    / "traces"
    / "mooncake"
    / "conversation_trace.jsonl"
)


def replay(limit: int | None = None, workers: int = 16, profile: str = "qwen2.5-7b-h200") -> dict:
    requests = load_mooncake(TRACE, limit=limit)
    result = simulate(requests, least_loaded, PRESETS[profile], workers=workers)
    return {
        "requests": len(result.requests),
        "errors": sum(r.error is not None for r in result.requests),
        "instances": workers,
        "iterations": result.iterations,
        "simulated_s": round(result.makespan_s, 1),
        "cpu_s": round(result.cpu_s, 2),
        "requests_per_cpu_s": round(len(result.requests) / result.cpu_s),
    }


@pytest.mark.skipif(not TRACE.exists(), reason="shared traces not present")
def test_simulator_speed_on_a_mooncake_slice(benchmark):
    out = benchmark.pedantic(replay, kwargs={"limit": 1000}, rounds=1, iterations=1)
    benchmark.extra_info.update(out)
    assert out["requests"] == 1000 and out["errors"] == 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--profile", default="qwen2.5-7b-h200")
    a = ap.parse_args()
    print(json.dumps(replay(a.limit, a.workers, a.profile), indent=2))
