"""The router end to end, in front of emulated SGLang workers: every policy and API, forwarding,
accounting, worker management, faults and bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from smetric._prefix_index import inject_members
from smetric.emulator import EmulatedCluster
from smetric.perf import PRESETS
from smetric.policies import POLICIES
from smetric.prom import merge_worker_metrics
from smetric.request import view_request, view_unkeyed
from smetric.router import Listening, Router, RouterConfig, listen, parse_config
from smetric.router import app as app_module
from smetric.router.app import Exchange
from smetric.router.workers import Worker

PROFILE = PRESETS["qwen2.5-7b-h200"]
FIXTURES = Path(__file__).parent / "fixtures"
FAST = 20.0  # emulated time runs 20x faster: the tests check behaviour, not timing


class Bed:
    def __init__(
        self, cluster: EmulatedCluster, router: Router, base: str, session: aiohttp.ClientSession
    ) -> None:
        self.cluster, self.router, self.base, self.session = cluster, router, base, session

    async def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any, Any]:
        async with self.session.post(self.base + path, json=body, **kw) as r:
            text = await r.text()
            try:
                data = json.loads(text)
            except ValueError:
                data = text
            return r.status, data, r.headers

    async def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        async with self.session.get(self.base + path, **kw) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text

    async def stream(self, path: str, body: dict, **kw: Any) -> tuple[int, list[bytes], Any]:
        lines = []
        async with self.session.post(self.base + path, json={**body, "stream": True}, **kw) as r:
            async for line in r.content:
                if line.strip():
                    lines.append(line.strip())
            return r.status, lines, r.headers

    @property
    def workers(self) -> dict[str, Worker]:
        """The router's workers, what has been answered booked: the Rust data plane queues the
        booking of each answer until the router next decides or reports (``Router.settle``)."""
        self.router.settle()
        return self.router.workers


DATA_PLANE = "rust"


@pytest.fixture(autouse=True, params=["rust", "aiohttp"])
def data_plane(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test here runs through both data planes (the Rust one is the default)."""
    global DATA_PLANE
    DATA_PLANE = request.param
    yield request.param
    DATA_PLANE = "rust"


async def start_router(config: RouterConfig) -> tuple[Router, Listening, str]:
    router = Router(dataclasses.replace(config, data_plane=DATA_PLANE))
    server = await listen(router, "127.0.0.1", 0)
    return router, server, f"http://127.0.0.1:{server.port}"


def run(
    test: Callable[[Bed], Awaitable[Any]],
    workers: int = 2,
    pd: tuple[int, int] | None = None,
    time_scale: float = FAST,
    **config: Any,
) -> Any:
    async def main() -> Any:
        cluster = EmulatedCluster(PROFILE, workers=workers, time_scale=time_scale, pd=pd)
        urls = await cluster.start()
        if pd:
            config.setdefault("pd_disaggregation", True)
            config.setdefault("prefill", [(u, 8998) for u in urls[: pd[0]]])
            config.setdefault("decode", urls[pd[0] :])
        else:
            config.setdefault("worker_urls", urls)
        router, runner, base = await start_router(RouterConfig(**config))
        try:
            async with aiohttp.ClientSession() as session:
                return await test(Bed(cluster, router, base, session))
        finally:
            await runner.close()
            await cluster.stop()

    return asyncio.run(main())


CHAT = {
    "messages": [
        {"role": "system", "content": "You are an airline agent. " * 60},
        {"role": "user", "content": "Book me a flight."},
    ],
    "max_tokens": 6,
}
GEN = {
    "text": "Summarise this log: " + "line of tool output\n" * 200,
    "sampling_params": {"max_new_tokens": 6},
}
COMP = {"prompt": "def fib(n):" + " pass\n" * 300, "max_tokens": 6}


# ---- every policy, every API --------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_serves_every_api_streaming_and_not(policy):
    async def test(bed: Bed):
        urls = set(bed.cluster.urls)
        status, body, headers = await bed.post("/generate", GEN)
        assert status == 200 and body["meta_info"]["completion_tokens"] == 6
        assert headers["X-SMetric-Worker"] in urls and headers["X-SMetric-Reason"]
        status, body, _ = await bed.post("/v1/chat/completions", CHAT)
        assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] == 6
        status, body, _ = await bed.post("/v1/completions", COMP)
        assert status == 200 and body["object"] == "text_completion"
        for path, payload in (
            ("/generate", GEN),
            ("/v1/chat/completions", CHAT),
            ("/v1/completions", COMP),
        ):
            status, lines, _ = await bed.stream(path, payload)
            assert status == 200 and lines[-1] == b"data: [DONE]"
            assert all(line.startswith(b"data: ") for line in lines)
        assert all(
            w.in_flight == 0 and w.queued_prefill_tokens == 0 and w.running_decode_tokens == 0
            for w in bed.workers.values()
        )
        return bed.router.decisions

    decisions = run(test, policy=policy)
    assert sum(n for (name, _), n in decisions.items() if name == policy) == 6


def test_cache_aware_sends_a_follow_up_turn_where_its_prefix_is():
    async def test(bed: Bed):
        turn1 = dict(CHAT)
        _, _, h1 = await bed.post("/v1/chat/completions", turn1)
        turn2 = {
            **CHAT,
            "messages": [
                *CHAT["messages"],
                {"role": "assistant", "content": "Where to?"},
                {"role": "user", "content": "Paris, Friday."},
            ],
        }
        _status, body, h2 = await bed.post("/v1/chat/completions", turn2)
        return h1["X-SMetric-Worker"], h2["X-SMetric-Worker"], h2["X-SMetric-Reason"], body

    w1, w2, reason, body = run(test, policy="cache_aware")
    assert (w1, reason) == (w2, "cache_hit")
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_load_is_accounted_while_a_request_streams():
    async def test(bed: Bed):
        body = {**GEN, "stream": True, "sampling_params": {"max_new_tokens": 400}}
        async with bed.session.post(bed.base + "/generate", json=body) as r:
            await r.content.readline()
            during = {u: (w.in_flight, w.running_decode_tokens) for u, w in bed.workers.items()}
            async for _ in r.content:
                pass
        after = {u: w.in_flight for u, w in bed.workers.items()}
        return during, after

    during, after = run(test)
    busy = [v for v in during.values() if v[0]]
    assert len(busy) == 1 and busy[0][1] > 0  # past its first token: counted as decoding
    assert set(after.values()) == {0}


# ---- forwarding ---------------------------------------------------------------------------


class CaptureWorker:
    """A fake SGLang worker that records what it receives; it answers with ``status`` after
    ``delay_s``."""

    def __init__(self, status: int = 200, delay_s: float = 0.0) -> None:
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.paths: list[str] = []
        self.status, self.delay_s = status, delay_s

    def app(self) -> web.Application:
        app = web.Application()

        async def generate(request: web.Request) -> web.Response:
            self.bodies.append(await request.read())
            self.headers.append(dict(request.headers))
            self.paths.append(request.path)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.status != 200:
                return web.json_response({"error": {"message": "told to fail"}}, status=self.status)
            return web.json_response({"text": "ok", "meta_info": {"id": "x"}})

        async def ok(request: web.Request) -> web.Response:
            return web.json_response({"max_total_num_tokens": 100_000, "model_path": "m"})

        for path in (
            "/generate",
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/embeddings",
            "/v1/rerank",
            "/v1/classify",
            "/v1/responses",
        ):
            app.router.add_post(path, generate)
        for path in ("/health", "/server_info", "/model_info", "/v1/loads"):
            app.router.add_get(path, ok)
        return app


def with_capture(test: Callable[[Bed, CaptureWorker], Awaitable[Any]], **config: Any) -> Any:
    async def main() -> Any:
        capture = CaptureWorker()
        runner = web.AppRunner(capture.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[-1][1]}"
        router, rrunner, base = await start_router(RouterConfig(worker_urls=[url], **config))
        try:
            async with aiohttp.ClientSession() as session:
                return await test(Bed(None, router, base, session), capture)  # type: ignore[arg-type]
        finally:
            await rrunner.close()
            await runner.cleanup()

    return asyncio.run(main())


def test_embeddings_rerank_and_classify_are_forwarded_as_sglang_router_does():
    # sglang-router 0.3.2 forwards these too (its /rerank to the worker's /v1/rerank).
    raw = b'{"model":"m",  "input":["a b", "c"],"extra":{"kept":true}}'

    async def test(bed: Bed, capture: CaptureWorker):
        sent = [("/v1/embeddings", "/v1/embeddings"), ("/v1/rerank", "/v1/rerank")]
        sent += [("/rerank", "/v1/rerank"), ("/v1/classify", "/v1/classify")]
        for path, _ in sent:
            async with bed.session.post(
                bed.base + path,
                data=raw,
                headers={"X-Request-ID": f"r{path}", "Content-Type": "application/json"},
            ) as r:
                assert r.status == 200 and (await r.json())["text"] == "ok"
                assert r.headers["X-Request-ID"] == f"r{path}"
                assert r.headers["X-SMetric-Reason"]
        assert capture.paths == [worker_path for _, worker_path in sent]
        assert capture.bodies == [raw] * len(sent)
        assert [h["X-Request-ID"] for h in capture.headers] == [f"r{p}" for p, _ in sent]
        for bad in (b'{"input": ', b"[1, 2]", b"\xff"):
            status, body, _ = await bed.post("/v1/embeddings", data=bad)
            assert status == 400 and body["error"]["code"] == 400
        assert len(capture.paths) == len(sent)  # nothing of them reached the worker
        assert all(w.in_flight == 0 for w in bed.workers.values())
        _, metrics = await bed.get("/metrics")
        assert 'smetric_requests_total{route="embeddings",status="200"} 1' in metrics
        assert 'smetric_requests_total{route="rerank",status="200"} 2' in metrics
        assert 'smetric_requests_total{route="embeddings",status="400"} 3' in metrics

    with_capture(test)


def test_bodies_forwarded_whole_past_the_payload_limit_get_a_413_json_and_reach_no_worker():
    async def test(bed: Bed, capture: CaptureWorker):
        big = json.dumps({"model": "m", "input": "x" * 5000}).encode()
        for path in ("/v1/embeddings", "/v1/responses"):
            async with bed.session.post(bed.base + path, data=big) as r:
                assert r.status == 413 and (await r.json())["error"]["code"] == 413
        assert capture.paths == []

    with_capture(test, max_payload_size=1024)


