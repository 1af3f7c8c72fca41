"""The router: SGLang's router HTTP surface over a worker registry, the prefix index and a policy.

Hot path, top to bottom: ``handle_generation`` reads and keys the body (``view_body``, in Rust
from the bytes; ``view_request`` over the parsed body where it cannot), ``_snapshot`` matches the
prompt against every worker at once and builds the policy's view, the policy decides, the data
plane sends the body byte for byte and streams the answer back chunk by chunk, and an
``Exchange`` keeps the accounting of each attempt (dispatch, first chunk, finish). The data
plane is Rust by default (``dataplane.rs``: tokio and hyper carry the bytes; the requests that
arrive together enter Python in one turn, ``dp_begin`` for each, and the answers' steps are
queued for ``Router.settle``); ``--data-plane aiohttp`` keeps it all in Python (``_drive``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import logging
import math
import os
import random
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import unquote, urlparse

import aiohttp
from aiohttp import web

from smetric import GLOBAL_TIER, DataPlane, PrefixIndex
from smetric._prefix_index import inject_members
from smetric.cluster import ClusterView, Decision
from smetric.perf import load_profile
from smetric.policies import Policy, PolicyConfig, SMetricConfig, make_policy
from smetric.prom import Histogram, merge_worker_metrics, render_families
from smetric.request import (
    BYTES_PER_TOKEN,
    TEXT_BLOCK_BYTES,
    TOKEN_BLOCK_TOKENS,
    BadRequest,
    KeyedBody,
    RequestView,
    loads,
    view_body,
    view_keyed,
    view_request,
    view_unkeyed,
)
from smetric.router.config import RouterConfig
from smetric.router.workers import Worker
from smetric.signals import until_stopped
from smetric.slo import SLOConfig

log = logging.getLogger("smetric.router")

DEFAULT_WORKER_TOKENS = 1_000_000
"""KV tokens assumed for a worker that does not report ``max_total_num_tokens``."""
MIN_TPOT_EVENTS = 8
"""Streams shorter than this teach the TPOT correction nothing (see ``_observe_tpot``)."""
ROUTES = {"/generate": "generate", "/v1/chat/completions": "chat", "/v1/completions": "completions"}
GENERATION_APIS = frozenset(ROUTES.values())
"""The APIs whose first streamed bytes are a first token: they alone teach the policy's TTFT and
TPOT corrections and fill the TTFT histogram."""
OTHER_ROUTES = {
    "/v1/embeddings": ("embeddings", "/v1/embeddings"),
    "/v1/rerank": ("rerank", "/v1/rerank"),
    "/rerank": ("rerank", "/v1/rerank"),
    "/v1/classify": ("classify", "/v1/classify"),
}
"""The other inference routes sglang-router 0.3.2 forwards to workers: the API (for metrics) and
the worker's path (its ``/rerank`` goes to ``/v1/rerank``). Served by the aiohttp application
(the Rust data plane hands it every route but generation): no prompt to key, so each policy
balances them (``view_unkeyed``), with generation's retries, accounting and metrics."""
RESPONSE_AFFINITY = "previous_response"
"""The reason of a Responses API request sent to the worker holding its previous response."""
MAX_RESPONSES = 100_000
"""Response ids remembered with the worker that made each (about 200 bytes each), the least
recent forgotten first."""
RESPONSE_ID_SCAN_BYTES = 64 << 10
"""How much of a stream is searched for its response id (a whole answer is read whole)."""


def sse_events(data: bytes) -> Iterator[dict[str, Any]]:
    """The JSON objects of the whole ``data:`` lines in ``data`` (others skipped)."""
    for line in data.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                event = loads(line[5:])
            except (ValueError, UnicodeDecodeError, RecursionError):
                continue  # the line is not whole yet, or not JSON
            if isinstance(event, dict):
                yield event


def response_id(data: bytes, stream: bool) -> str | None:
    """The id of a Responses API answer, from its first bytes: a whole answer's ``id``, or the
    ``response.id`` of a stream's first event with one (``response.created``); None until the
    bytes hold it."""
    if not stream:
        try:
            body = loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        rid = body.get("id") if isinstance(body, dict) else None
        return rid if isinstance(rid, str) and rid else None
    return next(filter(None, map(event_response_id, sse_events(data))), None)


def event_response_id(event: dict[str, Any]) -> str | None:
    """The id of the response a Responses stream's event carries, if it carries one."""
    response = event.get("response")
    rid = response.get("id") if isinstance(response, dict) else None
    return rid if isinstance(rid, str) and rid else None


RESPONSE_WAITING_EVENTS = frozenset(("response.created", "response.queued", "response.in_progress"))
"""A Responses stream's events that come before its output: its first other event marks the end
of its prefill."""


