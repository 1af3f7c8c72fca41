"""Drop-in equivalence with sglang-router 0.3.2 (PyPI), end to end.

Both routers run in front of the same emulated SGLang workers (two, no global tier, caches
flushed before every request, so a worker's answer depends only on the request). Between each
router and each worker sits a tap that forwards everything and records what the router sent
where. The same chat, completions and generate requests (streaming and not, with tools, with
fields no schema knows) go through sglang-router and through ours, under every policy both
have, and the answers must match: status, content type, SSE framing, and the whole JSON once ids
and timestamps are set aside (so texts and token counts, ``usage`` and ``meta_info`` included).

Where sglang-router differs by design, the difference is asserted, not hidden:
- it re-serializes request bodies from its typed schema: it drops fields it does not know
  (``/generate`` and chat; completions keeps them), renames chat ``max_tokens`` to
  ``max_completion_tokens``, adds ``tool_choice: "auto"`` when tools are given, fills in its
  defaults, and sets a missing chat ``model`` to ``"unknown"``; we forward bodies byte for byte;
- its input errors are partly plain text (non-JSON body, a completions body without ``prompt``:
  422), partly JSON, and a ``/generate`` body without a prompt is left to the worker; ours are
  all JSON ``{"error": {"message", "type", "code"}}`` from the router itself (SPEC §5).

sglang-router comes from the ``[test]`` extras. Without it the module fails rather than skips,
unless ``SMETRIC_SKIP_SGLANG_ROUTER=1`` is set (never in CI).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web

from smetric.emulator import EmulatedCluster
from smetric.perf import PRESETS
from smetric.router import Listening, Router, RouterConfig, listen
from smetric.workload.e2e_sweep import free_port, router_env, stop_process, wait_ready

if os.environ.get("SMETRIC_SKIP_SGLANG_ROUTER") == "1":
    pytest.skip("SMETRIC_SKIP_SGLANG_ROUTER=1", allow_module_level=True)
if importlib.util.find_spec("sglang_router") is None:
    pytest.fail(
        "sglang-router is not installed: pip install -e '.[test]' (or set "
        "SMETRIC_SKIP_SGLANG_ROUTER=1 to skip these tests deliberately)",
        pytrace=False,
    )

PROFILE = PRESETS["qwen2.5-7b-h200"]
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
GENERATION_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")
T = TypeVar("T")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_reservation",
            "description": "Look up a reservation.",
            "parameters": {
                "type": "object",
                "properties": {"reservation_id": {"type": "string"}},
                "required": ["reservation_id"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You are an airline agent. " * 40}
CHAT = {
    "model": "default",
    "messages": [SYSTEM, {"role": "user", "content": "Where is my booking ZFA04Y?"}],
    "tools": TOOLS,
    "max_tokens": 7,
    "temperature": 0.0,
    "my_client_field": {"trace": [1, 2]},
}
CHAT_USAGE = {**CHAT, "stream_options": {"include_usage": True}}
CHAT_MAX_COMPLETION = {
    "model": "default",
    "messages": [{"role": "user", "content": "Say hi."}],
    "max_completion_tokens": 3,
}
COMPLETIONS = {
    "model": "default",
    "prompt": "def fib(n):" + " pass\n" * 120,
    "max_tokens": 5,
    "my_client_field": 1,
}
GENERATE_TEXT = {
    "text": "Summarise this tool output: " + "row of output\n" * 150,
    "sampling_params": {"max_new_tokens": 6, "temperature": 0},
    "my_client_field": 1,
}
GENERATE_IDS = {"input_ids": list(range(300)), "sampling_params": {"max_new_tokens": 4}}
CASES = {
    "chat_tools_unknown_field": ("/v1/chat/completions", CHAT),
    "chat_include_usage": ("/v1/chat/completions", CHAT_USAGE),
    "chat_max_completion_tokens": ("/v1/chat/completions", CHAT_MAX_COMPLETION),
    "completions": ("/v1/completions", COMPLETIONS),
    "generate_text": ("/generate", GENERATE_TEXT),
    "generate_input_ids": ("/generate", GENERATE_IDS),
}
VOLATILE = {"id", "created", "e2e_latency"}
"""Fields that differ between any two runs of the same request (ids, clocks)."""


# ---- the test bed -------------------------------------------------------------------------


@dataclass
class Tap:
    """Forwards everything to one worker; records the generation requests a router sent it."""

    worker: str
    http: aiohttp.ClientSession
    url: str = ""
    seen: list[tuple[str, bytes]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if request.method == "POST" and request.path in GENERATION_PATHS:
            self.seen.append((request.path, raw))
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with self.http.request(
            request.method, self.worker + request.path_qs, data=raw, headers=headers
        ) as r:
            kind = r.headers.get("Content-Type", "")
            if not kind.startswith("text/event-stream"):
                body = await r.read()
                return web.Response(status=r.status, body=body, headers={"Content-Type": kind})
            resp = web.StreamResponse(status=r.status, headers={"Content-Type": kind})
            await resp.prepare(request)
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp


@dataclass
class Reply:
    status: int
    content_type: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[bytes]:
        """The SSE events, each checked to be one ``data: ...`` line."""
        assert self.body.endswith(b"\n\n"), self.body[-80:]
        events = self.body[:-2].split(b"\n\n")
        assert all(e.startswith(b"data: ") and b"\n" not in e for e in events), events
        return [e[len(b"data: ") :] for e in events]


class Bed:
    """The emulated cluster, the taps, our router and sglang-router, on one event loop that runs
    in a thread of its own for the whole module (tests call in with ``run``)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: list[web.AppRunner] = []
        self.cluster = EmulatedCluster(PROFILE, workers=2, time_scale=20.0, global_tier=None)
        self.taps: list[Tap] = []
        self.http: aiohttp.ClientSession | None = None
        self.ours: Router | None = None
        self.ours_server: Listening | None = None
        self.ours_url = self.sglang_url = ""
        self.sglang: subprocess.Popen[bytes] | None = None
        self.sglang_log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _serve(self, app: web.Application) -> str:
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[-1][1]}"

    async def _start_cluster(self) -> None:
        self.http = aiohttp.ClientSession(auto_decompress=False)
        for url in await self.cluster.start():
            tap = Tap(url, self.http)
            app = web.Application(client_max_size=64 << 20)
            app.router.add_route("*", "/{path:.*}", tap.handle)
            tap.url = await self._serve(app)
            self.taps.append(tap)

    def start(self) -> None:
        self.run(self._start_cluster())

    def start_routers(self, policy: str) -> None:
        urls = [t.url for t in self.taps]
        port = free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls]
        cmd += ["--policy", policy, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1"]
        cmd += ["--log-level", "warn"]
        self.sglang = subprocess.Popen(
            cmd, stdout=self.sglang_log, stderr=self.sglang_log, env=router_env()
        )
        self.sglang_url = f"http://127.0.0.1:{port}"
        self.ours = Router(RouterConfig(worker_urls=urls, policy=policy, port=0))
        self.ours_server = self.run(listen(self.ours, "127.0.0.1", 0))  # the Rust data plane
        self.ours_url = f"http://127.0.0.1:{self.ours_server.port}"
        try:
            self.run(wait_ready(self.sglang_url, self.sglang, 60.0), timeout_s=70.0)
        except RuntimeError as e:
            self.sglang_log.seek(0)
            tail = self.sglang_log.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"sglang-router did not start: {e}\n{tail}") from None

    def stop_routers(self) -> None:
        if self.sglang is not None:
            stop_process(self.sglang)
            self.sglang = None
        if self.ours_server is not None:
            self.run(self.ours_server.close())
            self.ours, self.ours_server = None, None

    async def _stop(self) -> None:
        for runner in reversed(self.runners):
            with contextlib.suppress(Exception):
                await runner.cleanup()
        await self.cluster.stop()
        if self.http is not None:
            await self.http.close()

    def stop(self) -> None:
        self.stop_routers()
        with contextlib.suppress(Exception):
            self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.sglang_log.close()

    # ---- calls ---------------------------------------------------------------------------

    def flush(self) -> None:
        for w in self.cluster.workers:
            w.engine.flush_cache()

    async def _send(self, url: str, path: str, data: bytes) -> Reply:
        assert self.http is not None
        headers = {"Content-Type": "application/json"}
        async with self.http.post(url + path, data=data, headers=headers) as r:
            return Reply(r.status, r.headers.get("Content-Type", ""), await r.read())

    def send(self, router: str, path: str, body: Any, cold: bool = True) -> Reply:
        """Sends ``body`` (bytes as they are, anything else as JSON) through ``router``
        (``"sglang"`` or ``"ours"``), on flushed caches unless ``cold`` is False."""
        if cold:
            self.flush()
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        url = self.sglang_url if router == "sglang" else self.ours_url
        return self.run(self._send(url, path, data))

    def both(self, path: str, body: Any, cold: bool = True) -> tuple[Reply, Reply]:
        return self.send("sglang", path, body, cold), self.send("ours", path, body, cold)

    def served(self) -> list[int]:
        """Generation requests each worker has received so far."""
        return [len(t.seen) for t in self.taps]


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    b = Bed()
    try:
        b.start()
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="module", params=POLICIES)
def routers(request: pytest.FixtureRequest, bed: Bed) -> Iterator[str]:
    """Both routers with the same policy in front of the bed's workers."""
    try:
        bed.start_routers(request.param)
        yield request.param
    finally:
        bed.stop_routers()