class ResponsesWorker:
    """A fake worker with the Responses API. Like SGLang, it keeps the responses it made: a
    request continuing one that another worker made gets a 404."""

    def __init__(self, name: str) -> None:
        self.name, self.made, self.count = name, set[str](), 0
        self.posts, self.auth = 0, list[str | None]()

    def app(self) -> web.Application:
        app = web.Application()

        async def create(request: web.Request) -> web.StreamResponse:
            self.posts += 1
            body = await request.json()
            previous = body.get("previous_response_id")
            if previous is not None and previous not in self.made:
                error = {"error": {"message": f"Previous response {previous} not found."}}
                return web.json_response(error, status=404)
            self.count += 1
            made = f"resp_{self.name}_{self.count}"
            self.made.add(made)
            answer = {"id": made, "object": "response", "status": "completed", "output": []}
            if not body.get("stream"):
                return web.json_response(answer)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            created = {"type": "response.created", "response": {**answer, "status": "queued"}}
            first = f"event: response.created\ndata: {json.dumps(created)}\n\n".encode()
            await resp.write(first[:40])  # the id comes in the second piece
            await asyncio.sleep(0.01)
            await resp.write(first[40:])
            if body.get("break"):
                assert request.transport is not None
                request.transport.close()
                return resp
            delta = {"type": "response.output_text.delta", "delta": "ok"}
            await resp.write(
                f"event: response.output_text.delta\ndata: {json.dumps(delta)}\n\n".encode()
            )
            done = {"type": "response.completed", "response": answer}
            await resp.write(f"event: response.completed\ndata: {json.dumps(done)}\n\n".encode())
            await resp.write_eof()
            return resp

        async def by_id(request: web.Request) -> web.Response:
            self.auth.append(request.headers.get("Authorization"))
            made = request.match_info["id"]
            if made not in self.made:
                return web.json_response({"error": {"message": "not found"}}, status=404)
            if request.method == "DELETE":
                self.made.discard(made)
                return web.json_response({"id": made, "deleted": True})
            if request.query.get("stream") == "true":  # a replay that breaks part-way
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b"event: response.created\ndata: {}\n\n")
                assert request.transport is not None
                request.transport.close()
                return resp
            return web.json_response({"id": made, "object": "response", "status": "completed"})

        async def ok(request: web.Request) -> web.Response:
            return web.json_response({"max_total_num_tokens": 100_000, "model_path": "m"})

        app.router.add_post("/v1/responses", create)
        app.router.add_get("/v1/responses/{id}", by_id)
        app.router.add_delete("/v1/responses/{id}", by_id)
        for path in ("/health", "/server_info", "/model_info", "/v1/loads"):
            app.router.add_get(path, ok)
        return app


def test_responses_continue_on_the_worker_holding_the_previous_one():
    async def ask(s: aiohttp.ClientSession, base: str, body: dict) -> tuple[int, str | None]:
        async with s.post(base + "/v1/responses", json=body) as r:
            if r.status != 200:
                return r.status, None
            if not body.get("stream"):
                return 200, (await r.json())["id"]
            events = [json.loads(line[5:]) async for line in r.content if line.startswith(b"data:")]
            kinds = ["response.created", "response.output_text.delta", "response.completed"]
            assert [e["type"] for e in events] == kinds
            return 200, events[-1]["response"]["id"]

    async def main() -> None:
        fakes = [ResponsesWorker("a"), ResponsesWorker("b")]
        runners, urls = zip(*[await serve_app(fake.app()) for fake in fakes], strict=True)
        # round_robin: without the affinity, every other turn would reach the wrong worker.
        router, rrunner, base = await start_router(
            RouterConfig(worker_urls=urls, policy="round_robin")
        )
        try:
            async with aiohttp.ClientSession() as s:
                chains = []
                for _ in range(2):
                    previous = None
                    made = []
                    for turn in range(5):
                        body = {"model": "m", "input": f"turn {turn}", "stream": turn % 2 == 1}
                        if previous is not None:
                            body["previous_response_id"] = previous
                        status, previous = await ask(s, base, body)
                        assert status == 200 and previous is not None
                        made.append(previous)
                    chains.append(made)
                for made in chains:  # each chain on one worker, the two on different ones
                    assert len({m.rsplit("_", 1)[0] for m in made}) == 1
                assert chains[0][0].rsplit("_", 1)[0] != chains[1][0].rsplit("_", 1)[0]
                last = chains[0][-1]
                async with s.get(
                    base + f"/v1/responses/{last}",
                    headers={"X-Request-ID": "r-7", "Authorization": "Bearer k"},
                ) as r:
                    assert r.status == 200 and (await r.json())["id"] == last
                    assert r.headers["X-Request-ID"] == "r-7" and "Authorization" not in r.headers
                assert "Bearer k" in fakes[0].auth + fakes[1].auth  # passed to the worker
                async with s.get(base + f"/v1/responses/{last}?stream=true") as r:
                    assert r.status == 200
                    with pytest.raises(aiohttp.ClientPayloadError):  # cut, not ended cleanly
                        await r.read()
                async with s.delete(base + f"/v1/responses/{last}") as r:
                    assert r.status == 200
                async with s.get(base + f"/v1/responses/{last}") as r:
                    assert r.status == 404  # gone from its worker, forgotten by the router
                assert last not in router._responses
                unknown = {"model": "m", "input": "x", "previous_response_id": "resp_nobody"}
                assert (await ask(s, base, unknown))[0] == 404  # the worker's own answer
                for bad in (b"{", b"[]"):
                    async with s.post(base + "/v1/responses", data=bad) as r:
                        assert r.status == 400 and (await r.json())["error"]["code"] == 400
                broken = {"model": "m", "input": "x", "stream": True, "break": True}
                async with s.post(base + "/v1/responses", json=broken) as r:
                    assert r.status == 200
                    with pytest.raises(aiohttp.ClientPayloadError):  # cut, not ended cleanly
                        await r.read()
                router.settle()
                assert all(
                    w.in_flight == w.queued_prefill_tokens == 0 for w in router.workers.values()
                )
                # The worker holding a chain goes away: its next turn fails clearly, and is
                # not sent to a worker that would not know it.
                owner = 0 if chains[1][-1].startswith("resp_a") else 1
                await runners[owner].cleanup()
                body = {"model": "m", "input": "more", "previous_response_id": chains[1][-1]}
                posts = fakes[1 - owner].posts
                async with s.post(base + "/v1/responses", json=body) as r:
                    assert r.status == 503
                    message = (await r.json())["error"]["message"]
                    assert f"holding the previous response ({urls[owner]})" in message
                assert fakes[1 - owner].posts == posts  # not tried on the other worker
        finally:
            await rrunner.close()
            for runner in runners:
                await runner.cleanup()

    asyncio.run(main())


def test_a_response_id_is_read_from_a_whole_answer_or_a_streams_first_event_with_one():
    assert app_module.response_id(b'{"id": "resp_1", "output": []}', False) == "resp_1"
    for whole in (b"{", b'{"id": 5}', b"[]", b'{"object": "response"}'):
        assert app_module.response_id(whole, False) is None
    event = b'event: response.created\ndata: {"type": "response.created", "response": {"id": "r9"}}'
    assert app_module.response_id(event[:-3], True) is None  # the line is not whole yet
    assert app_module.response_id(b"event: x\ndata: {}\n\n" + event + b"\n\n", True) == "r9"
    assert app_module.response_id(b'data: {"id": "top"}\n\n', True) is None


def test_bodies_are_forwarded_byte_for_byte_and_request_ids_echoed():
    # Odd spacing, an escape, an unknown field and max_tokens: all must reach the worker as sent.
    raw = (
        b'{"model":"m",  "messages":[{"role":"user","content":"hi \\u00e9"}],'
        b'"max_tokens":7,"my_field":{"kept":[1,2]},"stream":false}'
    )

    async def test(bed: Bed, capture: CaptureWorker):
        async with bed.session.post(
            bed.base + "/v1/chat/completions",
            data=raw,
            headers={"X-Request-ID": "req-42", "Content-Type": "application/json"},
        ) as r:
            echoed = r.headers.get("X-Request-ID")
        async with bed.session.post(bed.base + "/generate", json={"text": "a"}) as r:
            generated = r.headers.get("X-Request-ID")
        return echoed, generated, capture.bodies, capture.headers

    echoed, generated, bodies, headers = with_capture(test)
    assert bodies[0] == raw
    assert headers[0]["X-Request-ID"] == "req-42" and echoed == "req-42"
    assert generated and headers[1]["X-Request-ID"] == generated


def test_a_large_body_arriving_in_many_pieces_is_forwarded_whole_sized_or_chunked():
    """A body of several hundred KB reaches the router in many reads; with a length, and
    chunked (no length given), the worker gets it byte for byte and it is keyed as sent."""
    text = "".join(f"line {i} of a long tool output\\n" for i in range(20_000))
    raw = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 2}}).encode()
    assert len(raw) > 600_000

    async def pieces() -> Any:
        for i in range(0, len(raw), 40_000):
            yield raw[i : i + 40_000]
            await asyncio.sleep(0)

    async def test(bed: Bed, capture: CaptureWorker):
        statuses = []
        for data in (raw, pieces()):
            async with bed.session.post(
                bed.base + "/generate", data=data, headers={"Content-Type": "application/json"}
            ) as r:
                statuses.append(r.status)
                await r.read()
        keys = view_request("generate", json.loads(raw)).key.keys
        (url,) = bed.router.index.instances()
        capacity = bed.router.index.stats()["instances"][url]["capacity_blocks"]
        for _ in range(200):  # a large prompt is recorded in steps, after its answer
            bed.router.settle()
            if bed.router.index.match(keys, touch=False).blocks == [min(len(keys), capacity)]:
                break
            await asyncio.sleep(0.01)
        held = bed.router.index.match(keys, touch=False).blocks
        return statuses, capture.bodies, capture.headers, held, [min(len(keys), capacity)]

    statuses, bodies, headers, held, expected = with_capture(test)
    assert statuses == [200, 200]
    assert bodies == [raw, raw]
    assert "Content-Length" in headers[0] and headers[1].get("Transfer-Encoding") != "chunked"
    assert held == expected  # keyed as view_request keys the body


