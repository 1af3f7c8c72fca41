"""The replay client (`smetric replay`): agent sessions and hash-id trace rows against emulated
SGLang workers, with and without the router in front; JSONL results and their summary."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from aiohttp import web

from smetric.cli import main
from smetric.emulator import EmulatedCluster
from smetric.perf import PRESETS
from smetric.request import BYTES_PER_TOKEN
from smetric.router import Router, RouterConfig
from smetric.slo import SLOModel
from smetric.workload.agents import load_sessions
from smetric.workload.mooncake import TraceRow, read_trace
from smetric.workload.replay import (
    HASH_BLOCK_BYTES,
    THINK_MAX_S,
    TurnResult,
    block_text,
    replay_to_file,
    sampled_think_s,
    summarize,
    trace_prompt,
)

PROFILE = PRESETS["qwen2.5-7b-h200"]
FAST = 20.0  # emulated time runs 20x faster: the tests check behaviour, not timing


@contextmanager
def serving(workers: int = 2, policy: str | None = "smetric") -> Iterator[tuple[str, list[str]]]:
    """An emulated cluster (and a router in front unless ``policy`` is None) on an event loop in
    a thread of its own, so that the test can drive the CLI, which runs its own loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cluster = EmulatedCluster(PROFILE, workers=workers, time_scale=FAST)
    runners: list[web.AppRunner] = []

    async def start() -> str:
        urls = await cluster.start()
        if policy is None:
            return urls[0]
        config = RouterConfig(worker_urls=urls, policy=policy, profile=PROFILE.name, port=0)
        runner = web.AppRunner(Router(config).app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[-1][1]}"

    async def stop() -> None:
        for runner in runners:
            await runner.cleanup()
        await cluster.stop()

    try:
        url = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
        yield url, cluster.urls
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def lower_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def test_agent_sessions_through_the_router_give_jsonl_that_the_summary_agrees_with(tmp_path):
    sessions = load_sessions(limit=2)
    turns = sum(len(s.turns) for s in sessions)
    slo = SLOModel(PROFILE)
    out = tmp_path / "agents.jsonl"
    with serving() as (url, workers), out.open("w") as f:
        summary = asyncio.run(
            replay_to_file(url, sessions, f, slo, time_scale=FAST, seed=3, start_gap_s=1.0)
        )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == turns and all(r["ok"] for r in rows)
    assert {(r["session"], r["turn"]) for r in rows} == {
        (s.session_id, k) for s in sessions for k in range(len(s.turns))
    }
    # The router names the worker and its reason; SMetric spreads first turns, then sticks.
    assert {r["worker"] for r in rows} <= set(workers)
    assert {r["reason"] for r in rows if r["turn"] == 0} == {"first_turn_balance"}
    assert all(r["cached_tokens"] > 0 for r in rows if r["turn"] > 0)

    assert summary["requests"] == turns and summary["errors"] == 0
    window = max(r["start_s"] + r["e2e_s"] for r in rows) - min(r["start_s"] for r in rows)
    tokens = sum(r["prompt_tokens"] + r["output_tokens"] for r in rows)
    assert summary["tps"] == pytest.approx(tokens / window)
    ttfts = [r["ttft_s"] for r in rows]
    tpots = [r["tpot_s"] for r in rows if r["tpot_s"] is not None]
    assert summary["ttft_p90_ms"] == pytest.approx(1e3 * lower_rank(ttfts, 0.9))
    assert summary["tpot_p50_ms"] == pytest.approx(1e3 * lower_rank(tpots, 0.5))
    assert summary["slo_attainment"] == sum(r["met_slo"] for r in rows) / turns
    met_ttft = [r["ttft_s"] <= slo.ttft_slo_s(r["prompt_tokens"]) for r in rows]
    assert summary["ttft_attainment"] == sum(met_ttft) / turns
    cached = sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows)
    assert summary["cache_hit"] == pytest.approx(cached)
    assert sum(summary["workers"].values()) == turns


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


TRACE = [
    {"timestamp": 0, "input_length": 1536, "output_length": 8, "hash_ids": [1, 2, 3]},
    {"timestamp": 4000, "input_length": 1800, "output_length": 5, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 4000, "input_length": 300, "output_length": 3, "hash_ids": [9]},
]


def test_cli_replays_hash_id_rows_at_their_timestamps_sharing_blocks_as_their_ids_do(
    tmp_path, capsys
):
    trace = write_trace(tmp_path / "trace.jsonl", TRACE)
    out = tmp_path / "rows.jsonl"
    with serving(workers=1, policy=None) as (url, _):
        argv = ["replay", "--url", url, "--trace", "mooncake", "--path", str(trace)]
        assert main([*argv, "--time-scale", str(FAST), "--out", str(out)]) == 0
        rows = {r["session"]: r for r in map(json.loads, out.read_text().splitlines())}
        assert main([*argv, "--time-scale", str(FAST), "--scale", "4", "--out", str(out)]) == 0
        faster = {r["session"]: r for r in map(json.loads, out.read_text().splitlines())}
    printed = capsys.readouterr().out
    assert "requests 3, errors 0" in printed and f"wrote {out}" in printed

    first, follow_up, other = rows["r0"], rows["r1"], rows["r2"]
    assert [r["output_tokens"] for r in (first, follow_up, other)] == [8, 5, 3]
    for r, spec in zip((first, follow_up, other), TRACE, strict=True):
        assert r["prompt_tokens"] == pytest.approx(spec["input_length"], rel=0.01)
    # r1 repeats r0's three blocks: the worker has exactly those cached; r2 shares nothing.
    assert follow_up["cached_tokens"] == pytest.approx(
        3 * HASH_BLOCK_BYTES / BYTES_PER_TOKEN, abs=1
    )
    assert first["cached_tokens"] == 0 and other["cached_tokens"] == 0
    assert first["worker"] is None and first["reason"] is None  # no router in front
    # Arrivals at the timestamps, in model seconds; x4 load, four times sooner.
    assert first["start_s"] < 0.5 and 3.9 < follow_up["start_s"] < 5.0
    assert 0.9 < faster["r1"]["start_s"] < 2.0


