"""An emulated SGLang worker: the engine model on a (scaled) real-time clock, behind SGLang's
HTTP API. Many workers run in one process and share one cluster (prefix index, global tier).

Shapes follow sglang 0.5.x (``/generate``'s ``meta_info``, the OpenAI routes, ``/v1/loads``,
``/server_info``, ``/model_info``, ``/metrics`` with ``sglang:`` names); see SPEC §6.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from smetric.engine import (
    Cluster,
    Engine,
    EngineConfig,
    EngineRequest,
    IterationEvents,
    Phase,
    RequestTooLarge,
)
from smetric.perf import Profile
from smetric.prom import Histogram, render_metrics
from smetric.request import TOKEN_BLOCK_TOKENS, BadRequest, RequestView, view_request

log = logging.getLogger("smetric.emulator")
FILLER = ("the", " agent", " calls", " a", " tool", " and", " reads", " its", " output", ".")


class ScaledClock:
    """Virtual seconds that run ``time_scale`` times faster than the wall clock."""

    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale
        self._t0 = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._t0) * self.time_scale

    async def sleep_until(self, t: float) -> None:
        delay = (t - self.now()) / self.time_scale
        if delay > 0:
            await asyncio.sleep(delay)


@dataclass
class Fault:
    """Injected misbehaviour (for tests): ``fail`` answers 500 to generation and 503 to health,
    ``hang`` never answers them, ``slow`` multiplies iteration times by ``factor``, ``drop`` cuts
    every stream after ``after_tokens`` tokens."""

    mode: str = "none"
    factor: float = 1.0
    after_tokens: int = 0

    MODES = ("none", "fail", "hang", "slow", "drop")


@dataclass(eq=False)
class Stream:
    """What one request's handler waits on."""

    req: EngineRequest
    events: asyncio.Queue[str] = field(default_factory=asyncio.Queue)


_FILLER_PREFIXES = [""]
_OUTPUT_IDS = list(range(1000)) * 8


def _filler_text(n: int) -> str:
    """The emulated output text of ``n`` tokens (prefixes cached: streams ask for every n)."""
    while len(_FILLER_PREFIXES) <= n:
        k = len(_FILLER_PREFIXES)
        _FILLER_PREFIXES.append(_FILLER_PREFIXES[-1] + FILLER[(k - 1) % len(FILLER)])
    return _FILLER_PREFIXES[n]


_CHUNK_HEADS: list[bytes] = []


def _chunk_head(n: int) -> bytes:
    """The JSON of a streamed /generate chunk's cumulative text and ids, encoded once per n
    (the emulator writes thousands of chunks a second; encoding each anew costs real time)."""
    while len(_CHUNK_HEADS) <= n:
        k = len(_CHUNK_HEADS)
        _CHUNK_HEADS.append(
            b'data: {"text": '
            + json.dumps(_filler_text(k)).encode()
            + b', "output_ids": '
            + json.dumps(_output_ids(k)).encode()
            + b', "meta_info": '
        )
    return _CHUNK_HEADS[n]


def _output_ids(n: int) -> list[int]:
    return _OUTPUT_IDS[:n] if n <= len(_OUTPUT_IDS) else [i % 1000 for i in range(n)]


class TransferFailed(Exception):
    """PD: the KV for a bootstrap room never came (prefill failed, aborted or timed out)."""