def test_decision_headers_can_be_turned_off():
    async def test(bed: Bed, capture: CaptureWorker):
        async with bed.session.post(bed.base + "/generate", json={"text": "a"}) as r:
            return "X-SMetric-Worker" in r.headers

    assert with_capture(test, decision_header=False) is False


# ---- worker management --------------------------------------------------------------------


def test_workers_can_be_removed_and_added_at_run_time_without_losing_requests():
    async def test(bed: Bed):
        url = bed.cluster.urls[1]
        long = {**GEN, "sampling_params": {"max_new_tokens": 300}}
        # Send to the second worker (round robin: first goes to w0), remove it mid-stream.
        await bed.post("/generate", GEN)
        task = asyncio.create_task(bed.stream("/generate", long))
        await asyncio.sleep(0.05)
        _status, body = await bed.get("/list_workers")
        assert url in body["urls"]
        async with bed.session.post(bed.base + f"/remove_worker?url={url}") as r:
            assert r.status == 200
        s, lines, headers = await task
        statuses = [(await bed.post("/generate", GEN))[2]["X-SMetric-Worker"] for _ in range(3)]
        async with bed.session.post(bed.base + "/workers", json={"url": url}) as r:
            added = (r.status, await r.json())
        _, listed = await bed.get("/workers")
        async with bed.session.delete(bed.base + f"/workers/{added[1]['id']}") as r:
            deleted = r.status
        return url, s, lines, headers["X-SMetric-Worker"], statuses, added, listed, deleted

    removed, s, lines, streamed_on, after, added, listed, deleted = run(test, policy="round_robin")
    # The stream on the removed worker finished whole; new requests went to the other worker.
    assert streamed_on == removed
    assert s == 200 and lines[-1] == b"data: [DONE]" and len(lines) == 301
    assert removed not in after and len(set(after)) == 1
    assert added[0] == 200 and added[1]["is_healthy"] is True
    assert listed["total"] == 2 and deleted == 200


def test_admin_calls_need_the_api_key_when_one_is_set():
    async def test(bed: Bed):
        url = bed.cluster.urls[0]
        out = []
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            async with bed.session.post(
                bed.base + f"/remove_worker?url={url}", headers=headers
            ) as r:
                out.append((r.status, (await r.json())["error"]["type"]))
        async with bed.session.post(bed.base + "/flush_cache") as r:
            out.append((r.status, None))
        _, workers = await bed.get("/list_workers")
        async with bed.session.post(
            bed.base + f"/remove_worker?url={url}", headers={"Authorization": "Bearer s3cret"}
        ) as r:
            out.append((r.status, None))
        return out, workers

    out, workers = run(test, api_key="s3cret")
    assert out[:3] == [(401, "AuthenticationError"), (401, "AuthenticationError"), (401, None)]
    assert len(workers["urls"]) == 2 and out[3][0] == 200


# ---- bad input ----------------------------------------------------------------------------


def test_bad_input_gets_clear_4xx_json_and_changes_nothing():
    async def test(bed: Bed):
        before = (len(bed.workers), bed.router.index.stats()["unique_blocks"])
        out = []
        for path, data in (
            ("/generate", b"not json"),
            ("/generate", b"[1,2]"),
            ("/generate", json.dumps({"text": 5}).encode()),
            ("/generate", json.dumps({}).encode()),
            ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode()),
            (
                "/v1/chat/completions",
                json.dumps({"messages": [{"role": "user"}], "max_tokens": "9"}).encode(),
            ),
            ("/v1/completions", json.dumps({"prompt": {"a": 1}}).encode()),
            ("/generate", b'{"text": "' + b"a" * 5000 + b'"}'),
        ):
            async with bed.session.post(bed.base + path, data=data) as r:
                out.append((r.status, await r.json()))
        async with bed.session.get(bed.base + "/nope") as r:
            out.append((r.status, await r.json()))
        async with bed.session.get(bed.base + "/generate") as r:
            out.append((r.status, await r.json()))
        for path, payload in (
            ("/workers", {"url": "ftp://x"}),
            ("/workers", {"url": "http://127.0.0.1:1"}),
            ("/workers", [1]),
        ):
            async with bed.session.post(bed.base + path, json=payload) as r:
                out.append((r.status, await r.json()))
        async with bed.session.delete(bed.base + "/workers/w-unknown") as r:
            out.append((r.status, await r.json()))
        async with bed.session.post(bed.base + "/remove_worker?url=http://nowhere:1") as r:
            out.append((r.status, await r.json()))
        after = (len(bed.workers), bed.router.index.stats()["unique_blocks"])
        return out, before, after

    out, before, after = run(test, max_payload_size=4096)
    statuses = [s for s, _ in out]
    assert statuses == [400] * 7 + [413, 404, 405, 400, 400, 400, 404, 404]
    for _, body in out:
        assert isinstance(body["error"]["message"], str) and body["error"]["code"] >= 400
    assert before == after


def test_a_body_the_fast_path_leaves_to_the_reference_is_served_and_keyed_as_it_keys_it():
    # A float in the tools: the Rust keying leaves the body to view_request, which the router
    # then runs on the parsed body.
    body = {
        "messages": [{"role": "user", "content": "x" * 300}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"t": 0.5}}}],
        "max_tokens": 4,
    }

    async def test(bed: Bed):
        status, _, headers = await bed.post("/v1/chat/completions", body)
        bed.router.settle()
        match = bed.router.index.match(view_request("chat", body).key.keys, touch=False)
        return status, headers["X-SMetric-Worker"], match, bed.router.index.instances()

    status, worker, match, instances = run(test)
    keys = view_request("chat", body).key.keys
    assert status == 200 and len(keys) > 4
    assert match.blocks[instances.index(worker)] == len(keys)  # learned under the same keys


def test_the_rust_data_plane_keys_bodies_itself_and_hands_over_the_rest(monkeypatch):
    """The Rust data plane keys a body outside the GIL and gives the router the keys, not the
    bytes; a body its fast path leaves to the reference comes as bytes, and the router takes it
    straight to the reference (the fast path is not tried twice). Either way the router sees
    what ``view_request`` sees."""
    if DATA_PLANE != "rust":
        pytest.skip("the aiohttp plane has the router key every body")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"t": 0.5}}}]
    cases = [
        ("/v1/chat/completions", "chat", CHAT, True),
        ("/generate", "generate", GEN, True),
        ("/v1/completions", "completions", COMP, True),
        ("/generate", "generate", {"input_ids": list(range(100)), "max_new_tokens": 3}, True),
        ("/v1/chat/completions", "chat", dict(CHAT, tools=tools), False),  # a float in tools
    ]

    async def test(bed: Bed):
        calls: list[tuple[Any, Any]] = []
        views: list[Any] = []
        begin, view = bed.router.dp_begin, bed.router._view

        def spy_begin(path: str, keyed: Any, raw: Any, *rest: Any) -> Any:
            calls.append((keyed, raw))
            return begin(path, keyed, raw, *rest)

        def spy_view(*args: Any) -> Any:
            views.append(view(*args))
            return views[-1]

        bed.router.dp_begin, bed.router._view = spy_begin, spy_view  # type: ignore[method-assign]
        statuses = [(await bed.post(path, body))[0] for path, _, body, _ in cases]
        return statuses, calls, views

    fast_in_python: list[str] = []
    view_body = app_module.view_body

    def counted(api: str, *rest: Any) -> Any:
        fast_in_python.append(api)
        return view_body(api, *rest)

    monkeypatch.setattr(app_module, "view_body", counted)
    statuses, calls, views = run(test)
    assert statuses == [200] * len(cases)
    assert fast_in_python == []
    for (_, api, body, fast), (keyed, raw), view in zip(cases, calls, views, strict=True):
        if fast:
            assert keyed is not None and raw is None
        else:
            assert keyed is None and json.loads(raw) == body
        assert view == view_request(api, body)


def test_cli_accepts_sglang_router_command_lines_and_rejects_bad_flags(capsys):
    c = parse_config(
        [
            "--worker-urls",
            "http://a:1",
            "http://b:2",
            "--policy",
            "cache_aware",
            "--cache-threshold",
            "0.5",
            "--balance-abs-threshold",
            "32",
            "--port",
            "31000",
            "--request-timeout-secs",
            "60",
            "--disable-retries",
            "--log-level",
            "warn",
            "--max-tree-size",
            "1000",
            "--service-discovery",
            "--dp-aware",
        ]
    )
    assert c.worker_urls == ["http://a:1", "http://b:2"] and c.cache_threshold == 0.5
    assert c.max_attempts == 1 and c.host == "127.0.0.1"
    pd = parse_config(
        [
            "--pd-disaggregation",
            "--prefill",
            "http://p:1",
            "9000",
            "--prefill",
            "http://p:2",
            "none",
            "--decode",
            "http://d:1",
            "--policy",
            "manual",
        ]
    )
    assert pd.prefill == [("http://p:1", 9000), ("http://p:2", None)] and pd.policy == "sticky"
    for bad in (
        ["--bogus"],
        ["--port", "x"],
        ["--port", "70000"],
        ["--policy", "fastest"],
        ["--worker-urls", "a:1"],
        ["--cache-threshold", "-1"],
        ["--pd-disaggregation"],
        ["--prefill", "http://p:1", "x"],
        ["--decode", "http://d:1"],
    ):
        with pytest.raises(SystemExit) as e:
            parse_config(bad)
        assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_cli_accepts_every_flag_of_sglang_router_0_3_2_with_each_of_its_choices():
    # Its flags as its own parser lists them (tests/fixtures/NOTICE.md): whichever a user's
    # command line has, it parses here, those that do not apply with a warning.
    rows = [
        line.rstrip("\n").split("\t")
        for line in (FIXTURES / "sglang_router_0.3.2_flags.tsv").read_text().splitlines()
        if not line.startswith("#")
    ]
    assert len(rows) == 98
    pd = {"--prefill", "--decode", "--pd-disaggregation", "--prefill-policy", "--decode-policy"}
    tried = 0
    for flag, values, kind, choices in rows:
        if choices:
            cases = [[c] for c in choices.split(",")]
        elif values == "flag":
            cases = [[]]
        elif flag in ("--prefill", "--decode", "--worker-urls"):
            cases = [["http://w:1"]] + ([["http://w:1", "9000"]] if flag == "--prefill" else [])
        else:
            cases = [{"int": ["2"], "float": ["0.5"]}.get(kind, ["app=x"])]
        for case in cases:
            base = ["--worker-urls", "http://a:1"]
            if flag in pd:
                base = ["--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1"]
            parse_config([*base, flag, *case])
            tried += 1
    assert tried > len(rows)  # every choice of the flags that have some


