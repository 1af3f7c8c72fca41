"""The end-to-end sweep: workload shaping, scoring, and a tiny real run of our router and
sglang-router 0.3.2 on fresh emulated clusters."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from smetric.perf import PRESETS
from smetric.slo import SLOModel
from smetric.workload import e2e_sweep
from smetric.workload.agents import load_sessions
from smetric.workload.e2e_sweep import (
    E2EPoint,
    RouterSpec,
    SweepConfig,
    evaluate,
    main,
    parse_routers,
    peak_tps,
    sweep,
    table,
)
from smetric.workload.replay import TurnResult

PROFILE = PRESETS["qwen2.5-7b-h200"]


def turn(ttft_s: float, tpot_s: float | None, prompt: int = 4000, ok: bool = True) -> TurnResult:
    return TurnResult("s", 0, ok, ttft_s, tpot_s, 1.0, prompt, 100, prompt // 2, None, None)


def test_a_run_meets_the_slo_when_90_percent_meet_each_bound():
    slo = SLOModel(PROFILE)
    fast, slow = slo.ttft_slo_s(4000) * 0.5, slo.ttft_slo_s(4000) * 2
    nine_good = [turn(fast, 0.02)] * 9
    met = evaluate("r", 2.0, [*nine_good, turn(slow, 0.02)], 10.0, slo, (6, 4))
    assert met.meets_slo and met.ttft_attainment == 0.9 and met.tpot_attainment == 1.0
    assert met.tps == 10 * 4100 / 10.0 and met.cached == 0.5 and met.per_worker == (6, 4)
    slow_tpot = evaluate("r", 2.0, [*nine_good[:8], turn(fast, 0.5), turn(fast, 0.2)], 10.0, slo)
    assert not slow_tpot.meets_slo and slow_tpot.tpot_attainment == 0.8
    assert slow_tpot.ttft_attainment == 1.0
    # A failed request misses both bounds and serves no tokens.
    failed = evaluate("r", 2.0, [*nine_good[:8], turn(0, None, ok=False), turn(slow, 0.02)], 1, slo)
    assert not failed.meets_slo and failed.errors == 1 and failed.tps == 9 * 4100
    assert not evaluate("r", 1.0, [], 1.0, slo).meets_slo
    assert peak_tps([met, slow_tpot]) == met.tps and peak_tps([slow_tpot]) == 0.0


def test_router_names_are_checked():
    assert parse_routers(["smetric/lmetric", "sglang-router/power_of_two"]) == [
        RouterSpec("smetric", "lmetric"),
        RouterSpec("sglang-router", "power_of_two"),
    ]
    for bad in ("smetric/nope", "sglang-router/lmetric", "nginx/round_robin", "smetric"):
        with pytest.raises(ValueError):
            parse_routers([bad])
    for argv in (["--routers", "smetric/nope"], ["--workers", "0"], ["--ladder", "0"]):
        with pytest.raises(SystemExit):
            main(argv)


def test_smetric_sweep_e2e_is_this_sweep(capsys):
    from smetric.cli import main as cli

    with pytest.raises(SystemExit) as e:
        cli(["sweep", "--e2e", "--help"])
    assert e.value.code == 0 and "smetric sweep --e2e" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli(["sweep", "--e2e", "--routers", "smetric/nope"])
    assert e.value.code == 2


def test_each_router_climbs_until_a_miss_then_bisects(monkeypatch):
    calls = []

    async def fake_run_point(spec, sessions, factor, cfg):
        calls.append((spec.label, factor))
        tps = 1000 * factor
        limit = 5.0 if spec.router == "smetric" else 100.0
        return E2EPoint(spec.label, factor, 1, 0, tps, 1, 1, 0, 0, 0, (), factor <= limit)

    monkeypatch.setattr(e2e_sweep, "run_point", fake_run_point)
    cfg = SweepConfig(ladder=(2.0, 4.0, 8.0, 16.0), refine=2, sessions=1)
    routers = [RouterSpec("smetric", "smetric"), RouterSpec("sglang-router", "cache_aware")]
    results = sweep(routers, cfg)
    ours = [f for label, f in calls if label == "smetric/smetric"]
    # x8 missed: bisect between x4 and x8 (x5.66 misses, then x4.76 meets).
    assert ours[:3] == [2.0, 4.0, 8.0] and len(ours) == 5
    assert ours[3] == pytest.approx(32**0.5) and ours[4] == pytest.approx((4 * 32**0.5) ** 0.5)
    assert peak_tps(results["smetric/smetric"]) == pytest.approx(1000 * ours[4])
    # Never missed: the whole ladder, no bisection.
    assert [f for label, f in calls if label.startswith("sglang")] == [2.0, 4.0, 8.0, 16.0]
    assert "| 4757 | x4.76 |" in table(results) and "| x5.66 |" in table(results)


def _children() -> set[int]:
    """This process's live child processes, from /proc."""
    me, out = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                out.add(int(entry.name))
    return out


def test_a_tiny_sweep_runs_both_routers_end_to_end_and_cleans_up():
    before = _children()
    cfg = SweepConfig(
        workers=2,
        profile="qwen2.5-7b-h200",
        time_scale=8.0,
        copies=1,
        sessions=3,
        ladder=(4.0, 8.0),
        refine=0,
    )
    routers = [RouterSpec("smetric", "smetric"), RouterSpec("sglang-router", "round_robin")]
    seen = []
    results = sweep(routers, cfg, progress=seen.append)
    turns = sum(len(s.turns) for s in load_sessions(limit=3))
    assert list(results) == ["smetric/smetric", "sglang-router/round_robin"]
    for points in results.values():
        assert [p.factor for p in points] in ([4.0], [4.0, 8.0])  # climbs until a miss
        for p in points:
            assert p.requests == turns and p.errors == 0 and p.tps > 0
            assert sum(p.per_worker) == turns  # every turn reached exactly one worker
            assert 0 < p.cached < 1  # follow-up turns hit the cache they built
    # Round robin spreads the turns evenly over the two workers.
    first, second = results["sglang-router/round_robin"][0].per_worker
    assert abs(first - second) <= 1
    assert seen == [p for points in results.values() for p in points]
    report = table(results)
    assert "| smetric/smetric |" in report and "| sglang-router/round_robin |" in report
    assert _children() == before  # every emulator and router stopped


def test_pd_runs_give_both_routers_prefill_and_decode_pools():
    from smetric.workload.e2e_sweep import router_command

    cfg = SweepConfig(pd=(1, 2))
    urls = ["http://p0", "http://d0", "http://d1"]
    for spec in (RouterSpec("smetric", "smetric"), RouterSpec("sglang-router", "round_robin")):
        cmd = router_command(spec, urls, 9000, cfg)
        assert "--worker-urls" not in cmd and "--pd-disaggregation" in cmd
        i = cmd.index("--prefill")
        assert cmd[i : i + 3] == ["--prefill", "http://p0", "8998"]
        decodes = [cmd[j + 1] for j, a in enumerate(cmd) if a == "--decode"]
        assert decodes == ["http://d0", "http://d1"]
    assert cfg.worker_count == 3 and SweepConfig().worker_count == 4
    with pytest.raises(SystemExit):
        main(["--pd", "1"])