class PDRendezvous:
    """PD in one process: a prefill worker hands a finished prefill to the decode worker that
    received the same ``bootstrap_room``. One decode request per room; a room that nobody takes
    is forgotten after twice the timeout."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._rooms: dict[int, asyncio.Future[EngineRequest]] = {}
        self._taken: set[int] = set()

    def _future(self, room: int) -> asyncio.Future[EngineRequest]:
        fut = self._rooms.get(room)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = self._rooms[room] = loop.create_future()
            loop.call_later(2 * self.timeout_s, self._expire, room, fut)
        return fut

    def _expire(self, room: int, fut: asyncio.Future[EngineRequest]) -> None:
        if self._rooms.get(room) is fut and room not in self._taken:
            del self._rooms[room]
        if fut.done() and not fut.cancelled():
            fut.exception()  # retrieved: no "never retrieved" warning
        fut.cancel()

    def deliver(self, room: int, req: EngineRequest) -> None:
        fut = self._future(room)
        if not fut.done():
            fut.set_result(req)

    def fail(self, room: int, message: str) -> None:
        fut = self._future(room)
        if not fut.done():
            fut.set_exception(TransferFailed(message))

    async def take(self, room: int) -> EngineRequest:
        if room in self._taken:
            raise BadRequest(f"bootstrap_room {room} already has a decode request")
        self._taken.add(room)
        try:
            return await asyncio.wait_for(asyncio.shield(self._future(room)), self.timeout_s)
        except TimeoutError:
            raise TransferFailed(f"no KV arrived for bootstrap_room {room}") from None
        finally:
            self._taken.discard(room)
            self._rooms.pop(room, None)


class EmulatedWorker:
    def __init__(
        self,
        name: str,
        profile: Profile,
        cluster: Cluster,
        clock: ScaledClock,
        config: EngineConfig = EngineConfig(),
        role: str = "mixed",
        model_name: str = "default",
        port: int = 0,
        rendezvous: PDRendezvous | None = None,
    ) -> None:
        self.engine = Engine(name, profile, cluster, config, role)
        self.name = name
        self.clock = clock
        self.model_name = model_name
        self.port = port
        self.role = role
        self.rendezvous = rendezvous or PDRendezvous()
        self.fault = Fault()
        self._streams: dict[EngineRequest, Stream] = {}
        self._last_token_s: dict[EngineRequest, float] = {}
        self._wake = asyncio.Event()
        self._last_end = 0.0
        self._back_to_back = False
        self._loop_task: asyncio.Task[None] | None = None
        self.completed: deque[dict[str, Any]] = deque(maxlen=100_000)
        """The engine's own timing of finished requests (wall seconds), for fidelity checks."""
        self.ttft_hist = Histogram(Histogram.TTFT_BUCKETS)
        self.e2e_hist = Histogram(Histogram.E2E_BUCKETS)
        self.itl_hist = Histogram(Histogram.ITL_BUCKETS)
        self.started_s = time.time()

    # ---- the engine loop -----------------------------------------------------------------

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None

    async def _run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_work():
                self._back_to_back = False
                self._wake.clear()
                await self._wake.wait()
                continue
            # Back to back, an iteration starts when the last one ended on the virtual clock, so
            # timer overshoot does not add up; after idling it starts now. The engine leaves
            # requests that arrived after the start for a later iteration.
            start = self._last_end if self._back_to_back else self.clock.now()
            engine.slowdown = self.fault.factor if self.fault.mode == "slow" else 1.0
            try:
                batch = engine.next_batch(start)
                if batch is None:
                    if self._back_to_back:
                        self._back_to_back = False  # work arrived after the last iteration
                        continue
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                end = start + batch.duration_s
                await self.clock.sleep_until(end)
                self._last_end = end
                self._back_to_back = True
                self._deliver(engine.finish_batch(batch, end), end)
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug must not silently stop the worker: log it, fail what is in flight.
                log.exception("emulated worker %s: engine iteration failed", self.name)
                for stream in list(self._streams.values()):
                    engine.abort(stream.req)
                    stream.events.put_nowait("error")
                self._back_to_back = False

    def _deliver(self, events: IterationEvents, now: float) -> None:
        # Latencies go to the metrics in wall-clock seconds, as clients observe them.
        scale = self.clock.time_scale
        for req in events.first_token:
            self.ttft_hist.observe((now - req.arrival_s) / scale)
            self._last_token_s[req] = now
            self._push(req, "token")
        for req in events.decoded:
            self.itl_hist.observe((now - self._last_token_s.get(req, now)) / scale)
            self._last_token_s[req] = now
            self._push(req, "token")
        for req in events.finished:
            self.e2e_hist.observe((now - req.arrival_s) / scale)
            ttft, tpot = req.ttft_s, req.tpot_s
            self.completed.append(
                {
                    "rid": req.rid,
                    "ttft_s": None if ttft is None else ttft / scale,
                    "tpot_s": None if tpot is None else tpot / scale,
                    "e2e_s": (now - req.arrival_s) / scale,
                }
            )
            self._last_token_s.pop(req, None)
            self._push(req, "finish")
        for req in events.handoff:
            self._push(req, "handoff")
            room = req.extra.get("bootstrap_room")
            if isinstance(room, int):
                delay = self.engine.transfer_time_s(req) / scale
                asyncio.get_running_loop().call_later(delay, self.rendezvous.deliver, room, req)

    def _push(self, req: EngineRequest, event: str) -> None:
        stream = self._streams.get(req)
        if stream is not None:
            stream.events.put_nowait(event)

    def submit(self, req: EngineRequest) -> Stream:
        self.engine.add_request(req)
        stream = Stream(req)
        self._streams[req] = stream
        self._wake.set()
        return stream

    def submit_decode(self, req: EngineRequest) -> Stream:
        try:
            self.engine.add_decode(req)
        except RequestTooLarge as e:
            raise BadRequest(str(e)) from None
        stream = Stream(req)
        self._streams[req] = stream
        self._wake.set()
        return stream

    def release(self, stream: Stream) -> None:
        self._streams.pop(stream.req, None)
        self._last_token_s.pop(stream.req, None)
        room = stream.req.extra.get("bootstrap_room")
        if (
            self.role == "prefill"
            and isinstance(room, int)
            and stream.req.phase is not Phase.TRANSFER
        ):
            self.rendezvous.fail(room, "the prefill request ended before its KV was handed over")
        if stream.req.finish_s is None:
            self.engine.abort(stream.req)

    # ---- request parsing -----------------------------------------------------------------

    def _engine_request(
        self, view: RequestView, body: dict[str, Any], arrived: float
    ) -> EngineRequest:
        rid = body.get("rid")
        rid = rid if isinstance(rid, str) and rid else uuid.uuid4().hex
        key, max_new = view.key, max(view.max_new_tokens, 1)
        req = EngineRequest(
            rid, key.prompt_tokens, max_new, key.keys, key.block_tokens, arrival_s=arrived
        )
        try:
            self.engine.check(req)
        except RequestTooLarge:
            raise BadRequest(
                f"The input ({key.prompt_tokens} tokens) is longer than the model's context "
                f"length ({self.engine.pool_tokens - max_new} tokens)."
            ) from None
        return req

    # ---- streams of events ---------------------------------------------------------------

    async def _events(self, stream: Stream) -> AsyncIterator[str]:
        while True:
            event = await stream.events.get()
            if event == "error":
                raise TransferFailed("the engine failed")
            yield event
            if event in ("finish", "handoff"):
                return

    async def _run_request(
        self, request: web.Request, body: dict[str, Any], req: EngineRequest
    ) -> Stream:
        """Admits a request, through the PD rendezvous when this is a decode worker."""
        room = body.get("bootstrap_room")
        if self.role == "prefill":
            if not isinstance(room, int):
                raise BadRequest("a prefill worker needs bootstrap_room (int) in the request")
            req.extra["bootstrap_room"] = room
            return self.submit(req)
        if self.role == "decode":
            if not isinstance(room, int):
                raise BadRequest("a decode worker needs bootstrap_room (int) in the request")
            prefilled = await self.rendezvous.take(room)
            prefilled.arrival_s = req.arrival_s
            return self.submit_decode(prefilled)
        return self.submit(req)

    # ---- HTTP ----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/get_load", self.get_load)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/metrics", self.metrics)
        r.add_post("/_emulator/fault", self.set_fault)
        r.add_get("/_emulator/fault", self.get_fault)
        r.add_get("/_emulator/completed", self.get_completed)
        return app

    async def _fault_gate(self) -> web.Response | None:
        if self.fault.mode == "fail":
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        if self.fault.mode == "hang":
            await asyncio.Event().wait()  # until the client gives up
        return None

    async def _json(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    @staticmethod
    def _int_field(value: Any, name: str, default: int) -> int:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadRequest(f"{name} must be a non-negative integer")
        return value

    # /generate -----------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrived = self.clock.now()
        try:
            if (gate := await self._fault_gate()) is not None:
                return gate
            body = await self._json(request)
            ids = body.get("input_ids")
            if isinstance(body.get("text"), list) or (
                isinstance(ids, list) and ids and isinstance(ids[0], list)
            ):
                raise BadRequest("batched requests are not emulated")
            req = self._engine_request(view_request("generate", body), body, arrived)
            stream = await self._run_request(request, body, req)
        except BadRequest as e:
            return web.json_response({"error": {"message": str(e)}}, status=400)
        except TransferFailed as e:
            return web.json_response({"error": {"message": str(e)}}, status=500)
        try:
            if body.get("stream"):
                return await self._stream_generate(request, stream)
            async for _ in self._events(stream):
                pass
            return web.json_response(self._generate_body(stream.req, final=True))
        except TransferFailed as e:
            return web.json_response({"error": {"message": str(e)}}, status=500)
        finally:
            self.release(stream)

    def _generate_body(
        self, req: EngineRequest, final: bool, tokens: int | None = None
    ) -> dict[str, Any]:
        n = req.generated_tokens if tokens is None else tokens
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": {"type": "length", "length": n} if final else None,
            "prompt_tokens": req.prompt_tokens,
            "weight_version": "default",
            "completion_tokens": n,
            "cached_tokens": req.cached_tokens,
        }
        if final:
            meta["e2e_latency"] = (self.clock.now() - req.arrival_s) / self.clock.time_scale
        return {
            "text": _filler_text(n),
            "output_ids": _output_ids(n),
            "meta_info": meta,
        }

    async def _stream_generate(self, request: web.Request, stream: Stream) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = 0
        async for event in self._events(stream):
            if event == "token" or event == "handoff":
                sent += 1
                if self.fault.mode == "drop" and sent > self.fault.after_tokens:
                    self._drop(request)
                    return resp
                if sent < stream.req.max_new_tokens:
                    req = stream.req
                    meta = (
                        f'{{"id": {json.dumps(req.rid)}, "finish_reason": null, '
                        f'"prompt_tokens": {req.prompt_tokens}, "weight_version": "default", '
                        f'"completion_tokens": {sent}, "cached_tokens": {req.cached_tokens}}}}}\n\n'
                    )
                    await resp.write(_chunk_head(sent) + meta.encode())
        await self._send(resp, self._generate_body(stream.req, final=True))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _drop(request: web.Request) -> None:
        """Fault: cut the connection mid-stream, as a crashing worker would."""
        if request.transport is not None:
            request.transport.abort()

    @staticmethod
    async def _send(resp: web.StreamResponse, payload: dict[str, Any]) -> None:
        await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    # OpenAI routes -------------------------------------------------------------------------

    @staticmethod
    def _openai_error(message: str, status: int = 400) -> web.Response:
        kind = "BadRequestError" if status == 400 else "InternalServerError"
        return web.json_response(
            {"object": "error", "message": message, "type": kind, "param": None, "code": status},
            status=status,
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def _openai(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrived = self.clock.now()
        try:
            if (gate := await self._fault_gate()) is not None:
                return gate
            body = await self._json(request)
            req = self._engine_request(
                view_request("chat" if chat else "completions", body), body, arrived
            )
            model = body.get("model")
            model = model if isinstance(model, str) else self.model_name
            stream = await self._run_request(request, body, req)
        except BadRequest as e:
            return self._openai_error(str(e))
        except TransferFailed as e:
            return self._openai_error(str(e), 500)
        try:
            if body.get("stream"):
                options = body.get("stream_options") or {}
                usage = isinstance(options, dict) and bool(options.get("include_usage"))
                return await self._stream_openai(request, stream, chat, model, usage)
            async for _ in self._events(stream):
                pass
            return web.json_response(self._openai_body(stream.req, chat, model))
        finally:
            self.release(stream)

    @staticmethod
    def _usage(req: EngineRequest) -> dict[str, Any]:
        return {
            "prompt_tokens": req.prompt_tokens,
            "total_tokens": req.prompt_tokens + req.generated_tokens,
            "completion_tokens": req.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
        }

    def _openai_body(self, req: EngineRequest, chat: bool, model: str) -> dict[str, Any]:
        text = _filler_text(req.generated_tokens)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": None}
        else:
            choice["text"] = text
        return {
            "id": req.rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": self._usage(req),
        }

    async def _stream_openai(
        self, request: web.Request, stream: Stream, chat: bool, model: str, usage: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        req = stream.req
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta = {"role": "assistant", "content": ""}
                elif delta_text is not None:
                    delta = {"content": delta_text}
                choice["delta"] = delta
            else:
                choice["text"] = delta_text or ""
            return {
                "id": req.rid,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": None,
            }

        if chat:
            await self._send(resp, chunk(None, None, role=True))
        sent = 0
        async for event in self._events(stream):
            if event != "token":
                continue
            sent += 1
            if self.fault.mode == "drop" and sent > self.fault.after_tokens:
                self._drop(request)
                return resp
            last = req.finish_s is not None and sent >= req.generated_tokens
            piece = FILLER[(sent - 1) % len(FILLER)]
            await self._send(resp, chunk(piece, None if (chat or not last) else "length"))
        if chat:
            await self._send(resp, chunk(None, "length"))
        if usage:
            await self._send(
                resp,
                {
                    "id": req.rid,
                    "object": kind,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": self._usage(req),
                },
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # info and admin ------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.fault.mode == "fail":
            return web.Response(status=503)
        if self.fault.mode == "hang":
            await asyncio.Event().wait()
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        if await self._fault_gate() is not None:
            return web.Response(status=503)
        return web.Response(status=200)

    def _server_args(self) -> dict[str, Any]:
        cfg = self.engine.config
        return {
            "model_path": self.model_name,
            "tokenizer_path": self.model_name,
            "served_model_name": self.model_name,
            "page_size": TOKEN_BLOCK_TOKENS,
            "chunked_prefill_size": cfg.chunk_tokens,
            "max_running_requests": cfg.max_running_requests,
            "context_length": self.engine.pool_tokens,
            "tp_size": 1,
            "dp_size": 1,
            "port": self.port,
            "disaggregation_mode": "null" if self.role == "mixed" else self.role,
            "enable_hierarchical_cache": self.engine.cluster.global_tier is not None,
            "hicache_storage_backend": "mooncake" if self.engine.cluster.global_tier else None,
        }

    async def server_info(self, request: web.Request) -> web.Response:
        info = self._server_args()
        info.update(
            {
                "status": "ready",
                "max_total_num_tokens": self.engine.pool_tokens,
                "max_req_input_len": self.engine.pool_tokens - 1,
                "internal_states": [{**self._server_args(), "last_gen_throughput": 0.0}],
                "version": "0.5.9-smetric-emulator",
                "emulator": {
                    "profile": self.engine.profile.name,
                    "time_scale": self.clock.time_scale,
                },
            }
        )
        return web.json_response(info)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_name,
                "tokenizer_path": self.model_name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": self.engine.profile.model.name,
                "architectures": None,
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": int(self.started_s),
                        "owned_by": "sglang",
                        "root": self.model_name,
                        "parent": None,
                        "max_model_len": self.engine.pool_tokens,
                    }
                ],
            }
        )

    def _cache_hit_rate(self) -> float:
        e = self.engine
        return e.cached_tokens_total / e.prompt_tokens_total if e.prompt_tokens_total else 0.0

    async def loads(self, request: web.Request) -> web.Response:
        load = self.engine.load()
        entry = {
            "num_running_reqs": load.running,
            "num_waiting_reqs": load.waiting,
            "num_used_tokens": load.used_tokens,
            "max_total_num_tokens": load.pool_tokens,
            "token_usage": load.used_tokens / load.pool_tokens if load.pool_tokens else 0.0,
            "gen_throughput": 0.0,
            "cache_hit_rate": self._cache_hit_rate(),
            "utilization": 1.0 if self.engine.busy_until_s is not None else 0.0,
            "max_running_requests": self.engine.config.max_running_requests,
            "queues": {"waiting": load.waiting, "grammar": 0, "paused": 0, "retracted": 0},
            "num_total_reqs": load.running + load.waiting,
        }
        return web.json_response(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                "version": "0.5.9-smetric-emulator",
                "dp_rank_count": 1,
                "loads": [entry],
                "aggregate": {
                    "total_running_reqs": load.running,
                    "total_waiting_reqs": load.waiting,
                    "total_reqs": load.running + load.waiting,
                    "avg_token_usage": entry["token_usage"],
                    "avg_throughput": 0.0,
                    "avg_utilization": entry["utilization"],
                },
            }
        )

    async def get_load(self, request: web.Request) -> web.Response:
        load = self.engine.load()
        return web.json_response(
            [
                {
                    "dp_rank": None,
                    "num_reqs": load.running,
                    "num_waiting_reqs": load.waiting,
                    "num_tokens": load.used_tokens,
                }
            ]
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.has_work():
            return web.Response(
                status=400,
                text="Cache not flushed. Please check backend logs for more details. (When there "
                "are running or waiting requests, the operation will not be performed.)\n",
            )
        self.engine.flush_cache()
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n"
        )

    async def metrics(self, request: web.Request) -> web.Response:
        load = self.engine.load()
        e = self.engine
        text = render_metrics(
            {
                "model_name": self.model_name,
                "engine_type": "unified" if self.role == "mixed" else self.role,
            },
            gauges={
                "num_running_reqs": load.running,
                "num_queue_reqs": load.waiting,
                "num_used_tokens": load.used_tokens,
                "token_usage": load.used_tokens / load.pool_tokens if load.pool_tokens else 0.0,
                "cache_hit_rate": self._cache_hit_rate(),
                "max_total_num_tokens": load.pool_tokens,
                "gen_throughput": 0.0,
            },
            counters={
                "prompt_tokens_total": e.prompt_tokens_total,
                "generation_tokens_total": e.generation_tokens_total,
                "num_requests_total": e.requests_total,
                "cached_tokens_total": e.cached_tokens_total,
            },
            histograms={
                "time_to_first_token_seconds": self.ttft_hist,
                "e2e_request_latency_seconds": self.e2e_hist,
                "inter_token_latency_seconds": self.itl_hist,
            },
        )
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def set_fault(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            mode = body.get("mode", "none")
            if mode not in Fault.MODES:
                raise BadRequest(f"mode must be one of {', '.join(Fault.MODES)}")
            factor = body.get("factor", 1.0)
            if not isinstance(factor, int | float) or factor <= 0:
                raise BadRequest("factor must be a positive number")
            after = self._int_field(body.get("after_tokens"), "after_tokens", 0)
        except BadRequest as e:
            return web.json_response({"error": {"message": str(e)}}, status=400)
        self.fault = Fault(mode, float(factor), after)
        return web.json_response(self._fault_dict())

    async def get_completed(self, request: web.Request) -> web.Response:
        return web.json_response(list(self.completed))

    async def get_fault(self, request: web.Request) -> web.Response:
        return web.json_response(self._fault_dict())

    def _fault_dict(self) -> dict[str, Any]:
        return {
            "mode": self.fault.mode,
            "factor": self.fault.factor,
            "after_tokens": self.fault.after_tokens,
        }