# ---- faults -------------------------------------------------------------------------------


async def fault(bed: Bed, i: int, **f: Any) -> None:
    async with bed.session.post(bed.cluster.urls[i] + "/_emulator/fault", json=f) as r:
        assert r.status == 200


def test_a_worker_that_returns_5xx_is_retried_elsewhere():
    async def test(bed: Bed):
        await fault(bed, 0, mode="fail")
        results = [await bed.post("/generate", GEN) for _ in range(4)]
        return [(s, h["X-SMetric-Worker"]) for s, _, h in results], bed.router.retries

    results, retries = run(test, policy="round_robin", retry_initial_backoff_ms=1)
    assert all(s == 200 for s, _ in results)
    assert retries >= 1


def test_a_worker_that_refuses_connections_is_retried_elsewhere_and_circuit_opens():
    async def test(bed: Bed):
        dead = "http://127.0.0.1:9"  # discard port: nothing listens
        await bed.router.register(dead, strict=False)
        bed.workers[dead].healthy = True  # as if it just died
        results = [await bed.post("/generate", GEN) for _ in range(6)]
        return [s for s, _, _ in results], bed.workers[dead]

    statuses, dead = run(
        test, policy="round_robin", retry_initial_backoff_ms=1, cb_failure_threshold=2
    )
    assert statuses == [200] * 6
    assert dead.errors_total == 2 and dead.opened_at is not None  # then left alone


def test_a_hanging_worker_times_out_and_the_request_goes_elsewhere():
    async def test(bed: Bed):
        await fault(bed, 0, mode="hang")
        results = [await bed.post("/generate", GEN) for _ in range(2)]
        return [(s, h.get("X-SMetric-Worker")) for s, _, h in results]

    results = run(test, policy="round_robin", request_timeout_secs=0.3, retry_initial_backoff_ms=1)
    assert [s for s, _ in results] == [200, 200]


def test_a_stream_dropped_mid_way_ends_with_a_clean_error_event():
    async def test(bed: Bed):
        await fault(bed, 0, mode="drop", after_tokens=3)
        await fault(bed, 1, mode="drop", after_tokens=3)
        return await bed.stream("/generate", {**GEN, "sampling_params": {"max_new_tokens": 20}})

    status, lines, _ = run(test)
    assert status == 200
    assert len(lines) == 5  # 3 tokens, the error, [DONE]
    assert json.loads(lines[3][6:])["error"]["code"] == 502
    assert lines[-1] == b"data: [DONE]"


def test_a_client_that_disconnects_mid_stream_cancels_the_upstream_request():
    async def test(bed: Bed):
        body = {**GEN, "stream": True, "sampling_params": {"max_new_tokens": 5000}}
        async with bed.session.post(bed.base + "/generate", json=body) as r:
            await r.content.readline()
            r.close()
        await asyncio.sleep(0.2)
        return (
            [w.engine.has_work() for w in bed.cluster.workers],
            [w.in_flight for w in bed.workers.values()],
        )

    busy, in_flight = run(test)
    assert busy == [False, False] and in_flight == [0, 0]


def test_a_client_that_leaves_before_the_answer_begins_frees_the_worker():
    async def test(bed: Bed):
        body = {**GEN, "sampling_params": {"max_new_tokens": 3000}}  # not streamed: seconds
        with pytest.raises(asyncio.TimeoutError):
            await bed.post("/generate", body, timeout=aiohttp.ClientTimeout(total=0.3))
        during = sum(w.in_flight for w in bed.workers.values())
        await asyncio.sleep(0.3)
        return (
            during,
            [w.engine.has_work() for w in bed.cluster.workers],
            [
                (w.in_flight, w.queued_prefill_tokens, w.running_decode_tokens)
                for w in bed.workers.values()
            ],
            bed.router.retries,
            [w.errors_total for w in bed.workers.values()],
        )

    during, busy, accounts, retries, errors = run(test)
    assert busy == [False, False] and accounts == [(0, 0, 0), (0, 0, 0)]
    assert retries == 0 and errors == [0, 0]  # the client left: no worker's fault
    assert during <= 1


def test_health_checks_take_a_failing_worker_out_and_bring_it_back():
    async def test(bed: Bed):
        await fault(bed, 0, mode="fail")
        await asyncio.sleep(0.5)
        out = [bed.workers[bed.cluster.urls[0]].healthy]
        status, _body = await bed.get("/readiness")
        out.append(status)
        routed = {(await bed.post("/generate", GEN))[2]["X-SMetric-Worker"] for _ in range(4)}
        await fault(bed, 0, mode="none")
        await asyncio.sleep(0.5)
        out.append(bed.workers[bed.cluster.urls[0]].healthy)
        return out, routed

    (down, ready, back), routed = run(
        test,
        policy="round_robin",
        health_check_interval_secs=0.05,
        health_failure_threshold=2,
        health_success_threshold=2,
    )
    assert (down, ready, back) == (False, 200, True)
    assert len(routed) == 1


def test_no_healthy_worker_gives_503_json():
    async def test(bed: Bed):
        for w in bed.workers.values():
            w.healthy = False
        status, body, _ = await bed.post("/generate", GEN)
        ready, _ = await bed.get("/readiness")
        return status, body, ready

    status, body, ready = run(test)
    assert status == 503 and "no worker" in body["error"]["message"] and ready == 503


# ---- PD -----------------------------------------------------------------------------------


def test_pd_mode_sends_to_a_prefill_and_a_decode_worker_with_bootstrap_fields():
    async def test(bed: Bed):
        status, body, headers = await bed.post("/generate", GEN)
        s2, lines, _ = await bed.stream("/v1/chat/completions", CHAT)
        return status, body, headers, s2, lines, await pd_settled(bed), bed.cluster.urls

    status, body, headers, s2, lines, loads, urls = run(test, workers=0, pd=(1, 1))
    assert status == 200 and body["meta_info"]["completion_tokens"] == 6
    assert headers["X-SMetric-Worker"] == urls[1]  # the decode worker answers
    assert s2 == 200 and lines[-1] == b"data: [DONE]"
    assert loads == [("decode", 0, 0, 0), ("prefill", 0, 0, 0)]


# ---- SMetric end to end -------------------------------------------------------------------


def test_smetric_on_real_agent_sessions_spreads_first_turns_sticks_and_migrates():
    from smetric.workload.agents import load_sessions

    sessions = load_sessions(limit=8)

    async def turn(bed: Bed, s, k: int) -> tuple[str, str]:
        body = {"messages": s.turns[k].messages, "tools": s.tools, "max_tokens": 4}
        status, _, headers = await bed.post("/v1/chat/completions", body)
        assert status == 200
        return headers["X-SMetric-Worker"], headers["X-SMetric-Reason"]

    async def test(bed: Bed):
        first = [await turn(bed, s, 0) for s in sessions]
        second = [await turn(bed, s, 1) for s in sessions]
        # Overload the first session's instance (as if a flood of prefill were queued there):
        # its next turn would miss the TTFT SLO, so it migrates.
        home = second[0][0]
        bed.workers[home].queued_prefill_tokens += 2_000_000
        moved = await turn(bed, sessions[0], 2)
        bed.workers[home].queued_prefill_tokens -= 2_000_000
        return first, second, home, moved

    first, second, home, moved = run(test, workers=4)
    assert {r for _, r in first} == {"first_turn_balance"}
    assert sorted(Counter(w for w, _ in first).values()) == [2, 2, 2, 2]  # spread evenly
    assert [r for _, r in second] == ["stick"] * 8
    assert [w for w, _ in second] == [w for w, _ in first]  # each session stayed home
    assert moved[1] == "migrate_slo" and moved[0] != home


def test_streamed_responses_correct_smetrics_tpot_model_from_what_workers_show():
    # The emulated workers run the same performance model the SLO model predicts from, so the
    # TPOT the router measures from streams should teach it a factor close to 1 (the streams'
    # last events, finish reason and usage, make the measured mean a little short).
    long_chat = {**CHAT, "max_tokens": 40}

    async def test(bed: Bed):
        for i in range(6):
            body = {
                **long_chat,
                "messages": [*CHAT["messages"][:1], {"role": "user", "content": f"q{i}"}],
            }
            status, lines, _ = await bed.stream("/v1/chat/completions", body)
            assert status == 200 and lines[-1] == b"data: [DONE]"
        slo = bed.router.policy.slo
        return [slo.tpot_correction(u) for u in bed.workers]

    factors = run(test, workers=2, time_scale=4.0)
    assert any(f != 1.0 for f in factors)  # observed at all
    assert all(0.8 <= f <= 1.1 for f in factors), factors


def test_queued_prefill_in_the_view_counts_what_the_worker_got_through_since_it_began():

    w = Worker("http://w", queued_prefill_tokens=10_000, prefill_since=100.0)
    assert w.view(0).queued_prefill_tokens == 10_000  # no rate: the raw count
    assert w.view(0, 100.1, 30_000.0).queued_prefill_tokens == 7_000
    assert w.view(0, 101.0, 30_000.0).queued_prefill_tokens == 0  # late, not negative
    w.time_scale = 2.0  # an emulated worker running twice as fast gets through twice as much
    assert w.view(0, 100.1, 30_000.0).queued_prefill_tokens == 4_000