# ---- comparing answers --------------------------------------------------------------------


def normalized(value: Any) -> Any:
    """``value`` with the fields that differ run to run (ids, clocks) replaced by their type."""
    if isinstance(value, dict):
        return {k: type(v).__name__ if k in VOLATILE else normalized(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    return value


def comparable(reply: Reply) -> tuple[int, str, Any]:
    mime = reply.content_type.split(";")[0].strip()
    if mime == "text/event-stream":
        events = reply.events()
        assert events[-1] == b"[DONE]" and b"[DONE]" not in events[:-1]
        return reply.status, mime, [normalized(json.loads(e)) for e in events[:-1]]
    return reply.status, mime, normalized(reply.json())


# ---- equivalence --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "stream"),
    [
        (case, stream)
        for case in sorted(CASES)
        for stream in (False, True)
        if stream or "stream_options" not in CASES[case][1]
    ],
)
def test_same_answers_as_sglang_router(bed: Bed, routers: str, case: str, stream: bool) -> None:
    path, body = CASES[case]
    before = bed.served()
    theirs, ours = bed.both(path, {**body, "stream": stream})
    # Each router sent the request to exactly one worker, once.
    assert sum(bed.served()) - sum(before) == 2
    assert comparable(ours) == comparable(theirs)
    status, mime, answer = comparable(ours)
    assert status == 200
    assert mime == ("text/event-stream" if stream else "application/json")
    # Real content, not two matching empties: the requested tokens, counted in the usage.
    if path == "/generate":
        final = answer[-1] if stream else answer
        asked = body["sampling_params"]["max_new_tokens"]
        assert final["meta_info"]["completion_tokens"] == asked
        assert final["meta_info"]["prompt_tokens"] > 0
        assert final["meta_info"]["finish_reason"] == {"type": "length", "length": asked}
    elif not stream or "stream_options" in body:
        usage = answer[-1]["usage"] if stream else answer["usage"]
        asked = body.get("max_tokens") or body["max_completion_tokens"]
        assert usage["completion_tokens"] == asked
        assert usage["total_tokens"] == usage["prompt_tokens"] + asked
    else:
        assert answer[-1]["choices"][0]["finish_reason"] == "length"


def test_follow_up_turns_get_the_same_cache_hits_through_both(bed: Bed, routers: str) -> None:
    """A session's second turn after its first, caches warm: the KV hit each router's routing
    earns shows in ``cached_tokens``; cache_aware must earn the whole first turn in both."""
    first = {**CHAT, "messages": [SYSTEM, {"role": "user", "content": f"[{routers}] Hello."}]}
    second = {
        **first,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "the agent calls a tool and reads its output"},
            {"role": "user", "content": "Cancel it, please."},
        ],
    }
    hits = {}
    workers = {}
    for router in ("sglang", "ours"):
        bed.flush()
        turns = []
        for body in (first, second):
            before = bed.served()
            reply = bed.send(router, "/v1/chat/completions", body, cold=False)
            assert reply.status == 200
            after = bed.served()
            turns.append(next(i for i in range(len(after)) if after[i] > before[i]))
            usage = reply.json()["usage"]
        hits[router] = usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]
        workers[router] = turns
    if routers == "cache_aware":
        assert workers["sglang"][0] == workers["sglang"][1]
        assert workers["ours"][0] == workers["ours"][1]
        assert hits["ours"] == hits["sglang"]
        assert 0 < hits["ours"][0] < hits["ours"][1]
    elif routers == "round_robin":
        # The second turn lands on the other worker in both, which holds nothing of it.
        assert workers["sglang"][0] != workers["sglang"][1]
        assert workers["ours"][0] != workers["ours"][1]
        assert hits["ours"] == hits["sglang"] and hits["ours"][0] == 0
    else:
        assert hits["ours"][1] == hits["sglang"][1]


