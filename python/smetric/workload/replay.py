"""Replaying agent sessions against any SGLang-compatible endpoint (our router, sglang-router, a
worker): each session's turns in order, the next turn sent after the previous answer plus its
tool/think time, as streaming ``/v1/chat/completions`` with the session's tools.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from smetric.workload.agents import Session, output_tokens


@dataclass(frozen=True)
class TurnResult:
    session: str
    turn: int
    ok: bool
    ttft_s: float
    tpot_s: float | None
    e2e_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    worker: str | None
    reason: str | None
    error: str | None = None


async def _turn(
    session: aiohttp.ClientSession, url: str, s: Session, k: int, time_scale: float
) -> TurnResult:
    turn = s.turns[k]
    body = {
        "model": "default",
        "messages": turn.messages,
        "tools": s.tools,
        "max_tokens": output_tokens(turn),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage: dict[str, object] = {}
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            worker, reason = r.headers.get("X-SMetric-Worker"), r.headers.get("X-SMetric-Reason")
            if r.status != 200:
                text = await r.text()
                return TurnResult(
                    s.session_id,
                    k,
                    False,
                    0.0,
                    None,
                    0.0,
                    0,
                    0,
                    0,
                    worker,
                    reason,
                    f"HTTP {r.status}: {text[:200]}",
                )
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                data = json.loads(line[6:])
                if data.get("error"):
                    raise RuntimeError(str(data["error"]))
                if data.get("usage"):
                    usage = data["usage"]
                choices = data.get("choices") or []
                delta = (choices[0].get("delta") or {}) if choices else {}
                # Tool calls and reasoning are output tokens too (agents answer mostly in calls).
                if any(delta.get(k) for k in ("content", "tool_calls", "reasoning_content")):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
    except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as e:
        return TurnResult(s.session_id, k, False, 0.0, None, 0.0, 0, 0, 0, None, None, repr(e))
    end = time.perf_counter()
    first = first or end
    details = usage.get("prompt_tokens_details") or {}
    scale = time_scale  # report in the engine's (model) seconds
    return TurnResult(
        s.session_id,
        k,
        True,
        (first - t0) * scale,
        ((last - first) / (chunks - 1) * scale) if last and chunks > 1 else None,
        (end - t0) * scale,
        int(usage.get("prompt_tokens", 0)),  # type: ignore[call-overload]
        int(usage.get("completion_tokens", chunks)),  # type: ignore[call-overload]
        int(details.get("cached_tokens", 0)) if isinstance(details, dict) else 0,
        worker,
        reason,
    )


async def replay_sessions(
    url: str,
    sessions: Sequence[Session],
    start_gap_s: float = 1.0,
    think_s: float = 1.0,
    time_scale: float = 1.0,
) -> list[TurnResult]:
    """Session i starts at ``i * start_gap_s``; a turn follows the previous answer after the
    recorded tool time (or ``think_s``). Times are model seconds: the waits are divided by
    ``time_scale`` and the measured latencies multiplied by it, to match an emulator running that
    much faster than real time."""
    results: list[TurnResult] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def run(i: int, s: Session) -> None:
            await asyncio.sleep(i * start_gap_s / time_scale)
            for k in range(len(s.turns)):
                if k:
                    await asyncio.sleep((s.turns[k].tool_time_s or think_s) / time_scale)
                results.append(await _turn(http, url, s, k, time_scale))

        await asyncio.gather(*(run(i, s) for i, s in enumerate(sessions)))
    return results