def test_a_first_token_leaves_the_next_prefill_the_head_start_its_iteration_gave_it(monkeypatch):
    from smetric.router import workers

    def at(t: float) -> None:
        monkeypatch.setattr(workers.time, "monotonic", lambda: t)

    # 2,000 tokens, then 6,000: the first one's iteration (a chunk of 8,192 at 30,000 tokens/s)
    # took 6,000 of the next one's too, so 0 are left, not 6,000.
    w = workers.Worker("http://w", queued_prefill_tokens=8_000, prefill_since=100.0)
    at(100.0 + 8_000 / 30_000)
    w.prefilled(2_000, 2_000, 30_000.0, 8_192)
    assert (w.queued_prefill_tokens, w.view(0, 100.0 + 8_000 / 30_000, 30_000.0)[2]) == (6_000, 0)
    # Its own prefill took longer than the rate says (a long cached context): no head start.
    w = workers.Worker("http://w", queued_prefill_tokens=8_000, prefill_since=100.0)
    at(101.0)
    w.prefilled(2_000, 2_000, 30_000.0, 8_192)
    assert w.view(0, 101.0, 30_000.0).queued_prefill_tokens == 6_000
    # Nothing queued behind it: nothing to start on.
    w = workers.Worker("http://w", queued_prefill_tokens=2_000, prefill_since=100.0)
    at(100.2)
    w.prefilled(2_000, 2_000, 30_000.0, 8_192)
    assert (w.queued_prefill_tokens, w.prefill_since, w.running_decode_tokens) == (0, 100.2, 2_000)


def test_smetric_flags_parse_and_validate():
    c = parse_config(
        [
            "--worker-urls",
            "http://a:1",
            "--ttft-slo-ms",
            "300",
            "--tpot-slo-ms",
            "80",
            "--no-global-tier",
            "--no-migration",
            "--load-metric",
            "requests",
            "--profile",
            "llama-3.1-8b-h100",
        ]
    )
    assert (c.policy, c.ttft_slo_ms, c.tpot_slo_ms, c.global_tier, c.migration, c.load_metric) == (
        "smetric",
        300.0,
        80.0,
        False,
        False,
        "requests",
    )
    for bad in (["--profile", "nope"], ["--ttft-slo-ms", "0"], ["--load-metric", "x"]):
        with pytest.raises(SystemExit):
            parse_config(bad)


# ---- regressions from review ----------------------------------------------------------------


def test_smetric_flags_reach_the_policy():
    c = parse_config(
        [
            "--profile",
            "qwen3-30b-a3b-h20",
            "--no-slo-gate",
            "--load-metric",
            "requests",
            "--ttft-slo-ms",
            "300",
            "--no-global-tier",
        ]
    )
    policy = Router(c).policy
    assert policy.config.profile == "qwen3-30b-a3b-h20"
    assert (policy.config.slo_gate, policy.config.load_metric) == (False, "requests")
    assert policy.slo.config.ttft_slo_ms == 300 and policy.slo.config.global_tier is False
    assert Router(c).index.has_global_tier is False


def test_bootstrap_rooms_differ_across_routers():
    a, b = Router(RouterConfig()), Router(RouterConfig())
    assert a._rooms.getrandbits(63) != b._rooms.getrandbits(63)


