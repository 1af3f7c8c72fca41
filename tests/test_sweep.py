"""Load sweeps in the simulator: peak TPS under SLO."""

from __future__ import annotations

import pytest

from smetric import BlockKeys
from smetric.cli import main
from smetric.perf import PRESETS
from smetric.sim import SimRequest
from smetric.workload.sweep import peak_tps, scale_arrivals, sweep

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
