"""Replaying workloads against any SGLang-compatible endpoint (our router, sglang-router, a
worker) and measuring what the client sees.

* Agent sessions: each session's turns in order, the next turn sent after the previous answer plus
  its recorded tool time (or a think time: fixed, or sampled from a seeded distribution), as
  streaming ``/v1/chat/completions`` with the session's tools.
* Hash-id traces (Mooncake: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of
  512-token blocks): each row at its timestamp, as a streaming ``/v1/completions`` whose prompt is
  one deterministic text block per hash id, so rows sharing ids share their prompt's prefix.
  ``/v1/completions`` rather than SGLang's ``/generate``: every endpoint here serves it (SGLang,
  sglang-router, our router, vLLM) and its usage reports cached prompt tokens (SGLang does with
  ``--enable-cache-report``).

Times are model seconds: with ``time_scale`` T (an emulator running T times faster than real
time) waits are divided by T and measured latencies multiplied by it. A load ``scale`` F makes
arrivals F times faster (session start gaps, think times and trace timestamps divided by F), as in
the simulator's sweep.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import IO, Any

import aiohttp

from smetric.request import BYTES_PER_TOKEN, TEXT_BLOCK_BYTES, chat_prompt_text, text_prompt_tokens
from smetric.slo import SLOModel
from smetric.workload.agents import Session, output_tokens
from smetric.workload.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRow
from smetric.workload.sweep import percentile


@dataclass(frozen=True)
class TurnResult:
    session: str
    turn: int
    ok: bool
    ttft_s: float
    tpot_s: float | None
    e2e_s: float
    prompt_tokens: int
    """As the server reported it; the client's estimate (3.4 bytes a token) where it did not."""
    output_tokens: int
    cached_tokens: int
    worker: str | None
    reason: str | None
    error: str | None = None
    start_s: float = 0.0
    """When the request was sent, since the replay started."""


# ---- think times --------------------------------------------------------------------------

THINK_MEDIAN_S = 0.27
THINK_P90_S = 1.14
THINK_MAX_S = 64.0
"""Tool time between agent turns where a trace has none: log-normal with the median and P90 seen
in real agent runs (mini-swe-agent, shared traces README), capped at the longest seen."""
_Z90 = 1.2815515655446004  # the standard normal's 90th percentile


def sampled_think_s(seed: int, session_id: str, turn: int) -> float:
    """A think time drawn from its own seeded generator, so it depends on the seed, session and
    turn only, not on the order in which concurrent sessions ask."""
    rng = random.Random(f"{seed}/{session_id}/{turn}")
    sigma = math.log(THINK_P90_S / THINK_MEDIAN_S) / _Z90
    return min(rng.lognormvariate(math.log(THINK_MEDIAN_S), sigma), THINK_MAX_S)


# ---- hash-id traces -----------------------------------------------------------------------

HASH_BLOCK_TOKENS = MOONCAKE_BLOCK_TOKENS
"""Tokens one Mooncake hash id stands for."""
HASH_BLOCK_BYTES = round(HASH_BLOCK_TOKENS * BYTES_PER_TOKEN / TEXT_BLOCK_BYTES) * TEXT_BLOCK_BYTES
"""Bytes of text one hash id becomes: ~512 tokens at 3.4 bytes a token, rounded to whole key
blocks so that a shared id shares whole key blocks (1728 bytes, ~509 tokens)."""

_VOCABULARY = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "more can out up into do time only other new some could these two may first then any like "
    "over such our man me even most made after also did many before must through back years where"
)
_WORDS = _VOCABULARY.split()


@functools.lru_cache(maxsize=1 << 16)
def block_text(hash_id: int) -> str:
    """The text a hash id stands for: ``HASH_BLOCK_BYTES`` of ASCII words, a function of the id
    alone, and led by the id so that no two ids share even their first key block."""
    rng = random.Random(hash_id)
    parts = [f"[{hash_id}]"]
    size = len(parts[0])
    while size < HASH_BLOCK_BYTES:
        word = rng.choice(_WORDS)
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[:HASH_BLOCK_BYTES]


