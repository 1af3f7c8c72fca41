"""Load sweeps in the simulator: peak TPS under SLO."""

from __future__ import annotations

import dataclasses
import json

import pytest

from smetric import BlockKeys
from smetric.cli import main
from smetric.perf import DEFAULT_PROFILE, PRESETS
from smetric.sim import RequestResult, SimRequest, SimResult
from smetric.slo import SLOModel
from smetric.workload.agents import load_sessions
from smetric.workload.sweep import (
    SWEEP_FORMAT,
    Point,
    common_factor,
    evaluate,
    peak_tps,
    scale_arrivals,
    sweep,
)

PROFILE = PRESETS["qwen2.5-7b-h200"]


def requests(n: int = 60, gap: float = 0.2) -> list[SimRequest]:
    return [
        SimRequest(
            f"r{i}",
            4000,
            50,
            BlockKeys.from_ids(range(i << 20, (i << 20) + 250)),
            16,
            arrival_s=i * gap,
        )
        for i in range(n)
    ]


def test_scaling_compresses_arrivals_and_think_times():
    follow = SimRequest("b", 100, 1, BlockKeys.from_ids([1]), 16, after="r0", delay_s=2.0)
    scaled = scale_arrivals([*requests(2, gap=1.0), follow], 4.0)
    assert [r.arrival_s for r in scaled] == [0.0, 0.25, None]
    assert scaled[2].delay_s == 0.5


def test_a_sweep_raises_load_until_the_slo_breaks_and_reports_the_peak():
    ladder = (1.0, 1.2, 64.0, 256.0)
    points = sweep(requests(), ["least_load"], PROFILE, workers=1, ladder=ladder, refine=3)[
        "least_load"
    ]
    assert [p.meets_slo for p in points][:3] == [True, True, False]
    assert all(p.factor not in (256.0,) for p in points)  # stopped climbing at the first miss
    bisected = points[3:]
    assert len(bisected) == 3 and all(1.2 < p.factor < 64.0 for p in bisected)
    assert points[1].tps > points[0].tps  # more load, more tokens per second while under SLO
    assert peak_tps(points) == max(p.tps for p in points if p.meets_slo)
    assert peak_tps([]) == 0.0


def test_cli_sweep_on_the_bundled_sessions(capsys):
    assert main(["sweep", "--limit", "3", "--policies", "smetric", "least_load"]) == 0
    out = capsys.readouterr().out
    assert "peak TPS under SLO" in out and "smetric" in out
    for bad in (
        ["sweep", "--policies", "nope"],
        ["sweep", "--trace", "mooncake"],
        ["sweep", "--workers", "0"],
    ):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2


def test_a_point_carries_latency_percentiles_decisions_migrations_and_load_imbalance():
    ttfts, tpots = [0.1, 0.2, 0.3, 0.4], [0.01, 0.02, 0.03, 0.04]
    ok = [
        RequestResult(f"r{i}", "w0" if i < 3 else "w1", 0.0, ttft, tpot, 1.0, 1000, 10, 500, 100)
        for i, (ttft, tpot) in enumerate(zip(ttfts, tpots, strict=True))
    ]
    failed = RequestResult("r4", "", 0.0, None, None, None, 1000, 0, 0, 0, error="too large")
    decisions = {"stick": 2, "migrate_slo": 1, "migrate_over_slo": 1, "first_turn_balance": 1}
    result = SimResult([*ok, failed], {"w0": [], "w1": [], "w2": []}, 2.0, 0.0, 0, decisions)
    slo = SLOModel(PROFILE)
    p = evaluate("smetric", 2.0, result, slo)
    assert (p.requests, p.errors) == (5, 1)
    assert (p.ttft_p50_s, p.ttft_p90_s, p.ttft_p99_s) == (ttfts[1], ttfts[2], ttfts[2])
    assert p.tpot_p50_s == tpots[1] and p.tpot_p99_s == tpots[2]
    met = [t <= slo.ttft_slo_s(1000) for t in ttfts]
    assert p.ttft_attainment == sum(met) / 5 and p.slo_attainment == sum(met) / 5
    assert p.decisions == decisions and p.migrations == 2
    # Prompt tokens served: w0 3000, w1 1000, w2 none; the mean is 4000 / 3.
    assert p.load_imbalance == pytest.approx(3000 / (4000 / 3))
    assert (p.local_hit, p.global_hit) == (0.5, 0.1)
    assert p.tps == pytest.approx(4 * 1010 / 2.0)


def test_the_common_load_is_the_highest_every_policy_met_else_the_lowest_run():
    def pt(policy: str, factor: float, meets: bool) -> Point:
        return Point(policy, factor, 1.0, 1.0, 1.0, 0.1, 0.0, 0.0, meets)

    met = {
        "a": [pt("a", 1.0, True), pt("a", 2.0, True), pt("a", 3.0, True), pt("a", 4.0, False)],
        "b": [pt("b", 1.0, True), pt("b", 2.0, True), pt("b", 3.0, False)],
    }
    assert common_factor(met) == 2.0
    assert common_factor({**met, "c": [pt("c", 1.0, False)]}) == 1.0