ONLY_ROUND_ROBIN = pytest.mark.parametrize("routers", ["round_robin"], indirect=True)
"""For tests that do not depend on the policy, or are about round robin."""


@ONLY_ROUND_ROBIN
def test_round_robin_alternates_workers_in_both(bed: Bed, routers: str) -> None:
    for router in ("sglang", "ours"):
        order = []
        for i in range(4):
            before = bed.served()
            body = {**GENERATE_TEXT, "text": f"{i} " + GENERATE_TEXT["text"]}
            assert bed.send(router, "/generate", body).status == 200
            after = bed.served()
            order.append(next(w for w in range(2) if after[w] > before[w]))
        assert (
            order[0] != order[1] and order[::2] == [order[0]] * 2 and order[1::2] == [order[1]] * 2
        )


# ---- differences by design ----------------------------------------------------------------


def forwarded(bed: Bed, router: str, path: str, body: Any) -> Any:
    """What the worker received when ``body`` went through ``router``."""
    before = bed.served()
    reply = bed.send(router, path, body)
    assert reply.status == 200, reply.body
    after = bed.served()
    worker = next(w for w in range(2) if after[w] > before[w])
    got_path, raw = bed.taps[worker].seen[-1]
    assert got_path == path
    return raw, reply


@ONLY_ROUND_ROBIN
def test_ours_forwards_bodies_byte_for_byte_where_sglang_router_rewrites_them(
    bed: Bed, routers: str
) -> None:
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", COMPLETIONS),
        ("/generate", GENERATE_TEXT),
    ):
        raw = json.dumps(body, indent=1).encode()  # odd formatting must survive too
        ours, _ = forwarded(bed, "ours", path, raw)
        assert ours == raw

    # sglang-router: chat re-serialized from its schema.
    theirs, _ = forwarded(bed, "sglang", "/v1/chat/completions", CHAT)
    theirs = json.loads(theirs)
    assert "my_client_field" not in theirs  # unknown field dropped
    assert "max_tokens" not in theirs and theirs["max_completion_tokens"] == CHAT["max_tokens"]
    assert theirs["tool_choice"] == "auto"  # added because tools are present
    assert theirs["messages"] == CHAT["messages"] and theirs["tools"] == CHAT["tools"]
    assert theirs["stream"] is False and theirs["skip_special_tokens"] is True  # its defaults

    # Completions: unknown fields survive there, defaults are added.
    theirs, _ = forwarded(bed, "sglang", "/v1/completions", COMPLETIONS)
    theirs = json.loads(theirs)
    assert theirs["my_client_field"] == 1 and theirs["max_tokens"] == COMPLETIONS["max_tokens"]
    assert theirs["echo"] is False

    # /generate: unknown fields dropped, at the top and inside sampling_params.
    odd = {**GENERATE_TEXT, "sampling_params": {"max_new_tokens": 2, "my_knob": 3}}
    theirs, _ = forwarded(bed, "sglang", "/generate", odd)
    theirs = json.loads(theirs)
    assert "my_client_field" not in theirs and theirs["sampling_params"] == {"max_new_tokens": 2}
    assert theirs["text"] == odd["text"] and theirs["model"] is None

    # A chat request without a model: sglang-router names it "unknown", ours leaves it out and
    # the worker answers with its own model name.
    no_model = {k: v for k, v in CHAT_MAX_COMPLETION.items() if k != "model"}
    theirs, their_reply = forwarded(bed, "sglang", "/v1/chat/completions", no_model)
    ours, our_reply = forwarded(bed, "ours", "/v1/chat/completions", no_model)
    assert json.loads(theirs)["model"] == "unknown" and "model" not in json.loads(ours)
    assert their_reply.json()["model"] == "unknown" and our_reply.json()["model"] == "default"