def trace_prompt(row: TraceRow) -> str:
    """Full blocks for all ids but the last; the last cut to the input's remaining tokens."""
    *full, last = row.hash_ids
    tail_tokens = row.input_length - HASH_BLOCK_TOKENS * len(full)
    tail_bytes = max(1, round(tail_tokens * HASH_BLOCK_BYTES / HASH_BLOCK_TOKENS))
    return "".join(block_text(i) for i in full) + block_text(last)[:tail_bytes]


# ---- one request --------------------------------------------------------------------------


def _token_chunk(data: dict[str, Any]) -> bool:
    choices = data.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    if "delta" in choice:
        delta = choice.get("delta") or {}
        # Tool calls and reasoning are output tokens too (agents answer mostly in calls).
        return any(delta.get(k) for k in ("content", "tool_calls", "reasoning_content"))
    return bool(choice.get("text"))


async def _post(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    session_id: str,
    turn: int,
    time_scale: float,
    origin: float,
    prompt_estimate: int,
) -> TurnResult:
    t0 = time.perf_counter()
    start_s = (t0 - origin) * time_scale
    first = last = None
    chunks = 0
    usage: dict[str, Any] = {}
    worker = reason = None

    def failed(error: str) -> TurnResult:
        return TurnResult(
            session_id,
            turn,
            False,
            ttft_s=0.0,
            tpot_s=None,
            e2e_s=0.0,
            prompt_tokens=prompt_estimate,
            output_tokens=0,
            cached_tokens=0,
            worker=worker,
            reason=reason,
            error=error,
            start_s=start_s,
        )

    try:
        async with http.post(url, json=body) as r:
            worker, reason = r.headers.get("X-SMetric-Worker"), r.headers.get("X-SMetric-Reason")
            if r.status != 200:
                return failed(f"HTTP {r.status}: {(await r.text())[:200]}")
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                data = json.loads(line[6:])
                if data.get("error"):
                    raise RuntimeError(str(data["error"]))
                if data.get("usage"):
                    usage = data["usage"]
                if _token_chunk(data):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
    except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as e:
        return failed(repr(e))
    end = time.perf_counter()
    first = first or end
    details = usage.get("prompt_tokens_details") or {}
    generated = int(usage.get("completion_tokens", chunks))
    # Servers may put several tokens in one chunk: spread the time over the tokens, not chunks.
    tpot = (last - first) / (generated - 1) * time_scale if last and generated > 1 else None
    return TurnResult(
        session_id,
        turn,
        True,
        (first - t0) * time_scale,
        tpot,
        (end - t0) * time_scale,
        int(usage.get("prompt_tokens") or prompt_estimate),
        generated,
        int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0,
        worker,
        reason,
        None,
        start_s,
    )


def _client() -> aiohttp.ClientSession:
    # No total deadline (an overloaded server may take long), but a stream silent for 10 minutes
    # is an error.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)


# ---- replays ------------------------------------------------------------------------------