def uncompressed(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Upstream headers asking the worker for an answer the router can read as it is."""
    return [(k, "identity" if k == "Accept-Encoding" else v) for k, v in headers]


class Retry(Exception):
    """The worker failed before anything reached the client: try another."""


class ClientGone(Exception):
    """The client closed its connection: not the worker's fault."""


async def _downstream(write: Any) -> None:
    try:
        await write
    except (ConnectionResetError, aiohttp.ClientConnectionResetError) as e:
        raise ClientGone() from e


def error_body(status: int, message: str, kind: str | None = None) -> bytes:
    kind = kind or {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        413: "RequestTooLarge",
        503: "ServiceUnavailable",
    }.get(status, "ServerError")
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


def error_json(status: int, message: str, kind: str | None = None) -> web.Response:
    return web.Response(
        body=error_body(status, message, kind), status=status, content_type="application/json"
    )


Attempt = tuple[str, list[tuple[str, str]], list[tuple[str, str]]]
"""An attempt: the worker's URL, the headers to send it, the headers for the client."""
Booked = tuple["Exchange", str, Any, Any, Any, float]
"""A booking step the Rust data plane queued: the exchange, ``whole``/``streaming`` (status,
record, None) or ``end`` (outcome, events, span_s), and when it happened (``perf_counter``)."""


RECORD_STEP_BLOCKS = 1024
"""A prompt's blocks are recorded in the index this many at a time, so that the next request's
match waits for one step (tens of microseconds) rather than a whole long prompt's record."""


class Exchange:
    """One client request through the router: the workers it tries, the accounting of each
    attempt, and what the client is told. Two data planes drive it through the same steps, the
    aiohttp one (``Router._drive``) and the Rust one (``dataplane.rs``):

    ``next()`` names the worker of the next attempt, the headers to send it and those for the
    client (None: no worker or attempt left, answer ``refusal()``). The attempt then ends in
    ``failed(reason)`` if nothing reached the client (it returns the backoff before the next
    attempt, None when they are spent), or goes ``whole(status)`` (``answered``,
    ``first_token`` and ``end``), or ``streaming(status)`` at a stream's first chunk and
    ``end(outcome, ...)`` at its end; then ``record()`` teaches the index the prompt. ``end`` is
    safe to call again, so a data plane that loses its client can always call it.

    Every step holds the router's lock: the Rust data plane calls from its own threads. It
    does not call ``whole``, ``streaming`` or an ``end`` that returns nothing at once: it
    queues them with the time they happened, and ``Router.settle`` applies them (``at``: that
    time, on ``time.perf_counter``'s clock) before the next decision.
    """

    __slots__ = (
        "attempt_t0",
        "attempts",
        "backoff",
        "decision",
        "hit",
        "last_error",
        "learn",
        "open",
        "path",
        "pinned",
        "prefilled",
        "rid",
        "router",
        "status",
        "t0",
        "tried",
        "uncached",
        "upstream_headers",
        "view",
        "worker",
    )

    def __init__(
        self,
        router: Router,
        view: RequestView,
        path: str,
        rid: str,
        t0: float,
        headers: Mapping[str, str],
        pinned: tuple[Worker, Decision] | None = None,
    ) -> None:
        self.router, self.view, self.path, self.rid, self.t0 = router, view, path, rid, t0
        up = [
            ("Content-Type", headers.get("content-type", "application/json")),
            ("X-Request-ID", rid),
        ]
        auth = headers.get("authorization")
        if auth:
            up.append(("Authorization", auth))
        up.append(("Accept-Encoding", headers.get("accept-encoding", "identity")))
        self.upstream_headers = up
        self.pinned = pinned
        """A worker chosen beforehand (PD's decode): one attempt, there."""
        self.tried: set[str] = set()
        self.attempts = 0
        self.backoff = router.config.retry_initial_backoff_ms / 1000
        self.last_error = "no healthy worker available"
        self.worker: Worker | None = None
        self.decision: Decision | None = None
        self.hit = self.uncached = self.status = 0
        self.open = self.prefilled = False
        self.attempt_t0 = 0.0
        self.learn: Callable[[bytes], bool] | None = None
        """Shown the first bytes of a 200 answer until it returns True (the Responses API's
        response ids: ``Router.handle_responses``); aiohttp data plane only."""

    def next(self) -> Attempt | None:
        """The next attempt: the worker's URL, the headers to send it, and the headers for the
        client (the data plane adds the content type and encoding the worker answers with)."""
        r = self.router
        with r.lock:
            r.settle()  # the decision sees every answer the data plane has had
            if self.pinned is not None:
                if self.attempts:
                    return None
                worker, decision = self.pinned
                hit = 0
            else:
                if self.attempts and self.attempts >= r.config.max_attempts:
                    return None
                workers = r._eligible("regular", self.tried)
                if not workers:
                    return None
                cluster = r._snapshot(self.view, workers)
                decision = r.policy.select(self.view, cluster)
                worker = workers[decision.worker]
                hit = cluster.local_hit_tokens(decision.worker, self.view.prompt_tokens)
                r.decisions[(r.policy.name, decision.reason)] += 1
            self.tried.add(worker.url)
            self.worker, self.decision, self.hit = worker, decision, hit
            self.uncached = uncached = self.view.prompt_tokens - hit
            worker.dispatched(uncached)
            self.open, self.prefilled, self.status = True, False, 0
            self.attempt_t0 = time.perf_counter()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "route rid=%s worker=%s reason=%s hit_tokens=%d attempt=%d",
                self.rid,
                worker.url,
                decision.reason,
                hit,
                self.attempts,
            )
        headers = [("X-Request-ID", self.rid)]
        if r.config.decision_header:
            headers.append(("X-SMetric-Worker", worker.url))
            headers.append(("X-SMetric-Reason", decision.reason))
        return worker.url, self.upstream_headers, headers

    def refusal(self) -> tuple[int, bytes]:
        """The answer when no attempt is left: 503, with the last failure."""
        if self.pinned is None:
            what = "no worker could serve the request"
        elif self.pinned[1].reason == RESPONSE_AFFINITY:
            what = f"the worker holding the previous response ({self.pinned[0].url}) failed"
        else:
            what = "decode worker failed"
        return 503, self.router._refuse(self.view.api, 503, f"{what}: {self.last_error}")

    def failed(self, reason: str) -> float | None:
        r, c = self.router, self.router.config
        with r.lock:
            if not self.open:
                return None
            assert self.worker is not None
            self.worker.record_failure(c.cb_failure_threshold, not c.disable_circuit_breaker)
            self._close()
            self.last_error = reason
            self.attempts += 1
            if self.pinned is not None:
                return None
            r.retries += 1
        log.warning("retry rid=%s worker=%s error=%s", self.rid, self.worker.url, reason)
        if self.attempts >= c.max_attempts:
            return None
        delay = min(self.backoff, c.retry_max_backoff_ms / 1000)
        self.backoff *= c.retry_backoff_multiplier
        return delay

    def answered(self, status: int) -> None:
        """The worker answered with ``status`` (below 500): with 200 it took the request, so
        its hit counts (and ``record`` predicts its cache)."""
        r = self.router
        with r.lock:
            if not self.open:
                return
            self.status = status
            if status == 200:
                r.prefix_hit_tokens += self.hit

    def record(self) -> None:
        """After a 200: the worker will hold the prompt once it has served it, and write it
        through to the global tier; the index learns so (``Router._predict_cache``). Apart
        from the rest because it is the one step whose cost grows with the prompt: the Rust data
        plane runs it once the answer is on its way, or with the booking for a small prompt.
        A prediction that fails (a key conflict in the index) is logged, and the answer
        stands."""
        if self.status == 0:
            self.router.settle()  # the answer's booking may still be queued
        if self.status == 200 and self.worker is not None:
            try:
                self.router._predict_cache(self.worker, self.view)
            except Exception:
                log.exception("index record failed rid=%s worker=%s", self.rid, self.worker.url)

    @property
    def stream(self) -> bool:
        """Whether the client asked for a stream (a worker's error answer comes whole)."""
        return self.view.stream

    def whole(self, status: int, record: bool = False, at: float | None = None) -> None:
        """A whole answer (not streamed) arrived: ``answered``, ``first_token`` and
        ``end("ok")`` at once (and ``record``, if asked: the data plane does so for small
        prompts, whose record costs less than a call of its own)."""
        with self.router.lock:
            self.answered(status)
            self.first_token(False, at)
            self.end("ok", at=at)
        if record:
            self.record()

    def streaming(self, status: int, record: bool = False, at: float | None = None) -> None:
        """A stream's first chunk arrived: ``answered`` and ``first_token`` (and ``record``, if
        asked). A stream of another API than generation may begin before its prefill ends (the
        Responses API's first events): whoever reads its events calls ``first_token``."""
        with self.router.lock:
            self.answered(status)
            if self.view.api in GENERATION_APIS:
                self.first_token(True, at)
        if record:
            self.record()

    def first_token(self, streamed: bool, at: float | None = None) -> None:
        """The first bytes of the answer: the prefill is done. A streamed first chunk is the
        first token, whose time teaches the policy's TTFT correction."""
        r = self.router
        with r.lock:
            if self.prefilled or not self.open:
                return
            w = self.worker
            assert w is not None
            self.prefilled = True
            now = time.perf_counter()
            if at is None:
                mono = time.monotonic()
            else:  # the same moment on the monotonic clock the workers' accounting uses
                mono, now = time.monotonic() - (now - at), at
            w.prefilled(
                self.uncached,
                self.view.prompt_tokens,
                r._prefill_tokens_per_s,
                r._chunk_tokens,
                mono,
            )
            if self.view.api not in GENERATION_APIS:
                return  # no tokens: its first bytes time nothing the model predicts
            r.ttft.observe(now - self.t0)
            observe = getattr(r.policy, "observe", None)
            if observe is not None and streamed and not r.config.pd_disaggregation:
                # This attempt's own TTFT, in the worker's model time (an emulated worker may
                # run faster than real time).
                observe(w.url, self.decision, (now - self.attempt_t0) * w.time_scale)

    def end(
        self, outcome: str, events: int = 0, span_s: float = 0.0, at: float | None = None
    ) -> bytes:
        """The attempt is over: ``ok``, ``client_gone``, or ``broke:<why>`` (the stream broke
        after part of it reached the client: returns the error event that ends it cleanly).
        ``events`` and ``span_s``: the SSE events streamed and the time from first to last."""
        r, c = self.router, self.router.config
        tail = b""
        with r.lock:
            if not self.open:
                return tail
            w = self.worker
            assert w is not None and self.decision is not None
            if outcome == "ok":
                w.record_success(c.cb_success_threshold)
                if self.view.api in GENERATION_APIS:
                    r._observe_tpot(w, self.decision, events, span_s)
            elif outcome.startswith("broke"):
                w.record_failure(c.cb_failure_threshold, not c.disable_circuit_breaker)
                err = {
                    "error": {
                        "message": f"worker stream broke: {outcome[6:]}",
                        "type": "ServerError",
                        "code": 502,
                    }
                }
                tail = b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
            if self.status and outcome != "client_gone":
                r.requests[(self.view.api, self.status)] += 1
            self._close(at)
        if tail:
            log.warning("stream broke rid=%s worker=%s error=%s", self.rid, w.url, outcome[6:])
        elif outcome == "client_gone":
            log.info("client gone rid=%s worker=%s", self.rid, w.url)
        return tail

    def _close(self, at: float | None = None) -> None:
        w, r = self.worker, self.router
        assert w is not None and self.decision is not None
        self.open = False
        w.finished(self.prefilled, self.uncached, self.view.prompt_tokens)
        e2e = (time.perf_counter() if at is None else at) - self.t0
        if self.prefilled or self.status:  # answered (a stream's prefill may not be seen done)
            r.e2e.observe(e2e)
        if log.isEnabledFor(logging.INFO):
            log.info(
                "request rid=%s api=%s worker=%s policy=%s reason=%s prompt_tokens=%d "
                "hit_tokens=%d stream=%s e2e_ms=%.1f",
                self.rid,
                self.view.api,
                w.url,
                r.policy.name,
                self.decision.reason,
                self.view.prompt_tokens,
                self.hit,
                self.view.stream,
                e2e * 1e3,
            )


