"""The emulated SGLang worker over HTTP: timing, API shapes, faults, bad input, PD, and agreement
with the simulator on the same workload."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from smetric.emulator import EmulatedCluster
from smetric.engine import EngineConfig
from smetric.perf import PRESETS
from smetric.request import key_text
from smetric.sim import SimRequest, simulate

PROFILE = PRESETS["qwen2.5-7b-h200"]
SHAPES = json.loads((Path(__file__).parent / "fixtures" / "sglang_api_shapes.json").read_text())
TYPES = {"str": str, "int": int, "float": float, "list": list, "dict": dict, "bool": bool}


def run(test: Callable[[EmulatedCluster, aiohttp.ClientSession], Awaitable[Any]], **kw: Any) -> Any:
    async def main() -> Any:
        cluster = EmulatedCluster(PROFILE, **{"workers": 2, **kw})
        await cluster.start()
        try:
            async with aiohttp.ClientSession() as session:
                return await test(cluster, session)
        finally:
            await cluster.stop()

    # Timing tests compare real time with the model: a collection of the test process's heap
    # (large late in the suite) inside a measured window is the test's own delay, not the
    # emulator's; the collector is back on after each run.
    gc.collect()
    gc.disable()
    try:
        return asyncio.run(main())
    finally:
        gc.enable()


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def text(tokens: int, seed: int = 0) -> str:
    """A text prompt of about ``tokens`` tokens, distinct per seed. (Timing tests send text: a
    long JSON list of ids costs the client and server, in this one process, milliseconds.)"""
    unit = f"<{seed:06d}> lorem ipsum "
    n = round(tokens * 3.4)
    return (unit * (n // len(unit) + 1))[:n]


async def stream_times(session, url: str, body: dict) -> tuple[float, list[float], list[dict]]:
    """Sends a streaming request; returns the send time, chunk arrival times and chunks. A health
    call first opens the connection, so the timing leaves out TCP set-up."""
    async with session.get(url.rsplit("/", 1)[0] + "/health") as r:
        await r.read()
    sent = time.perf_counter()
    times, chunks = [], []
    async with session.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                times.append(time.perf_counter())
                chunks.append(json.loads(line[6:]))
    return sent, times, chunks


def check_shape(obj: dict, spec: dict[str, str]) -> None:
    for key, kind in spec.items():
        assert key in obj, key
        assert isinstance(obj[key], TYPES[kind]), (key, obj[key])


# ---- timing -------------------------------------------------------------------------------


def test_single_request_ttft_and_tpot_follow_the_profile_in_real_time():
    # A long prompt (two prefill chunks) keeps the HTTP round trip well inside the 2% margin.
    prompt, out = text(16000), 60
    tokens = key_text(prompt).prompt_tokens

    async def test(cluster, session):
        return await stream_times(
            session,
            cluster.urls[0] + "/generate",
            {"text": prompt, "sampling_params": {"max_new_tokens": out}},
        )

    sent, times, chunks = run(test)
    assert len(chunks) == out and chunks[-1]["meta_info"]["prompt_tokens"] == tokens
    ttft = times[0] - sent
    # Tokens are paced on a fixed schedule from the second on: a late delivery (the event loop
    # busy elsewhere; client and server share it, on a machine its host sometimes slows) is
    # never early and the next is back on time. So the pace is measured between the least late
    # token of each half of the stream (a span from a given token is off by its lateness).
    steps = [PROFILE.decode_step_s(1, tokens + i) for i in range(2, out)]
    due = [0.0, *itertools.accumulate(steps)]  # tokens 1 .. out-1, after token 1
    late = [t - d for t, d in zip(times[1:], due, strict=True)]
    half = len(late) // 2
    a = min(range(half), key=late.__getitem__)
    b = min(range(half, len(late)), key=late.__getitem__)
    pace = (times[1 + b] - times[1 + a]) / (due[b] - due[a])
    chunks = PROFILE.prefill_time_s(8192) + PROFILE.prefill_time_s(tokens - 8192, 8192)
    assert ttft == pytest.approx(chunks, rel=0.02)
    assert pace == pytest.approx(1.0, rel=0.02)


def test_time_scale_runs_faster_than_real_time():
    prompt = text(8000)

    async def test(cluster, session):
        return await stream_times(
            session,
            cluster.urls[0] + "/generate",
            {"text": prompt, "sampling_params": {"max_new_tokens": 2}},
        )

    sent, times, _ = run(test, time_scale=4.0)
    tokens = key_text(prompt).prompt_tokens
    # The scaled engine time, plus the HTTP round trip (client and server share this process).
    scaled = PROFILE.prefill_time_s(tokens) / 4
    assert scaled <= times[0] - sent <= scaled + 0.010


def test_emulator_and_simulator_agree_on_the_same_workload():
    # 10 requests on 3 workers sharing a 3,000-token prefix, arrivals 70 ms apart: some queue,
    # some find the prefix in the local cache, some in the global tier (first visit to w2).
    n = 10
    shared = text(3000, seed=999)
    prompts = [shared + text(1000 + 100 * i, seed=i) for i in range(n)]
    worker_of = [0, 0, 1, 0, 1, 0, 2, 1, 2, 0]
    gap, out = 0.07, 4

    async def test(cluster, session):
        async def one(i: int) -> float:
            await asyncio.sleep(i * gap)
            sent, times, _ = await stream_times(
                session,
                cluster.urls[worker_of[i]] + "/generate",
                {"text": prompts[i], "sampling_params": {"max_new_tokens": out}},
            )
            return times[0] - sent

        return await asyncio.gather(*(one(i) for i in range(n)))

    emulated = run(test, workers=3)
    requests = []
    for i, p in enumerate(prompts):
        key = key_text(p)
        requests.append(
            SimRequest(
                str(i), key.prompt_tokens, out, key.keys, key.block_tokens, arrival_s=i * gap
            )
        )
    result = simulate(requests, lambda r, s: f"w{worker_of[int(r.rid)]}", PROFILE, workers=3)
    simulated = [r.ttft_s for r in sorted(result.requests, key=lambda r: int(r.rid))]
    assert statistics.mean(emulated) == pytest.approx(statistics.mean(simulated), rel=0.05)
    assert any(r.local_cached_tokens for r in result.requests)
    assert any(r.global_cached_tokens for r in result.requests)
    assert max(simulated) > 2 * min(simulated)  # some waited behind others


# ---- caching over HTTP --------------------------------------------------------------------


def test_cached_tokens_are_reported_for_a_repeated_prompt_and_across_workers():
    async def test(cluster, session):
        body = {"input_ids": ids(4096), "sampling_params": {"max_new_tokens": 2}}
        out = []
        for url in (cluster.urls[0], cluster.urls[0], cluster.urls[1]):
            async with session.post(url + "/generate", json=body) as resp:
                out.append((await resp.json())["meta_info"]["cached_tokens"])
        return out

    assert run(test) == [0, 4095, 4095]  # local cache, then the global tier


# ---- API shapes ---------------------------------------------------------------------------


def test_generate_and_openai_routes_match_sglang_shapes():
    async def test(cluster, session):
        url = cluster.urls[0]
        async with session.post(url + "/generate", json={"text": "hi " * 200}) as r:
            gen = await r.json()
        _, _, chunks = await stream_times(session, url + "/generate", {"text": "hello " * 50})
        chat_body = {
            "model": "m",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "book a flight"}],
            "tools": [{"type": "function", "function": {"name": "book", "parameters": {}}}],
        }
        async with session.post(url + "/v1/chat/completions", json=chat_body) as r:
            chat = await r.json()
        _, _, chat_chunks = await stream_times(
            session,
            url + "/v1/chat/completions",
            {**chat_body, "stream_options": {"include_usage": True}},
        )
        async with session.post(
            url + "/v1/completions", json={"prompt": "x" * 300, "max_tokens": 3}
        ) as r:
            comp = await r.json()
        return gen, chunks, chat, chat_chunks, comp

    gen, chunks, chat, chat_chunks, comp = run(test)
    spec = SHAPES["generate"]
    check_shape(gen, spec["keys"])
    check_shape(gen["meta_info"], spec["meta_info"])
    assert gen["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
    assert gen["meta_info"]["completion_tokens"] == 128  # SGLang's default max_new_tokens
    for c in chunks:
        check_shape(c, SHAPES["generate_stream_chunk"]["keys"])
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 129))  # cumulative
    assert chunks[-1]["text"].startswith(chunks[-2]["text"])
    assert chunks[-2]["meta_info"]["finish_reason"] is None
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"

    check_shape(chat, SHAPES["chat_completion"]["keys"])
    assert chat["object"] == "chat.completion" and chat["model"] == "m"
    check_shape(chat["choices"][0], SHAPES["chat_completion"]["choice"])
    check_shape(chat["choices"][0]["message"], SHAPES["chat_completion"]["message"])
    check_shape(chat["usage"], SHAPES["chat_completion"]["usage"])
    assert chat["usage"]["completion_tokens"] == 5
    for c in chat_chunks[:-1]:
        check_shape(c, SHAPES["chat_completion_chunk"]["keys"])
        assert c["object"] == "chat.completion.chunk"
    assert chat_chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chat_chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) == 5
    assert chat_chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chat_chunks[-1]["choices"] == [] and chat_chunks[-1]["usage"]["completion_tokens"] == 5

    check_shape(comp, SHAPES["completion"]["keys"])
    assert comp["object"] == "text_completion"
    check_shape(comp["choices"][0], SHAPES["completion"]["choice"])


def test_info_load_and_metrics_routes_match_sglang_shapes():
    async def test(cluster, session):
        url = cluster.urls[0]
        out = {}
        for path in (
            "/v1/loads",
            "/get_load",
            "/server_info",
            "/get_server_info",
            "/model_info",
            "/get_model_info",
            "/v1/models",
        ):
            async with session.get(url + path) as r:
                assert r.status == 200, path
                out[path] = await r.json()
        for path in ("/health", "/health_generate"):
            async with session.get(url + path) as r:
                out[path] = r.status
        async with session.post(url + "/generate", json={"text": "a" * 500}) as r:
            await r.read()
        async with session.get(url + "/metrics") as r:
            out["/metrics"] = await r.text()
        async with session.post(url + "/flush_cache") as r:
            out["/flush_cache"] = (r.status, await r.text())
        return out

    out = run(test)
    check_shape(out["/v1/loads"], SHAPES["v1_loads"]["keys"])
    check_shape(out["/v1/loads"]["loads"][0], SHAPES["v1_loads"]["load"])
    check_shape(out["/get_load"][0], SHAPES["get_load"]["item"])
    for path in ("/server_info", "/get_server_info"):
        check_shape(out[path], SHAPES["server_info"]["keys"])
    for path in ("/model_info", "/get_model_info"):
        check_shape(out[path], SHAPES["model_info"]["keys"])
    check_shape(out["/v1/models"], SHAPES["v1_models"]["keys"])
    check_shape(out["/v1/models"]["data"][0], SHAPES["v1_models"]["model"])
    assert out["/health"] == out["/health_generate"] == 200
    for name in SHAPES["metrics"]:
        assert name in out["/metrics"], name
    assert (
        'sglang:num_requests_total{model_name="default",engine_type="unified"} 1' in out["/metrics"]
    )
    assert out["/flush_cache"][0] == 200 and out["/flush_cache"][1].startswith("Cache flushed.")


# ---- bad input ----------------------------------------------------------------------------


GENERATE_BAD = [
    b"not json",
    b"[1, 2]",
    json.dumps({}).encode(),
    json.dumps({"text": "a", "input_ids": [1]}).encode(),
    json.dumps({"text": 5}).encode(),
    json.dumps({"input_ids": []}).encode(),
    json.dumps({"input_ids": [1, "2"]}).encode(),
    json.dumps({"input_ids": [-1]}).encode(),
    json.dumps({"text": "a", "sampling_params": {"max_new_tokens": -3}}).encode(),
    json.dumps({"text": "a", "sampling_params": {"max_new_tokens": "3"}}).encode(),
    json.dumps({"text": "a", "sampling_params": [1]}).encode(),
    json.dumps({"input_ids": [1] * 5000, "sampling_params": {"max_new_tokens": 1}}).encode(),
]
OPENAI_BAD = [
    ("/v1/chat/completions", b"{bad"),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": ["hi"]}).encode()),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "a"}], "max_tokens": -1}).encode(),
    ),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user"}], "tools": {}}).encode()),
    ("/v1/completions", json.dumps({"prompt": 5}).encode()),
    ("/v1/completions", json.dumps({}).encode()),
]


def test_bad_input_gets_sglang_like_400_errors_and_changes_nothing():
    async def test(cluster, session):
        url = cluster.urls[0]
        got = []
        for body in GENERATE_BAD:
            async with session.post(url + "/generate", data=body) as r:
                got.append(("gen", r.status, await r.json()))
        for path, body in OPENAI_BAD:
            async with session.post(url + path, data=body) as r:
                got.append(("openai", r.status, await r.json()))
        return got, cluster.workers[0].engine.requests_total

    got, admitted = run(test, config=EngineConfig(kv_pool_tokens=4000))
    for kind, status, body in got:
        assert status == 400, body
        if kind == "gen":
            check_shape(body, SHAPES["generate_error"]["keys"])
            check_shape(body["error"], SHAPES["generate_error"]["error"])
        else:
            check_shape(body, SHAPES["openai_error"]["keys"])
            assert body["object"] == "error" and body["code"] == 400
    assert "longer than the model's context length" in got[11][2]["error"]["message"]
    assert admitted == 0


# ---- faults -------------------------------------------------------------------------------


async def set_fault(session, url: str, **fault: Any) -> None:
    async with session.post(url + "/_emulator/fault", json=fault) as r:
        assert r.status == 200


def test_a_failing_worker_answers_500_and_fails_health_until_reset():
    async def test(cluster, session):
        url = cluster.urls[0]
        await set_fault(session, url, mode="fail")
        statuses = []
        async with session.post(url + "/generate", json={"text": "a" * 100}) as r:
            statuses.append(r.status)
        for path in ("/health", "/health_generate"):
            async with session.get(url + path) as r:
                statuses.append(r.status)
        await set_fault(session, url, mode="none")
        async with session.get(url + "/health") as r:
            statuses.append(r.status)
        return statuses

    assert run(test) == [500, 503, 503, 200]


def test_a_hanging_worker_never_answers():
    async def test(cluster, session):
        url = cluster.urls[0]
        await set_fault(session, url, mode="hang")
        timeout = aiohttp.ClientTimeout(total=0.3)
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(url + "/generate", json={"text": "a"}, timeout=timeout) as r:
                await r.read()
        with pytest.raises(asyncio.TimeoutError):
            async with session.get(url + "/health", timeout=timeout) as r:
                await r.read()

    run(test)


def test_a_slow_worker_takes_factor_times_longer():
    prompt = text(6000)
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 1}}

    async def test(cluster, session):
        await set_fault(session, cluster.urls[1], mode="slow", factor=3)
        sent, times, _ = await stream_times(session, cluster.urls[1] + "/generate", body)
        return times[0] - sent

    tokens = key_text(prompt).prompt_tokens
    assert run(test) == pytest.approx(3 * PROFILE.prefill_time_s(tokens), rel=0.05)


def test_a_dropping_worker_cuts_the_stream_mid_way():
    async def test(cluster, session):
        url = cluster.urls[0]
        await set_fault(session, url, mode="drop", after_tokens=3)
        lines = []
        with pytest.raises(aiohttp.ClientPayloadError):
            async with session.post(
                url + "/generate",
                json={"text": "a" * 100, "stream": True, "sampling_params": {"max_new_tokens": 20}},
            ) as r:
                async for line in r.content:
                    if line.strip():
                        lines.append(line)
        await asyncio.sleep(0.05)
        return lines, cluster.workers[0].engine.has_work()

    lines, busy = run(test)
    assert len(lines) == 3
    assert b"[DONE]" not in b"".join(lines)
    assert not busy  # the cut request was dropped from the engine


def test_a_client_that_disconnects_mid_stream_cancels_its_request():
    async def test(cluster, session):
        url = cluster.urls[0]
        body = {"text": "a" * 100, "stream": True, "sampling_params": {"max_new_tokens": 2000}}
        async with session.post(url + "/generate", json=body) as r:
            await r.content.readline()
            r.close()
        await asyncio.sleep(0.1)
        return cluster.workers[0].engine.has_work()

    assert run(test) is False


def test_fault_endpoint_rejects_bad_modes():
    async def test(cluster, session):
        async with session.post(
            cluster.urls[0] + "/_emulator/fault", json={"mode": "explode"}
        ) as r:
            return r.status

    assert run(test) == 400


# ---- PD -----------------------------------------------------------------------------------


def test_pd_decode_worker_streams_after_the_prefill_hands_over_the_kv():
    cfg = EngineConfig(pd_transfer_bytes_per_s=10e9, pd_transfer_latency_s=0.002)

    async def test(cluster, session):
        prefill, decode = cluster.urls
        body = {
            "input_ids": ids(6000),
            "sampling_params": {"max_new_tokens": 10},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": 8998,
            "bootstrap_room": 1234,
        }

        async def prefill_call():
            async with session.post(prefill + "/generate", json=body) as r:
                return r.status

        status, (sent, times, chunks) = await asyncio.gather(
            prefill_call(), stream_times(session, decode + "/generate", body)
        )
        async with session.post(decode + "/generate", json={"text": "a"}) as r:
            no_room = r.status
        return status, times[0] - sent, chunks, no_room

    status, ttft, chunks, no_room = run(test, workers=0, pd=(1, 1), config=cfg)
    tokens = key_text(text(6000)).prompt_tokens
    transfer = tokens * PROFILE.kv_bytes_per_token / 10e9 + 0.002
    first_step = PROFILE.decode_step_s(1, tokens)
    assert status == 200
    assert ttft == pytest.approx(PROFILE.prefill_time_s(tokens) + transfer + first_step, rel=0.05)
    assert len(chunks) == 10 and chunks[-1]["meta_info"]["prompt_tokens"] == tokens
    assert no_room == 400


def test_pd_decode_fails_cleanly_when_no_kv_arrives_and_rooms_are_single_use():
    async def test(cluster, session):
        prefill, decode = cluster.urls
        await set_fault(session, prefill, mode="fail")
        body = {"text": "a" * 300, "bootstrap_room": 7, "sampling_params": {"max_new_tokens": 2}}
        started = time.perf_counter()
        async with session.post(prefill + "/generate", json=body) as r:
            p_status = r.status
        async with session.post(decode + "/generate", json=body) as r:
            d_status, d_body = r.status, await r.json()
        waited = time.perf_counter() - started
        await set_fault(session, prefill, mode="none")
        body = {**body, "bootstrap_room": 8}

        async def decode_call():
            async with session.post(decode + "/generate", json=body) as r:
                return r.status

        first = asyncio.ensure_future(decode_call())
        await asyncio.sleep(0.05)
        second = await decode_call()  # same room while the first still waits
        async with session.post(prefill + "/generate", json=body) as r:
            await r.read()
        first_status = await first
        async with session.get(decode + "/metrics") as r:
            metrics = await r.text()
        return p_status, d_status, d_body, waited, first_status, second, metrics

    p, d, body, waited, first, second, metrics = run(test, workers=0, pd=(1, 1), pd_timeout_s=0.5)
    assert (p, d) == (500, 500) and "no KV arrived" in body["error"]["message"]
    assert waited < 2.0
    assert (first, second) == (200, 400)
    assert "sglang:time_to_first_token_seconds_count" in metrics
    assert (
        'sglang:time_to_first_token_seconds_count{model_name="default",engine_type="decode"} 1'
        in metrics
    )


def test_stopping_with_a_stream_open_ends_within_the_grace():
    """Stopping (Ctrl-C on ``smetric emulate``) stops the engines first, so a request still in
    flight can never finish: it is cancelled after ``STOP_GRACE_S``, not aiohttp's minute."""
    from smetric.emulator import STOP_GRACE_S

    async def main() -> float:
        cluster = EmulatedCluster(PROFILE, workers=1, time_scale=1.0)
        (url,) = await cluster.start()
        async with aiohttp.ClientSession() as s:
            body = {
                "text": "a " * 4000,
                "stream": True,
                "sampling_params": {"max_new_tokens": 5000},
            }
            async with s.post(url + "/generate", json=body) as r:
                await r.content.readline()  # streaming, with minutes to go
                t0 = time.perf_counter()
                await asyncio.wait_for(cluster.stop(), 30)
                return time.perf_counter() - t0

    took = asyncio.run(main())
    assert took < STOP_GRACE_S + 2.0