def test_cli_sweep_out_writes_every_point_and_the_load_over_time_at_the_common_load(tmp_path):
    argv = ["sweep", "--limit", "3", "--workers", "2", "--policies", "smetric", "least_load"]
    assert main([*argv, "--out", str(tmp_path / "sw")]) == 0

    def no_infinity(token: str) -> None:
        raise AssertionError(f"{token} in sweep.json")

    doc = json.loads((tmp_path / "sw" / "sweep.json").read_text(), parse_constant=no_infinity)
    assert doc["format"] == SWEEP_FORMAT
    assert doc["workload"]["trace"] == "agents" and doc["workload"]["limit"] == 3
    assert doc["workers"] == 2 and doc["profile"] == PRESETS[DEFAULT_PROFILE].name
    assert doc["global_tier"]["capacity_tokens"] > 0
    assert doc["slo"] == {
        "ttft_slo_scale": 5.0,
        "ttft_slo_ms": None,
        "tpot_slo_ms": 100.0,
        "attainment": 0.9,
    }
    assert list(doc["policies"]) == ["smetric", "least_load"]
    fields = {f.name for f in dataclasses.fields(Point)}
    requests = doc["workload"]["requests"]
    for name, entry in doc["policies"].items():
        points = entry["points"]
        assert all(set(p) == fields and p["policy"] == name for p in points)
        assert all(sum(p["decisions"].values()) == requests for p in points)
        assert entry["peak_tps"] == max(p["tps"] for p in points if p["meets_slo"])
        assert doc["common_factor"] in {p["factor"] for p in points if p["meets_slo"]}
        series = entry["load_over_time"]
        assert set(series["instances"]) == {"w0", "w1"} and series["t_s"]
        for samples in series["instances"].values():
            assert all(len(v) == len(series["t_s"]) for v in samples.values())
        busiest = max(sum(s["running"]) for s in series["instances"].values())
        assert busiest > 0
    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(tmp_path / "sw" / "sweep.json")])  # a file, not a folder
    assert e.value.code == 2


def test_smetric_in_a_sweep_predicts_with_the_sweeps_profile_slos_and_tier():
    from smetric.engine import GlobalTierConfig
    from smetric.slo import SLOConfig
    from smetric.workload.sweep import ABLATIONS, sweep_policy

    h20 = PRESETS["qwen3-30b-a3b-h20"]
    tier = GlobalTierConfig(load_bytes_per_s=10e9)
    policy = sweep_policy("smetric", h20, tier, SLOConfig(ttft_slo_scale=3.0))
    slo = policy.slo  # type: ignore[attr-defined]
    assert slo.profile.name == h20.name != DEFAULT_PROFILE
    assert (slo.config.ttft_slo_scale, slo.config.global_tier) == (3.0, True)
    assert slo.config.global_load_bytes_per_s == 10e9
    assert not sweep_policy("smetric", h20, None).slo.config.global_tier  # type: ignore[attr-defined]
    for name, change in ABLATIONS.items():
        cfg = sweep_policy(name, h20, tier).config  # type: ignore[attr-defined]
        assert all(getattr(cfg, k) == v for k, v in change.items()), name
    assert sweep_policy("lmetric", h20, tier).name == "lmetric"


def test_cli_sweeps_ablations_pd_copies_and_other_slos(capsys, tmp_path):
    args = ["sweep", "--limit", "2", "--workers", "2", "--copies", "2", "--ttft-slo-scale", "3"]
    args += ["--policies", "smetric-no-migration", "least_load", "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "TTFT SLO 3x idle" in out and "smetric-no-migration" in out
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert doc["slo"]["ttft_slo_scale"] == 3.0 and "x2 copies" in doc["workload"]["name"]
    assert doc["workload"]["requests"] == 2 * sum(len(s.turns) for s in load_sessions(limit=2))
    assert main(["sweep", "--limit", "1", "--pd", "1,1", "--policies", "smetric"]) == 0
    assert "PD 1+1 workers" in capsys.readouterr().out
    assert main(["sweep", "--limit", "1", "--ladder", "3", "5", "--policies", "least_load"]) == 0
    factors = [
        line.split()[1]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("  least_load")
    ]
    assert factors[:2] == ["x3", "x5"]
    for bad in (
        ["sweep", "--copies", "0"],
        ["sweep", "--trace", "generated", "--copies", "2"],
        ["sweep", "--pd", "1"],
        ["sweep", "--pd", "0,1"],
        ["sweep", "--ttft-slo-scale", "0"],
        ["sweep", "--ladder", "2", "1"],
        ["sweep", "--ladder", "0", "1"],
    ):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2


def test_policies_can_see_hits_as_the_router_does_from_the_moment_of_routing():
    from smetric.policies import make_policy
    from smetric.sim import policy_route, simulate

    # Four requests sharing a long prefix arrive together: the engines hold nothing until the
    # first is prefilled, but a router's index counts the prefix as held where it sent it.
    shared = list(range(900))
    reqs = [
        SimRequest(f"r{i}", 16_000, 10, BlockKeys.from_ids([*shared, 10_000 + i]), 16, arrival_s=0)
        for i in range(4)
    ]

    def workers(routed: bool) -> set[str]:
        route = policy_route(make_policy("cache_aware"), routed_index=routed)
        return {r.worker for r in simulate(reqs, route, PROFILE, workers=4).requests}

    assert workers(routed=True) == {"w0"}  # every one follows the first to its prefix
    assert len(workers(routed=False)) == 4  # no hit anywhere yet: balanced