ERROR_SHAPE = {"error": {"message": str, "type": str, "code": (str, int)}}


def error_shaped(reply: Reply) -> bool:
    if not reply.content_type.startswith("application/json"):
        return False
    error = reply.json().get("error")
    return isinstance(error, dict) and all(
        isinstance(error.get(k), t) for k, t in ERROR_SHAPE["error"].items()
    )


@ONLY_ROUND_ROBIN
def test_bad_input_errors_compared_with_sglang_router(bed: Bed, routers: str) -> None:
    before = bed.served()
    cases = {
        "not json": ("/generate", b"not json"),
        "chat without messages": ("/v1/chat/completions", b"{}"),
        "chat messages not a list": ("/v1/chat/completions", b'{"messages": 3}'),
        "completions without prompt": ("/v1/completions", b'{"model": "default"}'),
        "generate without prompt": ("/generate", b"{}"),
    }
    replies = {name: bed.both(path, data) for name, (path, data) in cases.items()}
    # Ours: every one a 400 with the same JSON error shape, answered by the router itself.
    for name, (_, ours) in replies.items():
        assert ours.status == 400 and error_shaped(ours), (name, ours)
    # Only sglang-router's /generate without a prompt reached a worker.
    assert sum(bed.served()) - sum(before) == 1

    theirs = {name: r[0] for name, r in replies.items()}
    # sglang-router: the same 400s for malformed chat, in the same JSON shape...
    for name in ("chat without messages", "chat messages not a list"):
        assert theirs[name].status == 400 and error_shaped(theirs[name])
        assert theirs[name].json()["error"]["type"] == "invalid_request_error"
    # ...but plain text for a body that is not JSON, 422 plain text for completions...
    assert theirs["not json"].status == 400
    assert theirs["not json"].content_type.startswith("text/plain")
    assert theirs["completions without prompt"].status == 422
    assert theirs["completions without prompt"].content_type.startswith("text/plain")
    # ...and a /generate without a prompt goes through to a worker, which rejects it.
    assert theirs["generate without prompt"].status == 400
    assert "error" in theirs["generate without prompt"].json()

    # Unknown routes: 404 from both; ours says so in JSON.
    theirs_404, ours_404 = bed.both("/v2/nothing", b"{}")
    assert theirs_404.status == ours_404.status == 404 and error_shaped(ours_404)


def test_our_accounting_returns_to_zero_after_the_traffic(bed: Bed, routers: str) -> None:
    """Runs after the policy's other tests (file order): everything dispatched was settled."""
    assert bed.ours is not None
    bed.ours.settle()  # the Rust data plane's booking of the last answers may still be queued
    workers = bed.ours.workers.values()
    assert all(w.in_flight == 0 and w.queued_prefill_tokens == 0 for w in workers)
    assert sum(w.requests_total for w in workers) == sum(
        n for (_, status), n in bed.ours.requests.items() if status == 200
    )