class PrefillLeg:
    """PD's prefill request, sent beside the decode's (an ``Exchange`` pinned to its decode
    worker) with the same body, bootstrap fields added (``fragment``); its answer is read and
    dropped. Booked at dispatch (``Router._pd_begin``) and by ``done`` once it is over. Both data
    planes drive it: the decode's exchange answers the client, unless the prefill fails before
    the decode has answered (then ``failure``: the decode would wait for KV that never comes)."""

    __slots__ = ("fragment", "headers", "hit", "router", "uncached", "view", "worker")

    def __init__(
        self,
        router: Router,
        worker: Worker,
        view: RequestView,
        hit: int,
        fragment: bytes,
        headers: list[tuple[str, str]],
    ) -> None:
        self.router, self.worker, self.view, self.hit = router, worker, view, hit
        self.fragment = fragment
        self.headers = uncompressed(headers)
        """The decode's, but uncompressed: a failed prefill's answer may go to the client as it
        came (``failure``), and any other is dropped."""
        self.uncached = view.prompt_tokens - hit
        worker.dispatched(self.uncached)

    @property
    def url(self) -> str:
        return self.worker.url

    def done(self, status: int) -> bool:
        """The prefill is over: ``status`` is its answer's, 0 if none came (connection, timeout
        or a broken answer), negative if it was not sent or was given up (neither). Returns
        whether it succeeded (200). A prediction of the cache that fails (a key conflict in the
        index) is logged, and the booking stands (as in ``Exchange.record``)."""
        r, c, w = self.router, self.router.config, self.worker
        try:
            if status == 200:  # outside the lock: the one step whose cost grows with the prompt
                r._predict_cache(w, self.view)
        except Exception:
            log.exception("index record failed (prefill) worker=%s", w.url)
        finally:
            with r.lock:
                if status == 200:
                    r.prefix_hit_tokens += self.hit
                    w.record_success(c.cb_success_threshold)
                elif status == 0 or status >= 500:
                    w.record_failure(c.cb_failure_threshold, not c.disable_circuit_breaker)
                w.finished(False, self.uncached, self.view.prompt_tokens)
        return status == 200

    def failure(self, status: int, body: bytes) -> tuple[int, bytes]:
        """The client's answer (counted) when the prefill failed before the decode answered:
        a 4xx from the prefill worker as it came (the request's own fault, which the decode
        worker would have answered alike), else a 502 naming the worker."""
        r = self.router
        if 400 <= status < 500:
            with r.lock:
                r.requests[(self.view.api, status)] += 1
            return status, body
        return 502, r._refuse(self.view.api, 502, f"prefill worker {self.url} failed")


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        slo = SLOConfig(
            ttft_slo_scale=config.ttft_slo_scale,
            ttft_slo_ms=config.ttft_slo_ms,
            tpot_slo_ms=config.tpot_slo_ms,
            global_tier=config.global_tier,
        )
        pc = PolicyConfig(
            config.cache_threshold,
            config.balance_abs_threshold,
            config.balance_rel_threshold,
            config.seed,
            SMetricConfig(
                config.profile,
                slo,
                config.slo_gate,
                config.migration,
                config.turn_detection,
                config.load_metric,
            ),
        )
        main = config.prefill_policy if config.pd_disaggregation and config.prefill_policy else None
        self.policy: Policy = make_policy(main or config.policy, pc)
        self.decode_policy: Policy = make_policy(config.decode_policy or "least_load", pc)
        # The index follows each worker's cache and, with a global tier, what workers write
        # through to it (every prompt served), with the tier's capacity.
        self.index = PrefixIndex(
            global_capacity_blocks=config.global_tier_blocks if config.global_tier else None
        )
        # Prefill a worker gets through per second (model time, in whole chunks), to count the
        # part of its queue done since its current prefill began (see ``_snapshot``).
        chunk = self._chunk_tokens = slo.chunk_tokens
        self._prefill_tokens_per_s = chunk / load_profile(config.profile).prefill_time_s(chunk)
        self.workers: dict[str, Worker] = {}
        self._registry_changes = 0
        self._rotations: dict[str, tuple[tuple[int, int], float, list[Worker]]] = {}
        """Per role: (the changes it reflects, when an open circuit half-opens, the workers)."""
        self.session: aiohttp.ClientSession | None = None
        self._upstream_timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=config.health_check_timeout_secs,
            sock_read=config.request_timeout_secs,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._legs: set[asyncio.Task[tuple[bool, int, bytes]]] = set()
        """PD prefill legs in flight (aiohttp data plane): each runs to its end, even once the
        decode has answered or its client has gone."""
        self._rooms = random.SystemRandom()  # bootstrap rooms must differ across routers
        self._load_paths: dict[str, str] = {}
        # Request ids where the client sends none: this router's random prefix and a count (32
        # hex digits, as uuid4().hex, without a system call per request).
        self._rid_prefix = os.urandom(8).hex()
        self._rid_count = itertools.count()
        self.lock = threading.RLock()
        """Guards the registry, the workers' accounting and the metrics: the Rust data plane
        calls in from its own threads, and a thread switch may fall between any two lines."""
        # Metrics.
        self.requests = Counter[tuple[str, int]]()
        self.decisions = Counter[tuple[str, str]]()
        self.retries = 0
        self.prompt_tokens = 0
        self.prefix_hit_tokens = 0
        self.ttft = Histogram(Histogram.TTFT_BUCKETS)
        self.e2e = Histogram(Histogram.E2E_BUCKETS)
        self._responses: OrderedDict[str, str] = OrderedDict()
        """Responses API ids, each with the URL of the worker that made it (it alone holds it)."""
        self._booked: Callable[[], list[Booked] | None] | None = None
        """The Rust data plane's queue of booking steps (``DataPlane.booked``), while one runs."""
        self.plane: DataPlane | None = None
        """The Rust data plane serving this router, if one does."""

    def settle(self) -> None:
        """Applies the booking steps the Rust data plane has queued: the answers it has had
        (``whole``, ``streaming``) and the streams that have ended (``end``), in order, at the
        times they happened. The router does so before each decision and before it reports its
        state (``/metrics``, ``/get_loads``, the worker lists), and the data plane within a few
        milliseconds otherwise. Code that reads the router's state in-process, while a Rust
        data plane serves it, calls this first."""
        take = self._booked
        if take is None:
            return
        with self.lock:
            steps = take()
            if not steps:
                return
            for ex, step, a, b, c, at in steps:
                try:
                    if step == "whole":
                        ex.whole(a, b, at)
                    elif step == "streaming":
                        ex.streaming(a, b, at)
                    else:
                        ex.end(a, b, c, at)
                except Exception:  # one step's bug must not cost the others their booking
                    log.exception("booking failed rid=%s step=%s", ex.rid, step)

    # ---- life cycle ----------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_payload_size, middlewares=[self._json_errors]
        )
        r = app.router
        for path in ROUTES:
            r.add_post(path, self.handle_generation)
        for path in OTHER_ROUTES:
            r.add_post(path, self.handle_other)
        r.add_post("/v1/responses", self.handle_responses)
        r.add_get("/v1/responses/{id}", self.handle_response_by_id)
        r.add_delete("/v1/responses/{id}", self.handle_response_by_id)
        r.add_post("/v1/responses/{id}/cancel", self.handle_response_by_id)
        r.add_get("/v1/responses/{id}/input_items", self.handle_response_by_id)
        r.add_get("/health", self.health)
        r.add_get("/liveness", self.health)
        r.add_get("/readiness", self.readiness)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/get_server_info", "/server_info", "/get_model_info", "/model_info"):
            r.add_get(path, self.proxy_get)
        r.add_get("/v1/models", self.proxy_get)
        r.add_get("/get_loads", self.get_loads)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/metrics", self.metrics)
        r.add_get("/engine_metrics", self.engine_metrics)
        r.add_get("/workers", self.list_workers_v2)
        r.add_post("/workers", self.post_worker)
        r.add_delete("/workers/{id}", self.delete_worker)
        r.add_post("/add_worker", self.add_worker_legacy)
        r.add_post("/remove_worker", self.remove_worker_legacy)
        r.add_get("/list_workers", self.list_workers)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        await self.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.stop()

    async def start(self) -> None:
        if self.session is None:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                timeout=aiohttp.ClientTimeout(total=None),
                auto_decompress=False,
                # A proxy keeps no cookies: one client's must not reach another's requests.
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        c = self.config
        initial: list[tuple[str, str, int | None]] = [(u, "regular", None) for u in c.worker_urls]
        initial += [(u, "prefill", port) for u, port in c.prefill]
        initial += [(u, "decode", None) for u in c.decode]
        await asyncio.gather(
            *(
                self.register(u, role, port, c.worker_startup_timeout_secs, strict=False)
                for u, role, port in initial
            )
        )
        loop = asyncio.get_running_loop()
        if not c.disable_health_check:
            self._tasks.append(loop.create_task(self._health_loop()))
        self._tasks.append(loop.create_task(self._load_loop()))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._legs]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.session is not None:
            await self.session.close()
            self.session = None

    # ---- worker registry -----------------------------------------------------------------

    async def _get(self, url: str, path: str, timeout: float) -> tuple[int, Any]:
        assert self.session is not None
        async with self.session.get(
            url + path, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            body = await resp.read()
            try:
                return resp.status, json.loads(body) if body else None
            except ValueError:
                return resp.status, None

    async def _probe(self, url: str) -> bool:
        try:
            status, _ = await self._get(
                url, self.config.health_check_endpoint, self.config.health_check_timeout_secs
            )
            return status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def _info(self, url: str, *paths: str) -> dict[str, Any]:
        for path in paths:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                status, body = await self._get(url, path, self.config.health_check_timeout_secs)
                if status == 200 and isinstance(body, dict):
                    return body
        return {}

    async def register(
        self,
        url: str,
        role: str = "regular",
        bootstrap_port: int | None = None,
        wait_s: float = 0.0,
        strict: bool = True,
    ) -> Worker:
        """Adds a worker as SGLang's router does (``/health``, ``/server_info``, ``/model_info``,
        the older ``get_`` forms as fallback). ``strict``: an unreachable worker is an error;
        otherwise it joins unhealthy and the health checks bring it in."""
        url = url.rstrip("/")
        if url in self.workers:
            raise BadRequest(f"worker {url} is already registered")
        deadline = time.monotonic() + wait_s
        healthy = await self._probe(url)
        while not healthy and time.monotonic() < deadline:
            await asyncio.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
            healthy = await self._probe(url)
        if not healthy and strict:
            raise BadRequest(f"worker {url} is not reachable or not healthy")
        info = await self._info(url, "/server_info", "/get_server_info") if healthy else {}
        model = await self._info(url, "/model_info", "/get_model_info") if healthy else {}
        worker = Worker(url, role, bootstrap_port, healthy=healthy)
        tokens = info.get("max_total_num_tokens")
        worker.max_total_tokens = tokens if isinstance(tokens, int) and tokens > 0 else None
        worker.model = model.get("model_path") if isinstance(model.get("model_path"), str) else None
        emulated = info.get("emulator")
        if isinstance(emulated, dict) and isinstance(emulated.get("time_scale"), int | float):
            worker.time_scale = max(float(emulated["time_scale"]), 1e-6)
        if not healthy and self.config.disable_health_check:
            worker.healthy = True  # nothing would ever bring it in: let the breaker judge it
        if url in self.workers:  # registered by a concurrent call while this one waited
            raise BadRequest(f"worker {url} is already registered")
        self._admit(worker)
        log.info("worker added url=%s role=%s healthy=%s", url, role, healthy)
        return worker

    def _admit(self, worker: Worker) -> None:
        """Puts a worker whose facts are known into rotation and the index."""
        blocks = (worker.max_total_tokens or DEFAULT_WORKER_TOKENS) * BYTES_PER_TOKEN
        with self.lock:
            self.index.add_instance(
                worker.url, min(int(blocks / TEXT_BLOCK_BYTES), self.config.max_tree_size)
            )
            self.workers[worker.url] = worker
            self._registry_changed()

    def _registry_changed(self) -> None:
        for slot, url in enumerate(self.index.instances()):
            self.workers[url].index_slot = slot
        self._registry_changes += 1

    def unregister(self, url: str) -> Worker:
        with self.lock:
            worker = self.workers.pop(url)
            worker.removed = True  # requests in flight finish; nothing new goes there
            self.index.remove_instance(url)
            self._registry_changed()
        log.info("worker removed url=%s in_flight=%d", url, worker.in_flight)
        return worker

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_secs)
            workers = list(self.workers.values())
            results = await asyncio.gather(
                *(self._probe(w.url) for w in workers), return_exceptions=True
            )
            c = self.config
            with self.lock:
                for w, ok in zip(workers, results, strict=True):
                    if ok is True:
                        w.health_failures, w.health_successes = 0, w.health_successes + 1
                        if not w.healthy and w.health_successes >= c.health_success_threshold:
                            w.healthy = True
                            log.info("worker healthy again url=%s", w.url)
                    else:
                        w.health_successes, w.health_failures = 0, w.health_failures + 1
                        if w.healthy and w.health_failures >= c.health_failure_threshold:
                            w.healthy = False
                            log.warning("worker unhealthy url=%s", w.url)

    async def _poll_load(self, w: Worker) -> None:
        timeout = min(self.config.health_check_timeout_secs, 2.0)
        path = self._load_paths.get(w.url, "/v1/loads")
        try:
            status, body = await self._get(w.url, path, timeout)
            if status == 404 and path == "/v1/loads":
                self._load_paths[w.url] = path = "/get_load"
                status, body = await self._get(w.url, path, timeout)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return
        if status != 200:
            return
        try:
            if path == "/v1/loads" and isinstance(body, dict) and body.get("loads"):
                loads = body["loads"]
                running = sum(int(x.get("num_running_reqs") or 0) for x in loads)
                waiting = sum(int(x.get("num_waiting_reqs") or 0) for x in loads)
                usage = max(float(x.get("token_usage") or 0.0) for x in loads)
            elif isinstance(body, list) and body:
                running = sum(int(x.get("num_reqs") or 0) for x in body)
                waiting = sum(int(x.get("num_waiting_reqs") or 0) for x in body)
                usage = w.token_usage
            else:
                return
        except (TypeError, ValueError, AttributeError):
            log.warning("worker %s sent a malformed load report; ignored", w.url)
            return
        with self.lock:
            w.polled_running, w.polled_waiting, w.token_usage = running, waiting, usage

    async def _load_loop(self) -> None:
        while True:
            results = await asyncio.gather(
                *(self._poll_load(w) for w in list(self.workers.values()) if w.healthy),
                return_exceptions=True,
            )
            for r in results:
                if isinstance(r, Exception):  # a bug must not stop the polling
                    log.error("load poll failed: %r", r)
            await asyncio.sleep(self.config.load_poll_interval_secs)

    # ---- the hot path --------------------------------------------------------------------

    def _eligible(self, role: str, exclude: set[str]) -> list[Worker]:
        """The workers of ``role`` in rotation, less ``exclude``. Asked on every request, so the
        answer is kept until a worker's health, circuit or registration changes, or an open
        circuit half-opens; the list is shared, not to be changed by callers."""
        now = time.monotonic()
        changes = (Worker.rotation_changes, self._registry_changes)
        kept = self._rotations.get(role)
        if kept is None or kept[0] != changes or now >= kept[1]:
            cb = self.config.cb_timeout_duration_secs
            workers = [w for w in self.workers.values() if w.role == role]
            half_open = min(
                (t + cb for w in workers if (t := w.opened_at) is not None and t + cb > now),
                default=math.inf,
            )
            kept = (changes, half_open, [w for w in workers if w.eligible(now, cb)])
            self._rotations[role] = kept
        if exclude:
            return [w for w in kept[2] if w.url not in exclude]
        return kept[2]

    def _snapshot(self, view: RequestView, workers: list[Worker]) -> ClusterView:
        match = self.index.match(view.key.keys, touch=False)
        blocks = match.blocks
        now, rate = time.monotonic(), self._prefill_tokens_per_s
        views = []
        for w in workers:
            hit = blocks[w.index_slot]
            # ``Worker.view``'s kept view where it holds as it is (same hit, no queued prefill
            # to age), without the call: this loop runs over every worker on every request.
            v = w._view
            if v is None or v[7] != hit or (v[2] and rate):
                v = w.view(hit, now, rate)
            views.append(v)
        return ClusterView(
            tuple(views),
            match.global_blocks,
            len(view.key.keys),
            view.key.block_tokens,
        )

    def _request_id(self, headers: Mapping[str, str]) -> str:
        for h in self.config.request_id_headers:
            value = headers.get(h)
            if value:
                return value
        return f"{self._rid_prefix}{next(self._rid_count):016x}"

    def _view(
        self,
        api: str,
        raw: bytes,
        headers: Mapping[str, str],
        keyed: KeyedBody | None = None,
        fast_tried: bool = False,
    ) -> RequestView | bytes:
        """The request as the index and the policies see it, or the body of a 400 (counted).
        ``keyed``: what the Rust data plane made of the body (then ``raw`` is not read);
        ``fast_tried``: the data plane tried its fast path and left the body to the reference."""
        if keyed is not None:
            view: RequestView | None = view_keyed(api, keyed, headers)
        else:
            view = None if fast_tried else view_body(api, raw, headers)
        if view is None:  # what the fast path leaves to the reference, errors included
            try:
                view = view_request(api, loads(raw), headers)
            except (ValueError, UnicodeDecodeError, RecursionError):
                return self._refuse(api, 400, "request body is not valid JSON")
            except BadRequest as e:
                return self._refuse(api, 400, str(e))
        with self.lock:
            self.prompt_tokens += view.prompt_tokens
        return view

    def _refuse(self, api: str, status: int, message: str) -> bytes:
        """The JSON body of an error the router answers itself, counted in the metrics."""
        with self.lock:
            self.requests[(api, status)] += 1
        return error_body(status, message)

    async def handle_generation(self, request: web.Request) -> web.StreamResponse:
        """The aiohttp data plane (``--data-plane aiohttp``)."""
        api = ROUTES[request.path]
        rid = self._request_id(request.headers)
        t0 = time.perf_counter()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._count(api, error_json(413, "request body exceeds --max-payload-size"))
        view = self._view(api, raw, request.headers)
        if isinstance(view, bytes):
            return web.Response(body=view, status=400, content_type="application/json")
        if self.config.pd_disaggregation:
            return await self._route_pd(request, raw, view, rid, t0)
        ex = Exchange(self, view, request.path, rid, t0, request.headers)
        return await self._drive(request, raw, ex)

    async def handle_other(self, request: web.Request) -> web.StreamResponse:
        """Embeddings, rerank and classification (``OTHER_ROUTES``): forwarded byte for byte to
        the worker the policy picks. A body that is not a JSON object is refused (400)."""
        api, path = OTHER_ROUTES[request.path]
        rid = self._request_id(request.headers)
        t0 = time.perf_counter()
        read = await self._read_object(request, api)
        if isinstance(read, web.StreamResponse):
            return read
        raw, _ = read
        view = view_unkeyed(api, len(raw))
        return await self._drive(request, raw, Exchange(self, view, path, rid, t0, request.headers))

    async def _read_body(self, request: web.Request, api: str) -> bytes | web.StreamResponse:
        """A body read whole, or a 413 past ``--max-payload-size`` (counted)."""
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._count(api, error_json(413, "request body exceeds --max-payload-size"))

    async def _read_object(
        self, request: web.Request, api: str
    ) -> tuple[bytes, dict[str, Any]] | web.StreamResponse:
        """The body of a request that is forwarded whole (``OTHER_ROUTES``, the Responses API)
        and what it parses to; or the answer (counted): 413 past ``--max-payload-size``, 400 if
        it is not a JSON object, 503 in PD mode (those requests are not served there)."""
        raw = await self._read_body(request, api)
        if not isinstance(raw, bytes):
            return raw
        try:
            body = loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            body = None
        if not isinstance(body, dict):
            message = "request body must be a JSON object"
            return web.Response(
                body=self._refuse(api, 400, message), status=400, content_type="application/json"
            )
        if self.config.pd_disaggregation:
            return self._count(api, error_json(503, f"{request.path} is not served in PD mode"))
        return raw, body

    async def handle_responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API (``POST /v1/responses``), forwarded byte for byte. A worker keeps
        the responses it made, so a request that continues one (``previous_response_id``) goes
        to the worker that made it, if it is still registered (one attempt: no other worker
        holds it); any other is balanced by the policy (``view_unkeyed``). Each answer's id is
        remembered with its worker (``response_id``)."""
        rid = self._request_id(request.headers)
        t0 = time.perf_counter()
        read = await self._read_object(request, "responses")
        if isinstance(read, web.StreamResponse):
            return read
        raw, body = read
        stream = body.get("stream") is True
        view = view_unkeyed("responses", len(raw), stream)
        pinned = None
        previous = body.get("previous_response_id")
        if isinstance(previous, str):
            with self.lock:
                owner = self.workers.get(self._responses.get(previous, ""))
            if owner is not None:
                pinned = (owner, Decision(0, RESPONSE_AFFINITY))
        ex = Exchange(self, view, "/v1/responses", rid, t0, request.headers, pinned)
        # Uncompressed, so that the answer's id can be read (and is passed on as it came).
        ex.upstream_headers = uncompressed(ex.upstream_headers)
        line = bytearray()  # a stream's line not yet whole
        scanned, known, output = 0, False, not stream  # a whole answer's output is its end

        def learn(data: bytes) -> bool:
            nonlocal scanned, known, output
            made = None
            if not stream:
                made = response_id(data, False)
            else:  # each whole line read once
                line.extend(data)
                end = line.rfind(b"\n") + 1
                for event in sse_events(bytes(line[:end])):
                    if made is None and not known:
                        made = event_response_id(event)
                    if not output and event.get("type") not in RESPONSE_WAITING_EVENTS:
                        output = True
                        ex.first_token(True)
                del line[:end]
            scanned += len(data)
            if made is not None and ex.worker is not None:
                known = True
                self._remember_response(made, ex.worker.url)
            return (known and output) or scanned > RESPONSE_ID_SCAN_BYTES

        ex.learn = learn
        return await self._drive(request, raw, ex)

    def _remember_response(self, response: str, url: str) -> None:
        with self.lock:
            self._responses[response] = url
            self._responses.move_to_end(response)
            while len(self._responses) > MAX_RESPONSES:
                self._responses.popitem(last=False)

    async def handle_response_by_id(self, request: web.Request) -> web.StreamResponse:
        """A stored response (get it, its input items, cancel or delete it): to the worker that
        made it, or to any worker where the router does not know it (that worker's 404 then; in
        PD mode, where none is made through the router, a decode worker's).
        A worker that fails part-way leaves the client's connection cut, not the answer looking
        whole."""
        assert self.session is not None
        response = request.match_info["id"]
        with self.lock:
            worker = self.workers.get(self._responses.get(response, ""))
        if worker is None:
            worker = self._any_worker()
        if worker is None:
            return self._count("responses", error_json(503, "no healthy worker"))
        raw = await self._read_body(request, "responses")
        if not isinstance(raw, bytes):
            return raw
        echo = {"X-Request-ID": self._request_id(request.headers)}
        headers = {**echo, "Accept-Encoding": "identity"}
        for name in ("Content-Type", "Authorization"):
            if name in request.headers:
                headers[name] = request.headers[name]
        resp = web.StreamResponse()
        try:
            async with self.session.request(
                request.method,
                worker.url + request.path_qs,
                data=raw or None,
                headers=headers,
                timeout=self._upstream_timeout,
            ) as up:
                if request.method == "DELETE" and up.status == 200:
                    with self.lock:
                        self._responses.pop(response, None)
                resp = web.StreamResponse(status=up.status, headers=echo)
                resp.content_type = up.headers.get("Content-Type", "application/json").split(";")[0]
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            if not resp.prepared:
                return self._count(
                    "responses", error_json(502, f"worker {worker.url} failed: {type(e).__name__}")
                )
            log.warning("response %s from %s broke: %s", response, worker.url, type(e).__name__)
            if request.transport is not None:
                request.transport.close()
        return self._count("responses", resp)

    def _count(self, api: str, resp: web.StreamResponse) -> web.StreamResponse:
        with self.lock:
            self.requests[(api, resp.status)] += 1
        return resp

    # ---- what the rust data plane calls (dataplane.rs) -------------------------------------

    def dp_begin(
        self,
        path: str,
        keyed: KeyedBody | None,
        raw: bytes | None,
        headers: Mapping[str, str],
        read_s: float,
    ) -> (
        tuple[Exchange, Attempt | None, bool]
        | tuple[Exchange, Attempt | None, bool, PrefillLeg]
        | tuple[int, bytes]
    ):
        """A generation request the data plane has read: its exchange with its first attempt
        (``Exchange.next()``) and whether the client asked for a stream, and in PD mode the
        prefill's leg, to send beside it (``PrefillLeg``); or an error to answer (status, JSON
        body).

        The data plane keys the body itself where the fast path can (``keyed``, as
        ``key_request_body`` returns it; ``raw`` is then None); otherwise ``raw`` is the body."""
        t0 = time.perf_counter() - read_s
        # Started by `listen`, the data plane keys every body it can: one it hands over as
        # bytes, its fast path has already left to the reference.
        view = self._view(ROUTES[path], raw or b"", headers, keyed, True)
        if isinstance(view, bytes):
            return 400, view
        rid = self._request_id(headers)
        if self.config.pd_disaggregation:
            begun = self._pd_begin(view, path, rid, t0, headers)
            if not isinstance(begun[0], Exchange):
                return begun
            ex, leg = begun
            try:
                attempt = ex.next()
            except BaseException:
                leg.done(-1)
                raise
            return ex, attempt, view.stream, leg
        ex = Exchange(self, view, path, rid, t0, headers)
        return ex, ex.next(), view.stream

    def dp_error(self, path: str, status: int, message: str) -> bytes:
        """A generation request the data plane refused before reading it whole (413)."""
        return self._refuse(ROUTES[path], status, message)

    # ---- the aiohttp data plane ----------------------------------------------------------

    async def _drive(self, request: web.Request, raw: bytes, ex: Exchange) -> web.StreamResponse:
        try:
            while (target := ex.next()) is not None:
                try:
                    return await self._attempt(request, raw, ex, *target)
                except Retry as e:
                    delay = ex.failed(str(e))
                    if delay:
                        await asyncio.sleep(delay)
            status, body = ex.refusal()
            return web.Response(body=body, status=status, content_type="application/json")
        finally:
            if ex.open:  # cancelled: the client went away (or PD gave up on the decode)
                ex.end("client_gone")

    async def _attempt(
        self,
        request: web.Request,
        raw: bytes,
        ex: Exchange,
        url: str,
        headers: list[tuple[str, str]],
        out_headers: list[tuple[str, str]],
    ) -> web.StreamResponse:
        assert self.session is not None
        sent = False
        resp = web.StreamResponse()
        try:
            async with self.session.post(
                url + ex.path,
                data=raw,
                headers=dict(headers),
                timeout=self._upstream_timeout,
            ) as up:
                if up.status >= 500:
                    raise Retry(f"worker answered {up.status}")
                reply = dict(out_headers)
                if "Content-Encoding" in up.headers:
                    reply["Content-Encoding"] = up.headers["Content-Encoding"]
                ctype = up.headers.get("Content-Type", "application/json").split(";")[0]
                if not (ex.stream and up.status == 200):
                    data = await up.read()
                    if ex.learn is not None and up.status == 200:
                        ex.learn(data)
                    ex.whole(up.status, record=True)
                    return web.Response(
                        body=data, status=up.status, headers=reply, content_type=ctype
                    )
                resp = web.StreamResponse(status=up.status, headers=reply)
                resp.content_type = ctype
                # SSE events seen and when the first and last came, for the TPOT correction.
                events, t_first, t_last = 0, 0.0, 0.0
                async for chunk in up.content.iter_any():
                    if ex.learn is not None and ex.learn(chunk):
                        ex.learn = None
                    if not sent:
                        # Booked before the head goes out (PD: from here the stream is the
                        # answer, whatever the prefill does).
                        sent = True
                        ex.streaming(up.status, record=True)
                        await _downstream(resp.prepare(request))
                    n = chunk.count(b"data: {")
                    if n:
                        t_last = time.perf_counter()
                        if not events:
                            t_first = t_last
                        events += n
                    await _downstream(resp.write(chunk))
                if not sent:  # an empty stream, booked before its head goes out
                    sent = True
                    ex.whole(up.status, record=True)
                    await _downstream(resp.prepare(request))
                ex.end("ok", events, t_last - t_first)
                await _downstream(resp.write_eof())
                return resp
        except ClientGone:
            ex.end("client_gone")
            return resp
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            if not sent:
                raise Retry(f"{type(e).__name__}: {e}") from e
            # Part of the stream reached the client: end it with a clean error event, where
            # the API has one (generation's SSE); elsewhere cut it, so it cannot look whole.
            tail = ex.end(f"broke:{type(e).__name__}")
            if ex.view.api not in GENERATION_APIS:
                if request.transport is not None:
                    request.transport.close()
                return resp
            with contextlib.suppress(Exception):
                await resp.write(tail)
                await resp.write_eof()
            return resp

    def _predict_cache(self, worker: Worker, view: RequestView) -> None:
        """The worker took the request: it will hold the prompt once it has served it, and
        write it through to the global tier."""
        try:  # noqa: SIM105 (on every request: suppress() builds a context manager each time)
            self.index.insert(worker.url, view.key.keys, step=RECORD_STEP_BLOCKS)
        except KeyError:  # the worker was removed meanwhile
            pass
        if self.config.global_tier:
            self.index.insert(GLOBAL_TIER, view.key.keys, step=RECORD_STEP_BLOCKS)

    def _observe_tpot(self, worker: Worker, decision: Decision, events: int, span_s: float) -> None:
        """A stream's mean time between tokens, reported to the policy. The first event is the
        first token; the last ones may carry only the finish reason or usage, which makes the
        mean a little short, hence only streams of ``MIN_TPOT_EVENTS`` or more count."""
        observe = getattr(self.policy, "observe_tpot", None)
        if observe is None or events < MIN_TPOT_EVENTS or self.config.pd_disaggregation:
            return
        observe(worker.url, decision, span_s / (events - 1) * worker.time_scale)

    # ---- PD ------------------------------------------------------------------------------

    def _pd_begin(
        self, view: RequestView, path: str, rid: str, t0: float, headers: Mapping[str, str]
    ) -> tuple[Exchange, PrefillLeg] | tuple[int, bytes]:
        """A PD request's two workers: the policy picks the prefill worker, the decode policy
        the decode worker. Returns the decode's exchange (pinned: ``next`` dispatches it) and
        the prefill's leg (dispatched), or the 503 to answer when either pool has no healthy
        worker. Both data planes begin a PD request here."""
        with self.lock:
            self.settle()
            prefills, decodes = self._eligible("prefill", set()), self._eligible("decode", set())
            if not prefills or not decodes:
                message = "PD mode needs a healthy prefill and decode worker"
                return 503, self._refuse(view.api, 503, message)
            p_cluster = self._snapshot(view, prefills)
            p_decision = self.policy.select(view, p_cluster)
            d_decision = self.decode_policy.select(view, self._snapshot(view, decodes))
            prefill, decode = prefills[p_decision.worker], decodes[d_decision.worker]
            self.decisions[(self.policy.name, p_decision.reason)] += 1
            fragment = json.dumps(
                {
                    "bootstrap_host": urlparse(prefill.url).hostname or "127.0.0.1",
                    "bootstrap_port": prefill.bootstrap_port,
                    "bootstrap_room": self._rooms.getrandbits(63),
                }
            )[1:-1].encode()
            hit = p_cluster.local_hit_tokens(p_decision.worker, view.prompt_tokens)
            ex = Exchange(self, view, path, rid, t0, headers, (decode, d_decision))
            leg = PrefillLeg(self, prefill, view, hit, fragment, ex.upstream_headers)
        return ex, leg

    async def _route_pd(
        self, request: web.Request, raw: bytes, view: RequestView, rid: str, t0: float
    ) -> web.StreamResponse:
        """The aiohttp data plane's PD request: prefill and decode at once (``_pd_begin``). The
        prefill's leg runs to its end (an answer, a failure, or the read timeout) whatever the
        decode does: its worker is busy until then, and a success teaches the index."""
        begun = self._pd_begin(view, request.path, rid, t0, request.headers)
        if not isinstance(begun[0], Exchange):
            status, refusal = begun
            return web.Response(body=refusal, status=status, content_type="application/json")
        ex, leg = begun
        body = inject_members(raw, leg.fragment)
        if body is None:  # not reached: a request that has a view is a JSON object
            leg.done(-1)
            return self._count(view.api, error_json(400, "request body must be a JSON object"))

        async def run_prefill() -> tuple[bool, int, bytes]:
            status, data = -1, b""  # cancelled (the router stopped): neither
            try:
                assert self.session is not None
                async with self.session.post(
                    leg.url + request.path,
                    data=body,
                    headers=dict(leg.headers),
                    timeout=self._upstream_timeout,
                ) as up:
                    data = await up.read()
                    status = up.status
            except (TimeoutError, aiohttp.ClientError, OSError):
                status = 0
            finally:
                ok = leg.done(status)
            return ok, status, data

        loop = asyncio.get_running_loop()
        prefill = loop.create_task(run_prefill())
        self._legs.add(prefill)
        prefill.add_done_callback(self._legs.discard)
        decode = loop.create_task(self._drive(request, body, ex))
        try:
            await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            if not decode.done() and not ex.status and not prefill.result()[0]:
                # The decode worker has not answered and would wait for KV that never comes:
                # stop it (below), and do not count its timeout against it. (One that has
                # begun to stream goes on: its answer stands.)
                status, failure = leg.failure(*prefill.result()[1:])
                return web.Response(body=failure, status=status, content_type="application/json")
            return await decode
        finally:
            if not decode.done():  # the prefill failed first, or the client went away
                decode.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await decode

    # ---- the router's own endpoints ------------------------------------------------------

    @web.middleware
    async def _json_errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except web.HTTPNotFound:
            return error_json(404, f"no route {request.method} {request.path}")
        except web.HTTPMethodNotAllowed:
            return error_json(
                405, f"method {request.method} not allowed on {request.path}", "MethodNotAllowed"
            )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readiness(self, request: web.Request) -> web.Response:
        roles = ("prefill", "decode") if self.config.pd_disaggregation else ("regular",)
        ready = all(self._eligible(role, set()) for role in roles)
        return web.json_response(
            {
                "status": "ready" if ready else "not ready",
                "healthy_workers": sum(w.healthy for w in self.workers.values()),
            },
            status=200 if ready else 503,
        )

    def _any_worker(self) -> Worker | None:
        role = "decode" if self.config.pd_disaggregation else "regular"
        workers = self._eligible(role, set())
        return workers[0] if workers else None

    async def _ask_any_worker(self, path: str) -> tuple[int, Any] | web.Response:
        """GETs ``path`` from an eligible worker; an error response if none answers."""
        worker = self._any_worker()
        if worker is None:
            return error_json(503, "no healthy worker")
        try:
            return await self._get(worker.url, path, self.config.health_check_timeout_secs)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            return error_json(503, f"worker {worker.url} failed: {type(e).__name__}")

    async def health_generate(self, request: web.Request) -> web.Response:
        answer = await self._ask_any_worker("/health_generate")
        if isinstance(answer, web.Response):
            return answer
        return web.Response(status=200 if answer[0] == 200 else 503)

    async def proxy_get(self, request: web.Request) -> web.Response:
        answer = await self._ask_any_worker(request.path)
        if isinstance(answer, web.Response):
            return answer
        status, body = answer
        return web.json_response(body, status=status)

    async def get_loads(self, request: web.Request) -> web.Response:
        self.settle()
        return web.json_response(
            {
                "workers": [
                    {
                        "worker": w.url,
                        "load": w.in_flight,
                        "queued_prefill_tokens": w.queued_prefill_tokens,
                        "running_decode_tokens": w.running_decode_tokens,
                        "polled_running": w.polled_running,
                        "polled_waiting": w.polled_waiting,
                        "healthy": w.healthy,
                    }
                    for w in self.workers.values()
                ]
            }
        )

    async def engine_metrics(self, request: web.Request) -> web.Response:
        """Every healthy worker's ``/metrics`` in one exposition, each sample labelled with its
        worker (``merge_worker_metrics``, as sglang-router's ``/engine_metrics``); a worker that
        does not answer in the health check's timeout is left out, and logged."""
        assert self.session is not None
        session, timeout = self.session, self.config.health_check_timeout_secs

        async def scrape(url: str) -> tuple[str, str] | None:
            try:
                async with session.get(
                    url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)
                ) as r:
                    if r.status == 200:
                        return url, await r.text()
                    log.warning("worker %s answered /metrics with %d", url, r.status)
            except (TimeoutError, aiohttp.ClientError, OSError, UnicodeDecodeError) as e:
                log.warning("worker %s /metrics failed: %s", url, type(e).__name__)
            return None

        urls = [w.url for w in list(self.workers.values()) if w.healthy]
        if not urls:
            return error_json(503, "no healthy worker")
        answers = [a for a in await asyncio.gather(*map(scrape, urls)) if a is not None]
        if not answers:
            return error_json(503, "no worker answered /metrics")
        return web.Response(text=merge_worker_metrics(answers), content_type="text/plain")

    async def metrics(self, request: web.Request) -> web.Response:
        with self.lock:
            text = self._metrics_text()
        return web.Response(text=text, content_type="text/plain")

    def _metrics_text(self) -> str:
        self.settle()
        fam: dict[str, tuple[str, dict[tuple[tuple[str, str], ...], float]]] = {
            "requests_total": (
                "counter",
                {
                    (("route", api), ("status", str(status))): n
                    for (api, status), n in self.requests.items()
                },
            ),
            "routing_decisions_total": (
                "counter",
                {(("policy", p), ("reason", r)): n for (p, r), n in self.decisions.items()},
            ),
            "retries_total": ("counter", {(): self.retries}),
            "prompt_tokens_total": ("counter", {(): self.prompt_tokens}),
            "prefix_hit_tokens_total": ("counter", {(): self.prefix_hit_tokens}),
            "worker_in_flight": (
                "gauge",
                {(("worker", w.url),): w.in_flight for w in self.workers.values()},
            ),
            "worker_queued_prefill_tokens": (
                "gauge",
                {(("worker", w.url),): w.queued_prefill_tokens for w in self.workers.values()},
            ),
            "worker_running_decode_tokens": (
                "gauge",
                {(("worker", w.url),): w.running_decode_tokens for w in self.workers.values()},
            ),
            "worker_healthy": (
                "gauge",
                {(("worker", w.url),): int(w.healthy) for w in self.workers.values()},
            ),
            "worker_errors_total": (
                "counter",
                {(("worker", w.url),): w.errors_total for w in self.workers.values()},
            ),
        }
        if self.plane is not None:
            # Requests that arrive together are decided in one turn (one entry into Python).
            turns, decided = self.plane.turns
            fam["decision_turns_total"] = ("counter", {(): turns})
            fam["decided_requests_total"] = ("counter", {(): decided})
        return render_families(
            "smetric_",
            fam,
            {"time_to_first_token_seconds": self.ttft, "e2e_request_latency_seconds": self.e2e},
        )

    # ---- admin ---------------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        key = self.config.api_key
        return key is None or request.headers.get("Authorization") == f"Bearer {key}"

    async def flush_cache(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return error_json(401, "missing or wrong API key")
        assert self.session is not None
        self.settle()  # small prompts already served are recorded before the index forgets them
        failed = []
        for w in list(self.workers.values()):
            try:
                async with self.session.post(
                    w.url + "/flush_cache",
                    timeout=aiohttp.ClientTimeout(total=self.config.health_check_timeout_secs),
                ) as r:
                    await r.read()
                    if r.status != 200:
                        failed.append(w.url)
            except (TimeoutError, aiohttp.ClientError, OSError):
                failed.append(w.url)
            with contextlib.suppress(KeyError):
                self.index.clear(w.url)
        if failed:
            return web.json_response({"status": "partial", "failed": failed}, status=500)
        return web.json_response({"status": "ok", "workers": len(self.workers)})

    async def _add(self, url: Any, role: Any = "regular", port: Any = None) -> web.Response:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            return error_json(400, "url must be an http(s) URL")
        if role not in ("regular", "prefill", "decode"):
            return error_json(400, "worker_type must be regular, prefill or decode")
        if port is not None and (type(port) is not int or not 0 < port < 65536):
            return error_json(400, "bootstrap_port must be a port number")
        try:
            worker = await self.register(url, role, port)
        except BadRequest as e:
            return error_json(400, str(e))
        return web.json_response({"status": "ok", **worker.describe()})

    async def post_worker(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return error_json(401, "missing or wrong API key")
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return error_json(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return error_json(400, "request body must be a JSON object")
        return await self._add(
            body.get("url"), body.get("worker_type", "regular"), body.get("bootstrap_port")
        )

    async def add_worker_legacy(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return error_json(401, "missing or wrong API key")
        return await self._add(request.query.get("url"))

    def _find(self, ident: str) -> Worker | None:
        ident = unquote(ident).rstrip("/")
        for w in self.workers.values():
            if ident in (w.id, w.url):
                return w
        return None

    def _remove(self, request: web.Request, ident: str) -> web.Response:
        if not self._authorized(request):
            return error_json(401, "missing or wrong API key")
        worker = self._find(ident)
        if worker is None:
            return error_json(404, f"unknown worker {ident}")
        self.unregister(worker.url)
        return web.json_response({"status": "ok", "removed": worker.url})

    async def delete_worker(self, request: web.Request) -> web.Response:
        return self._remove(request, request.match_info["id"])

    async def remove_worker_legacy(self, request: web.Request) -> web.Response:
        return self._remove(request, request.query.get("url", ""))

    async def list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"urls": list(self.workers)})

    async def list_workers_v2(self, request: web.Request) -> web.Response:
        self.settle()  # the descriptions carry the load
        return web.json_response(
            {"workers": [w.describe() for w in self.workers.values()], "total": len(self.workers)}
        )


class Listening:
    """A router serving on a port: the aiohttp application, and the Rust data plane in front of
    it unless the configuration says ``aiohttp``."""

    def __init__(
        self, router: Router, runner: web.AppRunner, plane: DataPlane | None, port: int
    ) -> None:
        self.router, self.runner, self.plane, self.port = router, runner, plane, port

    async def close(self, grace_s: float = 0.0) -> None:
        """Stops serving. With ``grace_s``, the Rust data plane first stops accepting and lets
        the requests in progress finish for up to that long (from a thread, so that the
        application keeps serving what the data plane passes it meanwhile)."""
        if self.plane is not None:
            left = await asyncio.to_thread(self.plane.stop, grace_s)
            if left:
                log.warning("stopped with %d client connections still open", left)
            self.router.settle()  # what stopping ended, and what was still queued
            self.router._booked, self.router.plane = None, None
        await self.runner.cleanup()


async def listen(router: Router, host: str, port: int) -> Listening:
    """Starts ``router`` (registering its workers) and serves it on ``host:port`` (0: any)."""
    config = router.config
    runner = web.AppRunner(router.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    if config.data_plane != "rust":
        await web.TCPSite(runner, host, port).start()
        return Listening(router, runner, None, runner.addresses[-1][1])
    # The aiohttp application serves, on a private loopback port, what the data plane passes
    # on: every route but generation.
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    plane = DataPlane(
        router,
        f"http://127.0.0.1:{runner.addresses[-1][1]}",
        config.max_payload_size,
        config.request_timeout_secs,
        config.health_check_timeout_secs,
        config.data_plane_threads,
        keying=(TEXT_BLOCK_BYTES, TOKEN_BLOCK_TOKENS),
    )
    router._booked = plane.booked  # before the first answer can be queued
    router.plane = plane
    try:
        port = plane.start(host, port)
    except OSError:
        router._booked, router.plane = None, None
        await runner.cleanup()
        raise
    return Listening(router, runner, plane, port)


OPEN_FILES_TARGET = 65536
"""The open-files limit the router asks for at start (each request in flight holds two sockets,
the client's and the worker's), as SGLang's own server does for itself."""


def raise_open_files_limit(target: int = OPEN_FILES_TARGET) -> tuple[int, int]:
    """Raises this process's soft limit on open files towards ``target``, never above the hard
    limit and never lowering it; returns the soft limit before and after. Under the common
    default of 1,024, a few hundred requests in flight would use them up. Where the system
    refuses a value (macOS caps it below an unlimited hard limit), it is halved until one is
    accepted or it is no higher than the soft limit."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise
        return 0, 0

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft, soft
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    while want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            want //= 2
            continue
        log.info("open-files limit raised from %d to %d", soft, want)
        return soft, want
    if soft < min(target, hard):
        log.warning("cannot raise the open-files limit from %d towards %d", soft, target)
    return soft, soft


async def serve(config: RouterConfig) -> None:
    raise_open_files_limit()
    router = Router(config)
    server = await listen(router, config.host, config.port)
    extra = None
    if config.prometheus_port:
        metrics_app = web.Application()
        metrics_app.router.add_get("/metrics", router.metrics)
        extra = web.AppRunner(metrics_app, access_log=None)
        await extra.setup()
        await web.TCPSite(extra, config.prometheus_host, config.prometheus_port).start()
    log.info(
        "smetric router listening on http://%s:%d policy=%s workers=%d data_plane=%s",
        config.host,
        server.port,
        router.policy.name,
        len(router.workers),
        config.data_plane,
    )
    print(
        f"smetric router listening on http://{config.host}:{server.port} "
        f"(policy {router.policy.name}, {len(router.workers)} workers, "
        f"{config.data_plane} data plane)",
        flush=True,
    )
    # What exists now (modules, the router, its workers) lives as long as the process: out of
    # the collector's sight, the collections that requests' short-lived objects set off no
    # longer walk it again and again.
    gc.freeze()
    try:
        await until_stopped()
    finally:
        if extra is not None:
            await extra.cleanup()
        await server.close(config.shutdown_grace_secs)