async def replay_sessions(
    url: str,
    sessions: Sequence[Session],
    start_gap_s: float = 1.0,
    think_s: float = 1.0,
    time_scale: float = 1.0,
    *,
    scale: float = 1.0,
    seed: int | None = None,
    model: str = "default",
    on_result: Callable[[TurnResult], None] | None = None,
) -> list[TurnResult]:
    """Session i starts at ``i * start_gap_s``; a turn follows the previous answer after the
    recorded tool time, else ``think_s``, or with a ``seed`` a sampled think time
    (``sampled_think_s``). All waits are divided by ``scale`` (load) and ``time_scale``."""
    results: list[TurnResult] = []
    pace = scale * time_scale
    async with _client() as http:
        origin = time.perf_counter()

        async def run(i: int, s: Session) -> None:
            await asyncio.sleep(i * start_gap_s / pace)
            for k, turn in enumerate(s.turns):
                if k:
                    wait = turn.tool_time_s
                    if wait is None:
                        wait = think_s if seed is None else sampled_think_s(seed, s.session_id, k)
                    await asyncio.sleep(wait / pace)
                body = {
                    "model": model,
                    "messages": turn.messages,
                    "tools": s.tools,
                    "max_tokens": output_tokens(turn),
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                estimate = text_prompt_tokens(len(chat_prompt_text(turn.messages, s.tools)))
                result = await _post(
                    http,
                    url + "/v1/chat/completions",
                    body,
                    s.session_id,
                    k,
                    time_scale,
                    origin,
                    estimate,
                )
                results.append(result)
                if on_result:
                    on_result(result)

        await asyncio.gather(*(run(i, s) for i, s in enumerate(sessions)))
    return results


async def replay_trace(
    url: str,
    rows: Sequence[TraceRow],
    *,
    scale: float = 1.0,
    time_scale: float = 1.0,
    model: str = "default",
    on_result: Callable[[TurnResult], None] | None = None,
) -> list[TurnResult]:
    """Row i is sent at its timestamp (from the first row's) divided by ``scale`` and
    ``time_scale``, as a streaming ``/v1/completions`` of ``output_length`` tokens (``ignore_eos``
    so that a real model generates them all); its result is named ``r<i>``, turn 0."""
    results: list[TurnResult] = []
    t_first = min((r.timestamp_s for r in rows), default=0.0)
    async with _client() as http:
        origin = time.perf_counter()

        async def run(i: int, row: TraceRow) -> None:
            delay = (row.timestamp_s - t_first) / (scale * time_scale)
            await asyncio.sleep(max(0.0, origin + delay - time.perf_counter()))
            body = {
                "model": model,
                "prompt": trace_prompt(row),
                "max_tokens": max(row.output_length, 1),
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            result = await _post(
                http,
                url + "/v1/completions",
                body,
                f"r{i}",
                0,
                time_scale,
                origin,
                row.input_length,
            )
            results.append(result)
            if on_result:
                on_result(result)

        await asyncio.gather(*(run(i, r) for i, r in enumerate(rows)))
    return results


async def check_reachable(url: str, timeout_s: float = 5.0) -> None:
    """Raises ``ConnectionError`` unless something answers HTTP at ``url`` (any status)."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http,
            http.get(url + "/health") as r,
        ):
            await r.read()
    except (TimeoutError, aiohttp.ClientError) as e:
        raise ConnectionError(f"nothing answers at {url} ({e!r})") from e


# ---- progress, results, summary -----------------------------------------------------------


class Progress:
    """A plain progress bar on stderr: redrawn in place on a terminal, else a line every 10%."""

    def __init__(self, total: int, stream: IO[str] | None = None, width: int = 30) -> None:
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.done = 0
        self.errors = 0
        self.t0 = time.perf_counter()
        self._drawn_at = 0.0
        self._tty = self.stream.isatty()
        self._tenths = 0

    def __call__(self, result: TurnResult) -> None:
        self.done += 1
        self.errors += not result.ok
        now = time.perf_counter()
        finished = self.done >= self.total
        if self._tty:
            if finished or now - self._drawn_at >= 0.2:
                self._drawn_at = now
                self.stream.write("\r" + self.line() + ("\n" if finished else ""))
                self.stream.flush()
        elif finished or self.done * 10 // self.total > self._tenths:
            self._tenths = self.done * 10 // self.total
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def line(self) -> str:
        filled = self.width * self.done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        return (
            f"[{bar}] {self.done}/{self.total} requests, {self.errors} errors, "
            f"{time.perf_counter() - self.t0:.1f} s"
        )


def result_row(r: TurnResult, slo: SLOModel) -> dict[str, Any]:
    """A result as written to JSONL, with the request's SLOs and whether it met them."""
    ttft_slo = slo.ttft_slo_s(r.prompt_tokens)
    return {
        **asdict(r),
        "ttft_slo_s": ttft_slo,
        "tpot_slo_s": slo.tpot_slo_s,
        "met_slo": r.ok and r.ttft_s <= ttft_slo and (r.tpot_s or 0.0) <= slo.tpot_slo_s,
    }


def summarize(results: Sequence[TurnResult], slo: SLOModel) -> dict[str, Any]:
    """SPEC §4 over a replay: TPS = prompt + output tokens of the answered requests over the
    window from the first send to the last answer; attainment over all requests (a failed one
    meets no SLO); percentiles over the answered ones."""
    ok = [r for r in results if r.ok]
    n = max(len(results), 1)
    ttft_met = [r.ttft_s <= slo.ttft_slo_s(r.prompt_tokens) for r in ok]
    tpot_met = [(r.tpot_s or 0.0) <= slo.tpot_slo_s for r in ok]
    window = max(r.start_s + r.e2e_s for r in ok) - min(r.start_s for r in ok) if ok else 0.0
    ttfts = [r.ttft_s for r in ok]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)

    def ms(values: list[float], q: float) -> float | None:
        v = percentile(values, q)
        return 1e3 * v if math.isfinite(v) else None

    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "window_s": window,
        "tps": sum(r.prompt_tokens + r.output_tokens for r in ok) / window if window else 0.0,
        "ttft_p50_ms": ms(ttfts, 0.5),
        "ttft_p90_ms": ms(ttfts, 0.9),
        "ttft_p99_ms": ms(ttfts, 0.99),
        "tpot_p50_ms": ms(tpots, 0.5),
        "tpot_p90_ms": ms(tpots, 0.9),
        "tpot_p99_ms": ms(tpots, 0.99),
        "ttft_attainment": sum(ttft_met) / n,
        "tpot_attainment": sum(tpot_met) / n,
        "slo_attainment": sum(a and b for a, b in zip(ttft_met, tpot_met, strict=True)) / n,
        "cache_hit": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "workers": dict(Counter(r.worker for r in ok if r.worker)),
        "reasons": dict(Counter(r.reason for r in ok if r.reason)),
    }