def test_hash_id_blocks_are_a_function_of_the_id_and_prompts_share_prefixes_as_ids_do():
    assert block_text(5) == block_text(5) and len(block_text(5)) == HASH_BLOCK_BYTES
    assert block_text(5)[:64] != block_text(6)[:64]
    a = trace_prompt(TraceRow(0.0, 1536, 1, (1, 2, 3)))
    b = trace_prompt(TraceRow(0.0, 1800, 1, (1, 2, 3, 4)))
    c = trace_prompt(TraceRow(0.0, 1800, 1, (1, 7, 3, 4)))
    assert a == block_text(1) + block_text(2) + block_text(3) and b.startswith(a)
    assert c.startswith(block_text(1)) and c[HASH_BLOCK_BYTES:] != b[HASH_BLOCK_BYTES:]
    assert len(b.encode()) / BYTES_PER_TOKEN == pytest.approx(1800, rel=0.01)


def test_trace_loader_reads_rows_and_names_the_line_of_a_bad_one(tmp_path):
    rows = read_trace(write_trace(tmp_path / "t.jsonl", TRACE), limit=2)
    assert [(r.timestamp_s, r.hash_ids) for r in rows] == [(0.0, (1, 2, 3)), (4.0, (1, 2, 3, 4))]
    bad = write_trace(tmp_path / "bad.jsonl", [TRACE[0], {**TRACE[1], "hash_ids": [1, 2]}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*2 hash ids for 1800 input tokens"):
        read_trace(bad)
    with pytest.raises(ValueError, match=r"t2\.jsonl:1: .*no 'input_length' field"):
        read_trace(write_trace(tmp_path / "t2.jsonl", [{"timestamp": 0, "hash_ids": [1]}]))


def test_unrecorded_think_times_are_seeded_per_session_and_turn_with_the_recorded_spread():
    assert sampled_think_s(1, "s", 2) == sampled_think_s(1, "s", 2)
    assert sampled_think_s(1, "s", 2) != sampled_think_s(2, "s", 2)
    assert sampled_think_s(1, "s", 2) != sampled_think_s(1, "s", 3)
    draws = [sampled_think_s(0, f"s{i}", 1) for i in range(4000)]
    assert statistics.median(draws) == pytest.approx(0.27, rel=0.1)
    assert lower_rank(draws, 0.9) == pytest.approx(1.14, rel=0.15)
    assert max(draws) <= THINK_MAX_S


def result(ok: bool, start: float, ttft: float, prompt: int, cached: int = 0) -> TurnResult:
    return TurnResult(
        "s",
        0,
        ok,
        ttft_s=ttft,
        tpot_s=0.01 if ok else None,
        e2e_s=ttft + 1.0 if ok else 0.0,
        prompt_tokens=prompt,
        output_tokens=10 if ok else 0,
        cached_tokens=cached,
        worker="w0" if ok else None,
        reason="stick" if ok else None,
        error=None if ok else "HTTP 503",
        start_s=start,
    )


def test_a_failed_request_counts_against_attainment_but_not_in_tokens_or_latency():
    slo = SLOModel(PROFILE)
    tight = 0.5 * slo.ttft_slo_s(4000)
    results = [
        result(True, 0.0, tight, 4000, cached=1000),
        result(True, 2.0, 10 * slo.ttft_slo_s(4000), 4000, cached=3000),
        result(False, 1.0, 0.0, 4000),
    ]
    s = summarize(results, slo)
    assert s["requests"] == 3 and s["errors"] == 1
    assert s["ttft_attainment"] == pytest.approx(1 / 3) and s["tpot_attainment"] == pytest.approx(
        2 / 3
    )
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    window = 2.0 + 10 * slo.ttft_slo_s(4000) + 1.0
    assert s["window_s"] == pytest.approx(window) and s["tps"] == pytest.approx(8020 / window)
    assert s["cache_hit"] == 0.5 and s["ttft_p50_ms"] == pytest.approx(1e3 * tight)
    assert summarize([], slo)["ttft_p90_ms"] is None


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_replay_rejects_bad_flags_bad_traces_and_unreachable_urls(tmp_path, capsys):
    bad_trace = write_trace(tmp_path / "bad.jsonl", [{"timestamp": 0}])
    for bad in (
        ["replay"],
        ["replay", "--url", "ftp://x"],
        ["replay", "--url", "http://x", "--trace", "mooncake"],
        ["replay", "--url", "http://x", "--scale", "0"],
        ["replay", "--url", "http://x", "--limit", "0"],
        ["replay", "--url", "http://x", "--tpot-slo-ms", "-1"],
        ["replay", "--url", "http://x", "--profile", "nope"],
        ["replay", "--url", "http://x", "--path", str(tmp_path / "missing.jsonl")],
        ["replay", "--url", "http://x", "--trace", "mooncake", "--path", str(bad_trace)],
    ):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2, bad
    assert "bad.jsonl:1" in capsys.readouterr().err
    out = tmp_path / "never.jsonl"
    url = f"http://127.0.0.1:{closed_port()}"
    assert main(["replay", "--url", url, "--limit", "1", "--out", str(out)]) == 2
    assert "nothing answers at" in capsys.readouterr().err and not out.exists()