class FlakyLoads(CaptureWorker):
    """Reports a malformed load first, then a real one; answers 500 to generation if told."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.loads: bytes = b'{"loads": [{"num_running_reqs": null, "num_waiting_reqs": "x"}]}'
        self.fail = fail
        self.peers: list[object] = []
        """The client address of each generation request (one per connection it came on)."""

    def app(self) -> web.Application:
        app = web.Application()

        async def generate(request: web.Request) -> web.Response:
            await request.read()
            self.peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
            if self.fail:
                return web.json_response({"error": {"message": "boom"}}, status=500)
            return web.json_response({"text": "ok", "meta_info": {"id": "x"}})

        async def info(request: web.Request) -> web.Response:
            return web.json_response({"max_total_num_tokens": 100_000, "model_path": "m"})

        async def loads(request: web.Request) -> web.Response:
            return web.Response(body=self.loads, content_type="application/json")

        app.router.add_post("/generate", generate)
        for path in ("/health", "/server_info", "/model_info"):
            app.router.add_get(path, info)
        app.router.add_get("/v1/loads", loads)
        return app


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[-1][1]}"


def test_a_worker_closing_idle_connections_costs_no_request_and_no_retry():
    """SGLang's server (uvicorn) closes a connection idle for 5 s; this worker, after 50 ms.
    The router keeps its connections to a worker open between requests, and a request that
    finds its pooled connection closed goes on a fresh one, without a failure, a retry or a
    mark against the worker."""

    async def main():
        worker = FlakyLoads()
        worker.loads = b'{"loads": []}'
        runner = web.AppRunner(worker.app(), keepalive_timeout=0.05)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[-1][1]}"
        router, rrunner, base = await start_router(RouterConfig(worker_urls=[url]))
        try:
            statuses = []
            async with aiohttp.ClientSession() as session:
                for pause in (0.0, 0.1, 0.0, 0.1, 0.1):
                    await asyncio.sleep(pause)
                    async with session.post(base + "/generate", json={"text": "a"}) as r:
                        statuses.append((r.status, (await r.json())["text"]))
            router.settle()
            w = router.workers[url]
            return statuses, router.retries, w.errors_total, w.in_flight, worker.peers
        finally:
            await rrunner.close()
            await runner.cleanup()

    statuses, retries, errors, in_flight, peers = asyncio.run(main())
    assert statuses == [(200, "ok")] * 5
    assert (retries, errors, in_flight) == (0, 0, 0)
    # A new connection after each pause longer than the worker's keep-alive, the same one for
    # the request straight after (the aiohttp plane's session pools too).
    assert peers[1] == peers[2] and len(set(peers)) == 4


def test_a_worker_behind_a_path_prefix_gets_every_call_under_it():
    """A worker URL with a path (a gateway's route to it): registration, health and generation
    all go under that path, as sglang-router sends them."""

    async def main():
        worker = FlakyLoads()
        worker.loads = b'{"loads": []}'
        outer = web.Application()
        outer.add_subapp("/sglang", worker.app())
        runner, url = await serve_app(outer)
        _, rrunner, base = await start_router(RouterConfig(worker_urls=[url + "/sglang"]))
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(base + "/generate", json={"text": "a"}) as r,
            ):
                return r.status, (await r.json())["text"]
        finally:
            await rrunner.close()
            await runner.cleanup()

    assert asyncio.run(main()) == (200, "ok")


def test_a_malformed_load_report_does_not_stop_load_polling():
    async def main():
        worker = FlakyLoads()
        runner, url = await serve_app(worker.app())
        router, rrunner, _ = await start_router(
            RouterConfig(worker_urls=[url], load_poll_interval_secs=0.05)
        )
        try:
            await asyncio.sleep(0.2)
            before = router.workers[url].polled_running
            worker.loads = b'{"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 2}]}'
            await asyncio.sleep(0.2)
            w = router.workers[url]
            return before, (w.polled_running, w.polled_waiting)
        finally:
            await rrunner.close()
            await runner.cleanup()

    before, after = asyncio.run(main())
    assert before == 0 and after == (3, 2)


def test_retries_neither_double_count_hits_nor_credit_the_failing_worker():
    async def main():
        bad, good = FlakyLoads(fail=True), FlakyLoads()
        bad_runner, bad_url = await serve_app(bad.app())
        good_runner, good_url = await serve_app(good.app())
        router, rrunner, base = await start_router(
            RouterConfig(
                worker_urls=[bad_url, good_url], policy="round_robin", retry_initial_backoff_ms=1
            )
        )
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(4):
                    async with s.post(base + "/generate", json=GEN) as r:
                        assert r.status == 200
            router.settle()
            held = {u: v["blocks"] for u, v in router.index.stats()["instances"].items()}
            return router.retries, router.prefix_hit_tokens, router.prompt_tokens, held, bad_url
        finally:
            await rrunner.close()
            await bad_runner.cleanup()
            await good_runner.cleanup()

    retries, hits, prompt, held, bad_url = asyncio.run(main())
    assert retries >= 1 and hits <= prompt
    assert held[bad_url] == 0  # the failing worker is not predicted to hold anything


def test_without_handler_cancellation_a_client_leaving_is_no_worker_failure():
    async def main():
        cluster = EmulatedCluster(PROFILE, workers=2, time_scale=FAST)
        urls = await cluster.start()
        router = Router(RouterConfig(worker_urls=urls))
        runner = web.AppRunner(router.app())  # aiohttp's default: handlers not cancelled
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        base = f"http://127.0.0.1:{runner.addresses[-1][1]}"
        try:
            body = {**GEN, "stream": True, "sampling_params": {"max_new_tokens": 3000}}
            async with aiohttp.ClientSession() as s, s.post(base + "/generate", json=body) as r:
                await r.content.readline()
                r.close()
            await asyncio.sleep(1.0)
            return router.retries, [w.errors_total for w in router.workers.values()]
        finally:
            await runner.cleanup()
            await cluster.stop()

    retries, errors = asyncio.run(main())
    assert retries == 0 and errors == [0, 0]


def test_pd_prefill_failure_fails_fast_and_spares_the_decode_worker():
    async def main():
        prefill = FlakyLoads(fail=True)
        p_runner, p_url = await serve_app(prefill.app())
        cluster = EmulatedCluster(PROFILE, workers=0, pd=(0, 1), time_scale=FAST, pd_timeout_s=5.0)
        (d_url,) = await cluster.start()
        router, rrunner, base = await start_router(
            RouterConfig(
                pd_disaggregation=True,
                prefill=[(p_url, 8998)],
                decode=[d_url],
                cb_failure_threshold=1,
            )
        )
        try:
            async with aiohttp.ClientSession() as s:
                t0 = asyncio.get_running_loop().time()
                async with s.post(base + "/generate", json=GEN) as r:
                    status = r.status
                waited = asyncio.get_running_loop().time() - t0
            return status, waited, router.workers[d_url].errors_total
        finally:
            await rrunner.close()
            await cluster.stop()
            await p_runner.cleanup()

    status, waited, decode_errors = asyncio.run(main())
    assert status == 502 and waited < 2.0 and decode_errors == 0


def with_pd(
    test: Callable[[Bed, CaptureWorker, CaptureWorker], Awaitable[Any]],
    prefill: CaptureWorker,
    decode: CaptureWorker,
    **config: Any,
) -> Any:
    async def main() -> Any:
        p_runner, p_url = await serve_app(prefill.app())
        d_runner, d_url = await serve_app(decode.app())
        router, rrunner, base = await start_router(
            RouterConfig(pd_disaggregation=True, prefill=[(p_url, 8998)], decode=[d_url], **config)
        )
        try:
            async with aiohttp.ClientSession() as session:
                return await test(Bed(None, router, base, session), prefill, decode)  # type: ignore[arg-type]
        finally:
            await rrunner.close()
            await d_runner.cleanup()
            await p_runner.cleanup()

    return asyncio.run(main())


def pd_loads(bed: Bed) -> list[tuple[str, int, int, int]]:
    return sorted(
        (w.role, w.in_flight, w.queued_prefill_tokens, w.errors_total) for w in bed.workers.values()
    )


async def pd_settled(bed: Bed) -> list[tuple[str, int, int, int]]:
    """The workers' loads once nothing is in flight (the prefill's leg is booked once its answer
    is read, maybe after the client's), or as they are after 5 s."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        loads = pd_loads(bed)
        if all(n == q == 0 for _, n, q, _ in loads):
            break
        await asyncio.sleep(0.01)
    return pd_loads(bed)


def test_pd_sends_one_body_to_both_workers_bootstrap_fields_added_the_rest_byte_for_byte():
    # Spaced oddly, an unknown field, max_tokens, and a bootstrap field of the client's own:
    # nothing of the client's body changes but the three fields added last (SGLang's PD
    # protocol), which override the client's (parsers keep a key's last value).
    raw = (
        b'  {"text": "' + b"Hello PD. " * 40 + b'" , "sampling_params": {"max_new_tokens": 3},'
        b' "x_custom": [1, 2], "bootstrap_room": 5}\n'
    )
    keys = view_request("generate", json.loads(raw)).key.keys
    assert len(keys) >= 4

    async def test(bed: Bed, prefill: CaptureWorker, decode: CaptureWorker):
        answers = []
        for rid in ("pd-1", "pd-2"):
            async with bed.session.post(
                bed.base + "/generate", data=raw, headers={"X-Request-ID": rid}
            ) as r:
                answers.append((r.status, await r.json(), r.headers.copy()))
        loads = await pd_settled(bed)
        held = {
            w.role: bed.router.index.match(keys, touch=False).blocks[w.index_slot]
            for w in bed.workers.values()
        }
        decode_url = next(w.url for w in bed.workers.values() if w.role == "decode")
        return answers, loads, held, decode_url

    prefill, decode = CaptureWorker(), CaptureWorker()
    answers, loads, held, decode_url = with_pd(test, prefill, decode)
    assert [(s, b["text"], h["X-Request-ID"]) for s, b, h in answers] == [
        (200, "ok", "pd-1"),
        (200, "ok", "pd-2"),
    ]
    assert {h["X-SMetric-Worker"] for _, _, h in answers} == {decode_url}
    assert prefill.bodies == decode.bodies and len(decode.bodies) == 2
    rooms = []
    for body in decode.bodies:
        fields_at = b',"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998'
        head, sep, fields = body.partition(fields_at)
        assert head == raw.rstrip()[:-1] and sep  # the client's bytes, up to its closing brace
        room, end = fields.removeprefix(b', "bootstrap_room": ').split(b"}")
        assert end == b"\n"
        rooms.append(int(room))
        parsed = json.loads(body)
        assert parsed["x_custom"] == [1, 2] and parsed["bootstrap_room"] == rooms[-1] != 5
    assert rooms[0] != rooms[1] and all(0 <= r < 2**63 for r in rooms)
    assert [h["X-Request-ID"] for h in prefill.headers] == ["pd-1", "pd-2"]
    assert [h["X-Request-ID"] for h in decode.headers] == ["pd-1", "pd-2"]
    # The client's encodings to the decode; the prefill's answer uncompressed (a failed one
    # may go to the client as it came).
    assert {h["Accept-Encoding"] for h in decode.headers} == {"gzip, deflate"}
    assert {h["Accept-Encoding"] for h in prefill.headers} == {"identity"}
    assert loads == [("decode", 0, 0, 0), ("prefill", 0, 0, 0)]
    # Both hold the prompt now (the prefill's success taught the index too).
    assert held["prefill"] == held["decode"] == len(keys)


def test_inject_members_from_python_adds_them_last_or_says_none():
    # The binding the aiohttp plane uses (the cases: request::inject_members's own test).
    assert inject_members(b' {"x" : [1,2]} \n', b'"a": 1') == b' {"x" : [1,2],"a": 1} \n'
    assert inject_members(b"{}", b'"a": 1') == b'{"a": 1}'
    assert inject_members(b"[1]", b'"a": 1') is None


def test_pd_prefill_that_never_answers_is_given_up_at_the_timeout_and_released():
    # The decode answers (as if it had the KV another way): the client has its answer, and the
    # prefill's leg is ended at the read timeout, its worker's load released and the failure
    # held against it.
    async def test(bed: Bed, prefill: CaptureWorker, decode: CaptureWorker):
        status, _, _ = await bed.post("/generate", GEN)
        during = pd_loads(bed)
        await asyncio.sleep(1.6)
        return status, during, pd_loads(bed)

    status, during, after = with_pd(
        test, CaptureWorker(delay_s=3.0), CaptureWorker(), request_timeout_secs=1.0
    )
    assert status == 200
    assert ("prefill", 1, view_request("generate", GEN).prompt_tokens, 0) in during
    assert after == [("decode", 0, 0, 0), ("prefill", 0, 0, 1)]


def test_pd_prefill_4xx_before_the_decode_answers_reaches_the_client_as_it_came():
    # A request the prefill worker refuses (its own fault): the client sees that answer, not a
    # 502, and no failure is held against either worker.
    async def test(bed: Bed, prefill: CaptureWorker, decode: CaptureWorker):
        status, body, _ = await bed.post("/generate", GEN)
        return status, body, await pd_settled(bed)

    status, body, loads = with_pd(test, CaptureWorker(status=400), CaptureWorker(delay_s=2.0))
    assert (status, body) == (400, {"error": {"message": "told to fail"}})
    assert loads == [("decode", 0, 0, 0), ("prefill", 0, 0, 0)]


def test_pd_prefill_failing_mid_stream_leaves_the_stream_whole():
    # The decode has begun to stream (its first event at once; the prefill fails 0.2 s later):
    # its answer stands, whatever the prefill does after.
    async def test(bed: Bed, prefill: CaptureWorker, decode: PacedStream):
        stream = asyncio.create_task(bed.stream("/generate", {**GEN, "stream": True}))
        deadline = time.monotonic() + 5.0
        while pd_loads(bed)[1][3] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # until the prefill's failure is booked
        decode.go.set()
        status, lines, _ = await asyncio.wait_for(stream, 10.0)  # a cut stream would hang
        return status, lines, await pd_settled(bed)

    prefill, decode = CaptureWorker(status=500, delay_s=0.2), PacedStream(burst=3)
    status, lines, loads = with_pd(test, prefill, decode)  # type: ignore[arg-type]
    assert status == 200 and len(lines) == 5 and lines[-1] == b"data: [DONE]"
    assert loads == [("decode", 0, 0, 0), ("prefill", 0, 0, 1)]


def test_pd_prefill_whose_index_record_fails_is_still_booked(monkeypatch):
    # A prediction of the prefill worker's cache that raises (a key conflict in the index) is
    # logged; the request is answered and the worker's load released.
    async def test(bed: Bed, prefill: CaptureWorker, decode: CaptureWorker):
        record = bed.router._predict_cache

        def conflict(worker: Worker, view: Any) -> None:
            if worker.role == "prefill":
                raise ValueError("key conflict")
            record(worker, view)

        monkeypatch.setattr(bed.router, "_predict_cache", conflict)
        status, _, _ = await bed.post("/generate", GEN)
        return status, await pd_settled(bed)

    status, loads = with_pd(test, CaptureWorker(), CaptureWorker(delay_s=0.2))
    assert status == 200
    assert loads == [("decode", 0, 0, 0), ("prefill", 0, 0, 0)]


def test_pd_decode_failure_is_a_503_and_releases_both_workers():
    async def test(bed: Bed, prefill: CaptureWorker, decode: CaptureWorker):
        status, body, _ = await bed.post("/generate", GEN)
        return status, body, await pd_settled(bed)

    status, body, loads = with_pd(test, CaptureWorker(), CaptureWorker(status=500))
    assert status == 503 and "decode worker failed" in body["error"]["message"]
    assert loads == [("decode", 0, 0, 1), ("prefill", 0, 0, 0)]


def test_compressed_worker_replies_reach_the_client_decodable():
    async def main():
        app = web.Application()

        async def generate(request: web.Request) -> web.Response:
            await request.read()
            resp = web.json_response({"text": "x" * 2000, "meta_info": {"id": "z"}})
            resp.enable_compression()
            return resp

        async def info(request: web.Request) -> web.Response:
            return web.json_response({"max_total_num_tokens": 100_000})

        app.router.add_post("/generate", generate)
        app.router.add_get("/health", info)
        app.router.add_get("/server_info", info)
        runner, url = await serve_app(app)
        _router, rrunner, base = await start_router(RouterConfig(worker_urls=[url]))
        try:
            async with (
                aiohttp.ClientSession() as s,
                s.post(base + "/generate", json={"text": "a"}) as r,
            ):
                return (await r.json())["text"]
        finally:
            await rrunner.close()
            await runner.cleanup()

    assert asyncio.run(main()) == "x" * 2000


def test_a_content_part_with_null_or_numeric_text_is_a_400():
    async def test(bed: Bed):
        out = []
        for text in (None, 5):
            body = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
            status, data, _ = await bed.post("/v1/chat/completions", body)
            out.append((status, data))
        return out

    for status, data in run(test):
        assert status == 400 and data["error"]["code"] == 400


class PacedStream:
    """A worker that streams one event, waits until the test lets it go on (``go``), then sends
    a burst of ``burst`` events at once and ``[DONE]``."""

    def __init__(self, burst: int, event: bytes = b'data: {"text": "%d"}\n\n', wait_s: float = 5):
        self.burst, self.event, self.wait_s = burst, event, wait_s
        self.go = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()

        async def generate(request: web.Request) -> web.StreamResponse:
            await request.read()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"text": "first"}\n\n')
            await asyncio.wait_for(self.go.wait(), self.wait_s)
            for i in range(self.burst):
                await resp.write(self.event % i)
            await resp.write(b"data: [DONE]\n\n")
            return resp

        async def info(request: web.Request) -> web.Response:
            return web.json_response({"max_total_num_tokens": 100_000, "model_path": "m"})

        app.router.add_post("/generate", generate)
        for path in ("/health", "/server_info", "/model_info", "/v1/loads"):
            app.router.add_get(path, info)
        return app


