"""Does the emulator's own CPU overhead distort the timing it emulates?

Starts ``smetric emulate`` in its own process, drives it with closed-loop streaming clients
(each sends a request, reads its stream to the end, sends the next) from this process, and
compares the TTFT and TPOT each client measured with what the engine model says for the same
request (``/_emulator/completed``).

    python benches/bench_emulator.py --workers 8 --streams 32 --seconds 20

Under pytest it runs a short, small version (the CI keeps it from rotting).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent


def _free_base_port(count: int) -> int:
    """A run of free ports below Linux's ephemeral range (32768+), so client sockets never
    take one while the emulator starts."""
    rng = random.Random()
    while True:
        base = rng.randrange(20000, 32000 - count)
        if not any(_port_taken(base + i) for i in range(count)):
            return base


def _prompt(tokens: int, seed: int) -> str:
    unit = f"<{seed:08d}> tool output line "
    n = round(tokens * 3.4)
    return (unit * (n // len(unit) + 1))[:n]


async def _client(session, url, stream_id, deadline, prompt_tokens, out_tokens, seen):
    i = 0
    while time.perf_counter() < deadline:
        rid = f"s{stream_id}-{i}"
        i += 1
        body = {
            "text": _prompt(prompt_tokens, zlib.crc32(rid.encode())),
            "rid": rid,
            "stream": True,
            "sampling_params": {"max_new_tokens": out_tokens},
        }
        sent = time.perf_counter()
        times = []
        async with session.post(url + "/generate", json=body) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    times.append(time.perf_counter())
        if len(times) == out_tokens:
            seen[rid] = (times[0] - sent, (times[-1] - times[0]) / max(out_tokens - 1, 1))


async def _drive(urls, streams, seconds, prompt_tokens, out_tokens):
    seen: dict[str, tuple[float, float]] = {}
    deadline = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        await asyncio.gather(
            *(
                _client(session, url, w * streams + s, deadline, prompt_tokens, out_tokens, seen)
                for w, url in enumerate(urls)
                for s in range(streams)
            )
        )
        engine = {}
        for url in urls:
            async with session.get(url + "/_emulator/completed") as r:
                for row in await r.json():
                    engine[row["rid"]] = (row["ttft_s"], row["tpot_s"])
    return seen, engine


def run_load(
    workers: int = 8,
    streams: int = 32,
    seconds: float = 20.0,
    prompt_tokens: int = 2000,
    out_tokens: int = 64,
    profile: str = "llama-3.1-8b-h100",
    time_scale: float = 1.0,
) -> dict[str, float]:
    port = _free_base_port(workers)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "smetric",
            "emulate",
            "--workers",
            str(workers),
            "--base-port",
            str(port),
            "--profile",
            profile,
            "--time-scale",
            str(time_scale),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # "emulating N SGLang workers ..." once listening
        urls = [f"http://127.0.0.1:{port + i}" for i in range(workers)]
        seen, engine = asyncio.run(_drive(urls, streams, seconds, prompt_tokens, out_tokens))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    both = [rid for rid in seen if rid in engine and engine[rid][1] is not None]
    ttft_err = [seen[r][0] / engine[r][0] - 1 for r in both]
    tpot_err = [seen[r][1] / engine[r][1] - 1 for r in both]
    return {
        "requests": len(both),
        "ttft_model_mean_ms": 1e3 * statistics.mean(engine[r][0] for r in both),
        "ttft_measured_mean_ms": 1e3 * statistics.mean(seen[r][0] for r in both),
        "tpot_model_mean_ms": 1e3 * statistics.mean(engine[r][1] for r in both),
        "tpot_measured_mean_ms": 1e3 * statistics.mean(seen[r][1] for r in both),
        "ttft_error_mean": statistics.mean(ttft_err),
        "ttft_error_median": statistics.median(ttft_err),
        "tpot_error_mean": statistics.mean(tpot_err),
        "tpot_error_median": statistics.median(tpot_err),
    }


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_emulator_timing_under_concurrent_streams(benchmark):
    result = benchmark.pedantic(
        run_load, kwargs={"workers": 2, "streams": 4, "seconds": 2.0}, rounds=1, iterations=1
    )
    benchmark.extra_info.update(result)
    assert result["requests"] > 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--out-tokens", type=int, default=64)
    ap.add_argument("--profile", default="llama-3.1-8b-h100")
    ap.add_argument("--time-scale", type=float, default=1.0)
    a = ap.parse_args()
    print(
        json.dumps(
            run_load(
                a.workers,
                a.streams,
                a.seconds,
                a.prompt_tokens,
                a.out_tokens,
                a.profile,
                a.time_scale,
            ),
            indent=2,
        )
    )
