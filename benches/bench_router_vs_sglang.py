"""smetric's router side by side with sglang-router 0.3.2 (from PyPI), on the same fast mock
workers, on this machine.

    python benches/bench_router_vs_sglang.py            # full run (several minutes)
    python benches/bench_router_vs_sglang.py --quick    # smaller counts
    python benches/bench_router_vs_sglang.py --pd       # PD mode: one prefill, one decode

It installs sglang-router 0.3.2 into its own virtualenv (``.bench/sglang-router``), starts two
mock workers (``benches/mock_worker.py``), then each router in turn in front of them, and measures:
added latency over calling a worker directly (the median over requests of the difference
between each prompt sent through the router and the same prompt sent straight to the worker,
one right after the other, 1 KB to 512 KB prompts), time to the first
streamed chunk, throughput at concurrency 64 with ``wrk`` (1 KB prompts, streaming and not) with
the router's CPU time per request, and the router's memory after many distinct 16 KB prompts.
smetric runs twice: with its Rust data plane (the default) and with ``--data-plane aiohttp``.
With ``--pd`` each router runs in PD mode instead (``--pd-disaggregation``, the first mock as the
prefill worker, the second as the decode worker; the direct call goes to the decode worker) and
the memory step is left out (``.bench/router_vs_sglang_pd.json``).
Before and after each router it times fixed plain-Python work (``machine_slowdown``): how much
the host was slowing this VM meanwhile. Prints a markdown table and writes JSON next to it
(``.bench/router_vs_sglang.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / ".bench"
SGLANG_VENV = BENCH / "sglang-router"
SIZES = {"1 KB": 1 << 10, "16 KB": 16 << 10, "128 KB": 128 << 10, "512 KB": 512 << 10}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_sglang_router() -> Path:
    python = SGLANG_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(SGLANG_VENV)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "sglang-router==0.3.2"], check=True
        )
    return python


def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), 0.5):
                pass
            import urllib.request

            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def body(size: int, seed: int, stream: bool = False) -> bytes:
    text = (f"[{seed}] " + "agent tool output " * (size // 18 + 1))[:size]
    return json.dumps(
        {"text": text, "sampling_params": {"max_new_tokens": 1}, "stream": stream}
    ).encode()


async def added_latencies(
    url: str, direct: str, payloads: list[bytes], stream: bool = False
) -> list[float]:
    """Each payload sent through the router and straight to the worker, one after the other
    (the order alternating): the latency the router adds to each, measured in pairs so that
    the machine's drift over the run falls on both sides alike. Requests go back to back: a
    pause between them lets this VM's idle vCPUs halt, and waking them adds hundreds of
    microseconds per hop, which would measure the VM rather than the router. With ``stream``,
    the latency is to the first line of the answer."""

    async def once(s: aiohttp.ClientSession, base: str, p: bytes) -> float:
        t0 = time.perf_counter()
        async with s.post(
            base + "/generate", data=p, headers={"Content-Type": "application/json"}
        ) as r:
            if stream:
                await r.content.readline()
                t = time.perf_counter() - t0
                await r.read()
                return t
            await r.read()
            return time.perf_counter() - t0

    out = []
    async with aiohttp.ClientSession() as s:
        for p in payloads[:3]:  # warm both connections
            await once(s, url, p)
            await once(s, direct, p)
        for i, p in enumerate(payloads):
            if i % 2:
                via = await once(s, url, p)
                base = await once(s, direct, p)
            else:
                base = await once(s, direct, p)
                via = await once(s, url, p)
            out.append(via - base)
    return out


def wrk(url: str, payload: bytes, seconds: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n')
        f.write(f"wrk.body = {json.dumps(payload.decode())}\n")
        script = f.name
    out = subprocess.run(
        ["wrk", "-t", "2", "-c", "64", "-d", f"{seconds}s", "-s", script, url + "/generate"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    os.unlink(script)
    for line in out.splitlines():
        if line.startswith("Requests/sec:"):
            return float(line.split()[1])
    raise RuntimeError(out)


async def flood(url: str, n: int, size: int, concurrency: int = 64) -> None:
    queue = iter(range(n))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:

        async def worker() -> None:
            for i in queue:
                async with s.post(
                    url + "/generate",
                    data=body(size, 10_000 + i),
                    headers={"Content-Type": "application/json"},
                ) as r:
                    await r.read()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def machine_slowdown(runs: int = 3000) -> float:
    """Fixed plain-Python work timed many times: its median over its minimum, how much the host
    was slowing this VM meanwhile (1.0: not at all; up to about 2 on this project's VM)."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        total = 0
        for i in range(2000):
            total += i * i
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / min(times)


def measure(
    name: str, url: str, pid: int, direct: str, quick: bool, memory: bool = True
) -> dict[str, object]:
    n_lat = 100 if quick else 300
    res: dict[str, object] = {"router": name}
    slowdown = [machine_slowdown()]
    for label, size in SIZES.items():
        payloads = [body(size, i) for i in range(n_lat)]
        added = statistics.median(asyncio.run(added_latencies(url, direct, payloads)))
        res[f"added_p50_us {label}"] = round(added * 1e6)
    payloads = [body(1024, i, stream=True) for i in range(n_lat)]
    added = statistics.median(asyncio.run(added_latencies(url, direct, payloads, stream=True)))
    res["added_first_chunk_p50_us"] = round(added * 1e6)
    seconds = 5 if quick else 10
    for stream in (False, True):
        label = "stream" if stream else "plain"
        cpu0 = cpu_seconds(pid)
        rps = wrk(url, body(1024, 1, stream), seconds)
        cpu = cpu_seconds(pid) - cpu0
        res[f"req_per_s {label}"] = round(rps)
        res[f"cpu_us_per_req {label}"] = round(cpu / (rps * seconds) * 1e6)
    if memory:
        n_mem = 10_000 if quick else 100_000
        t0 = time.perf_counter()
        asyncio.run(flood(url, n_mem, 16 << 10))
        res[f"rss_mb after {n_mem} x 16 KB prompts"] = round(rss_mb(pid))
        res["flood_s"] = round(time.perf_counter() - t0, 1)
    slowdown.append(machine_slowdown())
    res["machine slowdown before, after"] = " ".join(f"{x:.2f}" for x in slowdown)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["smetric", "smetric-aiohttp", "sglang-router"], default=None)
    ap.add_argument("--pd", action="store_true", help="PD mode: a prefill and a decode worker")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("needs wrk (apt-get install wrk)")
    BENCH.mkdir(exist_ok=True)
    ports = [free_port(), free_port()]
    mocks = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "benches" / "mock_worker.py"), "--port", str(p)],
            # wrk's connections close mid-stream when a run ends: aiohttp logs each; not news.
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    results = []
    try:
        for url in urls:
            wait_http(url)
        routers = {
            "sglang-router 0.3.2": [
                str(ensure_sglang_router()),
                "-m",
                "sglang_router.launch_router",
            ],
            "smetric": [sys.executable, "-m", "smetric.launch_router"],
            # The same router with its former, all-Python data plane: the gain of the Rust one.
            "smetric-aiohttp": [
                sys.executable,
                "-m",
                "smetric.launch_router",
                "--data-plane",
                "aiohttp",
            ],
        }
        for name, cmd in routers.items():
            if args.only and name.split(" ")[0] != args.only:
                continue
            port = free_port()
            extra = ["--prometheus-port", str(free_port())] if "sglang" in name else []
            workers = (
                ["--pd-disaggregation", "--prefill", urls[0], "--decode", urls[1]]
                if args.pd
                else ["--worker-urls", *urls]
            )
            proc = subprocess.Popen(
                [
                    *cmd,
                    *workers,
                    "--policy",
                    "cache_aware",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--log-level",
                    "warn",
                    *extra,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                wait_http(f"http://127.0.0.1:{port}")
                time.sleep(1.0)
                direct = urls[1] if args.pd else urls[0]
                url = f"http://127.0.0.1:{port}"
                results.append(measure(name, url, proc.pid, direct, args.quick, not args.pd))
                print(json.dumps(results[-1]), flush=True)
            finally:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    finally:
        for m in mocks:
            m.terminate()
    out = "router_vs_sglang_pd.json" if args.pd else "router_vs_sglang.json"
    (BENCH / out).write_text(json.dumps(results, indent=2))
    keys = [k for k in results[0] if k != "router"]
    print("\n| measure | " + " | ".join(str(r["router"]) for r in results) + " |")
    print("|---|" + "---|" * len(results))
    for k in keys:
        print(f"| {k} | " + " | ".join(str(r[k]) for r in results) + " |")


if __name__ == "__main__":
    main()