def test_a_stream_passes_each_event_on_as_it_arrives_and_a_burst_whole():
    async def main():
        worker = PacedStream(burst=200)
        runner, url = await serve_app(worker.app())
        router, rrunner, base = await start_router(RouterConfig(worker_urls=[url]))
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(base + "/generate", json={"text": "a", "stream": True}) as r,
            ):
                # The worker holds back everything after its first event until the client has
                # that one: a router that waited to gather more would never deliver it.
                first = await asyncio.wait_for(r.content.readline(), 5)
                worker.go.set()
                rest = [line.strip() async for line in r.content if line.strip()]
            router.settle()
            return first.strip(), rest, router.workers[url].in_flight
        finally:
            await rrunner.close()
            await runner.cleanup()

    first, rest, in_flight = asyncio.run(main())
    assert first == b'data: {"text": "first"}'
    assert rest == [b'data: {"text": "%d"}' % i for i in range(200)] + [b"data: [DONE]"]
    assert in_flight == 0


class OneWriteStream:
    """A worker on a bare socket that sends each streamed answer, head, events and end, in one
    write (as a worker's answer reaches a busy router: already whole in its socket), or with
    ``broken``, the head and the events but ``[DONE]``, and then a closed connection with no
    end."""

    EVENTS = b"".join(b'data: {"text": "%d"}\n\n' % i for i in range(6)) + b"data: [DONE]\n\n"

    def __init__(self, broken: bool = False) -> None:
        self.broken = broken

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                line, *fields = head.decode().split("\r\n")
                headers = dict(f.lower().split(": ", 1) for f in fields if f)
                await reader.readexactly(int(headers.get("content-length", 0)))
                if line.startswith("POST /generate"):
                    events = self.EVENTS
                    if self.broken:
                        events = events.removesuffix(b"data: [DONE]\n\n")
                    chunked = b"%x\r\n%s\r\n" % (len(events), events)
                    end = b"" if self.broken else b"0\r\n\r\n"
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n" + chunked + end
                    )
                    if self.broken:
                        writer.close()
                        return
                else:
                    info = json.dumps({"max_total_num_tokens": 100_000, "model_path": "m"})
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(info), info.encode())
                    )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.mark.parametrize("broken", [False, True])