def format_summary(s: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        return "-" if s[key] is None else f"{s[key]:.1f}"

    lines = [
        f"requests {s['requests']}, errors {s['errors']}, window {s['window_s']:.1f} s",
        f"TPS {s['tps']:.0f} (prompt + output tokens / s)",
        f"TTFT ms  P50 {ms('ttft_p50_ms')}  P90 {ms('ttft_p90_ms')}  P99 {ms('ttft_p99_ms')}",
        f"TPOT ms  P50 {ms('tpot_p50_ms')}  P90 {ms('tpot_p90_ms')}  P99 {ms('tpot_p99_ms')}",
        f"SLO attainment {s['slo_attainment']:.1%} (TTFT {s['ttft_attainment']:.1%}, "
        f"TPOT {s['tpot_attainment']:.1%})",
        f"cache hit {s['cache_hit']:.1%} of prompt tokens",
    ]
    if s["workers"]:
        lines.append(
            "per worker: " + ", ".join(f"{w} {c}" for w, c in sorted(s["workers"].items()))
        )
    if s["reasons"]:
        lines.append("decisions: " + ", ".join(f"{k} {c}" for k, c in sorted(s["reasons"].items())))
    return "\n".join(lines)


async def replay_to_file(
    url: str,
    workload: Sequence[Session] | Sequence[TraceRow],
    out: IO[str],
    slo: SLOModel,
    *,
    scale: float = 1.0,
    time_scale: float = 1.0,
    seed: int = 0,
    start_gap_s: float = 2.0,
    model: str = "default",
    progress: IO[str] | None = None,
) -> dict[str, Any]:
    """Replays sessions or trace rows, writing each result to ``out`` as a JSON line as it
    comes in (a long run keeps what it measured if stopped), and returns the summary."""
    sessions = [w for w in workload if isinstance(w, Session)]
    rows = [w for w in workload if isinstance(w, TraceRow)]
    if sessions and rows:
        raise ValueError("replay either agent sessions or trace rows, not both")
    total = sum(len(s.turns) for s in sessions) + len(rows)
    bar = Progress(total, progress)

    def record(result: TurnResult) -> None:
        out.write(json.dumps(result_row(result, slo)) + "\n")
        bar(result)

    if sessions:
        results = await replay_sessions(
            url,
            sessions,
            start_gap_s,
            time_scale=time_scale,
            scale=scale,
            seed=seed,
            model=model,
            on_result=record,
        )
    else:
        results = await replay_trace(
            url, rows, scale=scale, time_scale=time_scale, model=model, on_result=record
        )
    return summarize(results, slo)