def test_a_stream_that_arrives_in_one_piece_is_passed_on_and_booked(broken):
    async def main():
        worker = OneWriteStream(broken)
        server = await asyncio.start_server(worker.handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        router, rrunner, base = await start_router(RouterConfig(worker_urls=[url]))
        try:
            async with aiohttp.ClientSession() as session:
                bodies = []
                for _ in range(3):
                    body = {"text": "a", "stream": True}
                    async with session.post(base + "/generate", json=body) as r:
                        bodies.append((r.status, await r.read()))
            router.settle()
            w = router.workers[url]
            return bodies, w.in_flight, w.errors_total, router.requests
        finally:
            await rrunner.close()
            server.close()

    bodies, in_flight, errors, requests = asyncio.run(main())
    if broken:  # the events that came, then the error event, and the stream ends cleanly
        events = OneWriteStream.EVENTS.removesuffix(b"data: [DONE]\n\n")
        for status, body in bodies:
            assert status == 200 and body.startswith(events)
            error = json.loads(body[len(events) :].split(b"\n\n")[0][6:])
            assert error["error"]["code"] == 502
            assert body.endswith(b"\n\ndata: [DONE]\n\n")
        assert errors == 3
    else:
        assert bodies == [(200, OneWriteStream.EVENTS)] * 3
        assert errors == 0
    assert in_flight == 0
    assert requests[("generate", 200)] == 3


async def paced(
    worker: PacedStream,
    test: Callable[[Router, str, aiohttp.ClientSession], Awaitable[Any]],
    **config: Any,
) -> Any:
    runner, url = await serve_app(worker.app())
    router, rrunner, base = await start_router(RouterConfig(worker_urls=[url], **config))
    try:
        async with aiohttp.ClientSession() as session:
            return await test(router, base, session)
    finally:
        await rrunner.close()
        await runner.cleanup()


def test_a_worker_that_goes_quiet_mid_stream_ends_it_with_an_error_event():
    worker = PacedStream(burst=1, wait_s=1.0)  # never told to go on: silent after one event

    async def test(router: Router, base: str, session: aiohttp.ClientSession):
        async with session.post(base + "/generate", json={"text": "a", "stream": True}) as r:
            lines = [line.strip() async for line in r.content if line.strip()]
        router.settle()
        w = next(iter(router.workers.values()))
        return lines, w.in_flight, w.errors_total

    lines, in_flight, errors = asyncio.run(paced(worker, test, request_timeout_secs=0.3))
    assert lines[0] == b'data: {"text": "first"}'
    assert json.loads(lines[1][6:])["error"]["code"] == 502
    assert lines[2:] == [b"data: [DONE]"]
    assert in_flight == 0 and errors == 1


def test_a_burst_larger_than_a_write_arrives_whole_and_in_order():
    event = b'data: {"text": "%d ' + b"x" * 1000 + b'"}\n\n'
    worker = PacedStream(burst=300, event=event)  # ~300 KB at once
    worker.go.set()

    async def test(router: Router, base: str, session: aiohttp.ClientSession):
        async with session.post(base + "/generate", json={"text": "a", "stream": True}) as r:
            return await r.read()

    body = asyncio.run(paced(worker, test))
    expected = b'data: {"text": "first"}\n\n' + b"".join(event % i for i in range(300))
    assert body == expected + b"data: [DONE]\n\n"


def test_stopping_the_router_with_a_stream_open_releases_its_accounting():
    worker = PacedStream(burst=1, wait_s=2.0)

    async def main():
        runner, url = await serve_app(worker.app())
        router, rrunner, base = await start_router(RouterConfig(worker_urls=[url]))
        try:
            async with aiohttp.ClientSession() as session:
                r = await session.post(base + "/generate", json={"text": "a", "stream": True})
                await r.content.readline()
                during = router.workers[url].in_flight
                await rrunner.close()  # the router stops while the stream is open
                r.close()
            return during, router.workers[url].in_flight
        finally:
            await runner.cleanup()

    during, after = asyncio.run(main())
    assert (during, after) == (1, 0)


@pytest.mark.parametrize("size", [1 << 10, 20 << 10])  # recorded with the booking; after it
@pytest.mark.parametrize("stream", [False, True])
def test_the_index_learns_a_served_prompt(size, stream):
    text = "".join(f"line {i} of a tool's output\n" for i in range(size // 26 + 1))[:size]

    async def test(bed: Bed, capture: CaptureWorker):
        body = {"text": text, "stream": stream}
        async with bed.session.post(bed.base + "/generate", json=body) as r:
            await r.read()
            url = r.headers["X-SMetric-Worker"]
        view = view_request("generate", body)
        for _ in range(100):  # a prompt from 16 KB is recorded just after the answer
            bed.router.settle()
            if bed.router.index.match_instance(url, view.key.keys, touch=False):
                break
            await asyncio.sleep(0.01)
        return bed.router.index.match_instance(url, view.key.keys, touch=False), len(view.key.keys)

    held, blocks = with_capture(test)
    assert held == blocks > 0


def test_an_idle_router_books_its_answers_on_its_own():
    """The Rust data plane queues the booking of each answer; with no request coming to settle
    it, the router settles it within milliseconds (read here without ``settle``)."""

    async def test(bed: Bed):
        status, _, _ = await bed.post("/generate", GEN)
        assert status == 200
        status, lines, _ = await bed.stream("/generate", GEN)
        assert status == 200 and lines[-1] == b"data: [DONE]"
        for waited in range(100):
            workers = bed.router.workers.values()
            if sum(bed.router.requests.values()) == 2 and all(w.in_flight == 0 for w in workers):
                return waited
            await asyncio.sleep(0.01)
        return None

    waited = run(test)
    assert waited is not None and waited <= 20  # 10 ms polls: settled within ~0.2 s


def test_settling_books_each_step_at_the_time_it_happened(caplog):
    """``Router.settle`` applies the data plane's queued steps in order, at their own times
    (TTFT, end-to-end latency, the worker's prefill clock), and one failing step does not cost
    the others their booking."""
    router = Router(RouterConfig())
    url = "http://127.0.0.1:9"
    router._admit(Worker(url))
    w = router.workers[url]
    view = router._view("generate", json.dumps(GEN).encode(), {})
    assert not isinstance(view, bytes)
    t0 = time.perf_counter() - 1.0  # the request came a second ago
    ex = Exchange(router, view, "/generate", "rid-1", t0, {})
    assert ex.next() is not None
    assert (w.in_flight, w.queued_prefill_tokens) == (1, view.prompt_tokens)

    class Broken:
        rid = "rid-broken"

        def whole(self, *args: Any) -> None:
            raise RuntimeError("a bug")

    queued: list[list[Any]] = [
        [
            (ex, "streaming", 200, True, None, t0 + 0.010),
            (Broken(), "whole", 200, False, None, t0 + 0.020),
            (ex, "end", "ok", 4, 0.003, t0 + 0.050),
        ]
    ]
    router._booked = lambda: queued.pop() if queued else None
    before = time.monotonic()
    router.settle()
    router.settle()  # nothing left: a no-op
    assert router.ttft.count == 1 and router.ttft.total == pytest.approx(0.010, abs=1e-6)
    assert router.e2e.count == 1 and router.e2e.total == pytest.approx(0.050, abs=1e-6)
    # The first token came 0.99 s before the settling, on the workers' monotonic clock too.
    assert before - 1.0 < w.prefill_since < before - 0.98
    assert (w.in_flight, w.queued_prefill_tokens, w.running_decode_tokens) == (0, 0, 0)
    assert router.requests[("generate", 200)] == 1
    assert router.index.match_instance(url, view.key.keys, touch=False)  # recorded
    assert "booking failed rid=rid-broken step=whole" in caplog.text


def test_answers_without_tokens_teach_the_policy_and_the_ttft_histogram_nothing():
    # A Responses stream's first event comes before any prefill is done: timed as a first token,
    # it would pull SMetric's TTFT correction for that worker down to its floor.
    router = Router(RouterConfig(policy="smetric"))
    url = "http://127.0.0.1:9"
    router._admit(Worker(url))
    w = router.workers[url]
    for api in ("responses", "generate"):
        view = view_unkeyed(api, 4000, stream=True)
        ex = Exchange(router, view, "/v1/responses", f"rid-{api}", time.perf_counter() - 0.3, {})
        assert ex.next() is not None
        ex.streaming(200)
        # A Responses stream's first event is no sign its prefill is done: it stays queued
        # until an output event says so (``handle_responses``); a generation stream's is.
        queued = (w.queued_prefill_tokens, w.running_decode_tokens)
        tokens = view.prompt_tokens
        assert queued == ((tokens, 0) if api == "responses" else (0, tokens))
        ex.end("ok", 20, 0.5)
        observed = (router.ttft.count, len(router.policy.slo._ttft), len(router.policy.slo._tpot))
        assert observed == ((0, 0, 0) if api == "responses" else (1, 1, 1))
        assert (w.in_flight, w.queued_prefill_tokens, w.running_decode_tokens) == (0, 0, 0)
    assert router.e2e.count == 2


def test_concurrent_requests_each_get_their_own_answer_and_accounting():
    """Many requests at once: each answer goes to its own client, and the accounting ends at
    zero. The Rust data plane decides the requests that wait together in one turn (here the
    first decision is held up, so the others queue behind it)."""

    async def one(bed: Bed, i: int) -> tuple[int, str, bool]:
        rid = f"client-{i}"
        body = {"text": f"request {i} " * (1 + i % 7), "sampling_params": {"max_new_tokens": 4}}
        if i % 2:
            status, lines, headers = await bed.stream(
                "/generate", body, headers={"X-Request-ID": rid}
            )
            ok = lines[-1] == b"data: [DONE]"
        else:
            status, data, headers = await bed.post("/generate", body, headers={"X-Request-ID": rid})
            ok = data["meta_info"]["completion_tokens"] == 4
        return status, headers["X-Request-ID"], ok

    async def test(bed: Bed):
        select, calls = bed.router.policy.select, []

        def first_slow(view: Any, cluster: Any) -> Any:
            calls.append(1)
            if len(calls) == 1:
                time.sleep(0.5)
            return select(view, cluster)

        bed.router.policy.select = first_slow  # type: ignore[method-assign]
        before = bed.router.plane.turns if bed.router.plane else (0, 0)
        results = await asyncio.gather(*(one(bed, i) for i in range(64)))
        after = bed.router.plane.turns if bed.router.plane else (0, 0)
        loads = [
            (w.in_flight, w.queued_prefill_tokens, w.running_decode_tokens)
            for w in bed.workers.values()
        ]
        turns = (after[0] - before[0], after[1] - before[1])
        return results, loads, sum(bed.router.requests.values()), turns

    results, loads, counted, (turns, decided) = run(test)
    assert results == [(200, f"client-{i}", True) for i in range(64)]
    assert loads == [(0, 0, 0), (0, 0, 0)] and counted == 64
    if DATA_PLANE == "rust":
        assert decided == 64 and turns < 32  # the 63 behind the first share turns


def test_a_client_that_leaves_while_its_request_is_decided_leaves_no_load_behind():
    """The Rust data plane decides requests in turns: a client may leave while its own decision
    is taken (its worker already charged), or while it waits for its turn. Either way the
    worker's accounting returns to zero."""
    if DATA_PLANE != "rust":
        pytest.skip("the aiohttp plane decides in the request's own handler")

    async def test(bed: Bed):
        select = bed.router.policy.select

        def slow_select(view: Any, cluster: Any) -> Any:
            time.sleep(0.3)  # holds the decisions' turn; the clients below give up meanwhile
            return select(view, cluster)

        bed.router.policy.select = slow_select  # type: ignore[method-assign]
        quick = aiohttp.ClientTimeout(total=0.1)
        gone = 0
        for attempt in (
            bed.session.post(bed.base + "/generate", json=GEN, timeout=quick),  # during its own
            bed.session.post(bed.base + "/generate", json=GEN, timeout=quick),  # waiting its turn
        ):
            try:
                async with attempt as r:
                    await r.read()
            except TimeoutError:
                gone += 1
        await asyncio.sleep(0.8)  # the turns end; what they decided is dropped
        bed.router.policy.select = select  # type: ignore[method-assign]
        return gone, [(w.in_flight, w.queued_prefill_tokens) for w in bed.workers.values()]

    gone, loads = run(test)
    assert gone == 2
    assert loads == [(0, 0), (0, 0)]


def test_metrics_report_requests_decisions_latencies_and_load():
    async def test(bed: Bed):
        for _ in range(2):
            status, _, _ = await bed.post("/generate", GEN)
            assert status == 200
        status, lines, _ = await bed.stream("/v1/chat/completions", CHAT)
        assert status == 200 and lines[-1] == b"data: [DONE]"
        status, _, _ = await bed.post("/generate", {"text": 5})
        assert status == 400
        status, text = await bed.get("/metrics")  # no settle here: the route does its own
        return status, text

    status, text = run(test, policy="round_robin")
    assert status == 200
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['smetric_requests_total{route="generate",status="200"}'] == 2
    assert values['smetric_requests_total{route="chat",status="200"}'] == 1
    assert values['smetric_requests_total{route="generate",status="400"}'] == 1
    decisions = [v for k, v in values.items() if k.startswith("smetric_routing_decisions_total")]
    assert sum(decisions) == 3 and all(
        'policy="round_robin"' in k for k in values if "routing_" in k
    )
    assert values["smetric_time_to_first_token_seconds_count"] == 3
    assert values["smetric_e2e_request_latency_seconds_count"] == 3
    assert values["smetric_prompt_tokens_total"] > 0
    in_flight = [v for k, v in values.items() if k.startswith("smetric_worker_in_flight")]
    assert in_flight == [0, 0]
    if DATA_PLANE == "rust":  # three routed and one refused, one at a time: a turn each
        assert values["smetric_decided_requests_total"] == 4
        assert values["smetric_decision_turns_total"] == 4


def test_engine_metrics_gathers_every_workers_metrics_labelled_with_the_worker():
    async def test(bed: Bed):
        for _ in range(3):
            status, _, _ = await bed.post("/generate", GEN)
            assert status == 200
        status, text = await bed.get("/engine_metrics")
        assert status == 200
        with bed.router.lock:  # a worker that cannot be reached is left out
            bed.router._admit(Worker("http://127.0.0.1:9"))
        status, without = await bed.get("/engine_metrics")
        assert status == 200
        return bed.cluster.urls, text, without

    urls, text, without = run(test, policy="round_robin")
    types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)) > 3  # each family declared once
    assert all(":" not in line.split()[2] for line in types)
    running = [line for line in text.splitlines() if line.startswith("sglang_num_running_reqs{")]
    assert sorted(line.split('worker_addr="')[1].split('"')[0] for line in running) == sorted(urls)
    served = {}
    for line in text.splitlines():
        if line.startswith("sglang_prompt_tokens_total{"):
            served[line.split('worker_addr="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    assert set(served) == set(urls) and all(v > 0 for v in served.values())  # 2 and 1 requests
    assert without.count("worker_addr=") == text.count("worker_addr=")
    assert "127.0.0.1:9" not in without


def test_merged_worker_metrics_keep_families_together_and_each_sample_once():
    a = (
        "# HELP sglang:ttft Time to first token.\n# TYPE sglang:ttft histogram\n"
        'sglang:ttft_bucket{le="0.1"} 1.0\nsglang:ttft_bucket{le="+Inf"} 3.0\n'
        "sglang:ttft_sum 0.9\nsglang:ttft_count 3.0\nsglang:ttft_other 4\nplain{} 5\n"
    )
    merged = merge_worker_metrics([("http://a:1", a), ('http://b"2', a.replace("3.0", "6.0"))])
    assert merged.splitlines() == [
        "# HELP sglang_ttft Time to first token.",
        "# TYPE sglang_ttft histogram",
        'sglang_ttft_bucket{worker_addr="http://a:1",le="0.1"} 1.0',
        'sglang_ttft_bucket{worker_addr="http://a:1",le="+Inf"} 3.0',
        'sglang_ttft_sum{worker_addr="http://a:1"} 0.9',
        'sglang_ttft_count{worker_addr="http://a:1"} 3.0',
        'sglang_ttft_bucket{worker_addr="http://b\\"2",le="0.1"} 1.0',
        'sglang_ttft_bucket{worker_addr="http://b\\"2",le="+Inf"} 6.0',
        'sglang_ttft_sum{worker_addr="http://b\\"2"} 0.9',
        'sglang_ttft_count{worker_addr="http://b\\"2"} 6.0',
        "",
        'sglang_ttft_other{worker_addr="http://a:1"} 4',
        'sglang_ttft_other{worker_addr="http://b\\"2"} 4',
        "",
        'plain{worker_addr="http://a:1"} 5',
        'plain{worker_addr="http://b\\"2"} 5',
    ]


def test_two_data_plane_threads_serve_concurrent_requests():
    """With more than one data-plane thread, decisions, bookings and ends cross threads."""

    async def test(bed: Bed):
        async def one(i: int) -> bool:
            body = {"text": f"request {i} " * (1 + i % 5), "sampling_params": {"max_new_tokens": 3}}
            if i % 2:
                status, lines, _ = await bed.stream("/generate", body)
                return status == 200 and lines[-1] == b"data: [DONE]"
            status, data, _ = await bed.post("/generate", body)
            return status == 200 and data["meta_info"]["completion_tokens"] == 3

        results = await asyncio.gather(*(one(i) for i in range(32)))
        loads = [(w.in_flight, w.queued_prefill_tokens) for w in bed.workers.values()]
        return results, loads, sum(bed.router.requests.values())

    results, loads, counted = run(test, data_plane_threads=2)
    assert all(results) and loads == [(0, 0), (0, 0)] and counted == 32
