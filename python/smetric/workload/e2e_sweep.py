"""End-to-end load sweeps: real routers in front of emulated SGLang workers, real agent sessions.

For every router under test (ours with each policy, sglang-router 0.3.2 with each of its
policies) and every load factor on a ladder, a fresh emulated cluster (fresh caches, so no router
inherits another's warm KV) and a fresh router start as their own processes, the bundled agent
sessions are replayed through the router (``replay_sessions``: streaming chat with tools, each
turn after the previous answer plus its think time), and the run is scored as in the simulator's
sweep (``workload/sweep.py``): TPS = prompt + output tokens served / makespan, the run meets the
SLO when at least 90% of requests have TTFT within their TTFT SLO (k x the request's idle TTFT,
k = 5) and at least 90% have mean TPOT within the TPOT SLO (100 ms). Each router climbs the
ladder until a run misses the SLO, then bisects between the last load that met it and the first
that did not; its peak is its highest TPS among the runs that met the SLO.

Load factor f divides the sessions' start gap and think (tool) times by f (``replay_sessions``'s
``scale``). The bundled slice is 24 sessions; ``copies`` runs each that many times as separate
conversations of the same agent (``agents.replicate``: same system prompt and tools), so the
cluster can be loaded past its SLO. Sessions start 2 s / copies apart and think 2 s between
turns at x1, as in the simulator's sweep of the same sessions (``smetric sweep --copies``).
Times are the emulated model's seconds (the emulator runs ``time_scale`` times faster than real
time; the replay scales its waits and measurements accordingly).

Run ``python scripts/e2e_sweep.py --help``; every process it starts is stopped before it returns,
on errors and Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from smetric.perf import load_profile
from smetric.slo import SLOModel
from smetric.workload.agents import Session, load_sessions, replicate
from smetric.workload.replay import TurnResult, replay_sessions

SGLANG_ROUTER = "sglang-router"
OURS = "smetric"
OUR_POLICIES = ("smetric", "lmetric", "cache_aware", "least_load")
SGLANG_POLICIES = ("cache_aware", "round_robin", "power_of_two")
SGLANG_ALL_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
LADDER = (1.0, 2.0, 4.0, 8.0)
STARTUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RouterSpec:
    router: str
    """``smetric`` (this package's router) or ``sglang-router`` (sglang-router from PyPI)."""
    policy: str

    @property
    def label(self) -> str:
        return f"{self.router}/{self.policy}"


DEFAULT_ROUTERS = tuple(RouterSpec(OURS, p) for p in OUR_POLICIES) + tuple(
    RouterSpec(SGLANG_ROUTER, p) for p in SGLANG_POLICIES
)


@dataclass(frozen=True)
class SweepConfig:
    workers: int = 4
    profile: str = "qwen3-30b-a3b-h20"
    time_scale: float = 1.0
    """Real time by default: on a small machine a faster emulated clock is starved of CPU by
    the replay client, router and workers sharing it (at x4 on 2 cores, P90 TTFT came out 3-6x
    the simulator's at the same load), and latencies then measure the machine, not the policy.
    ``scripts/sim_vs_emulator.py`` checks the two agree."""
    copies: int = 4
    sessions: int | None = 12
    """Use the first N bundled sessions (before copying); None: all 24."""
    start_gap_s: float | None = None
    """Model seconds between session starts at load x1; None: 2 s / copies, as the simulator's
    sweep of agent sessions (the same rate per copy)."""
    think_s: float = 2.0
    """Model seconds between a turn's answer and the next turn where none is recorded."""
    ladder: tuple[float, ...] = LADDER
    refine: int = 1
    """Bisections between the last load under SLO and the first over it."""
    attainment: float = 0.9
    sglang_python: str | None = None
    """Interpreter with sglang-router installed; None: this one."""
    pd: tuple[int, int] | None = None
    """PD disaggregation: this many prefill and decode workers instead of ``workers``; the
    router's policy picks prefill workers (sglang-router's ``--policy`` applies to both)."""

    @property
    def worker_count(self) -> int:
        return self.workers if self.pd is None else self.pd[0] + self.pd[1]

    @property
    def session_gap_s(self) -> float:
        return 2.0 / self.copies if self.start_gap_s is None else self.start_gap_s


@dataclass(frozen=True)
class E2EPoint:
    label: str
    factor: float
    requests: int
    errors: int
    tps: float
    ttft_attainment: float
    tpot_attainment: float
    ttft_p90_s: float
    tpot_p90_s: float
    cached: float
    """Cached prompt tokens (local + global tier) / prompt tokens."""
    per_worker: tuple[int, ...]
    """Requests each emulated worker served."""
    meets_slo: bool


# ---- scoring ------------------------------------------------------------------------------


def _p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.9 * (len(ordered) - 1))] if ordered else float("inf")


def evaluate(
    label: str,
    factor: float,
    results: Sequence[TurnResult],
    makespan_s: float,
    slo: SLOModel,
    per_worker: Sequence[int] = (),
    attainment: float = 0.9,
) -> E2EPoint:
    """The same rule as the simulator's sweep: failed requests count as missing both SLOs."""
    ok = [r for r in results if r.ok]
    n = max(len(results), 1)
    ttft_met = sum(1 for r in ok if r.ttft_s <= slo.ttft_slo_s(r.prompt_tokens))
    tpot_met = sum(1 for r in ok if (r.tpot_s or 0.0) <= slo.tpot_slo_s)
    prompt = sum(r.prompt_tokens for r in ok)
    tokens = sum(r.prompt_tokens + r.output_tokens for r in ok)
    return E2EPoint(
        label,
        factor,
        len(results),
        len(results) - len(ok),
        tokens / max(makespan_s, 1e-9),
        ttft_met / n,
        tpot_met / n,
        _p90([r.ttft_s for r in ok]),
        _p90([r.tpot_s for r in ok if r.tpot_s is not None]),
        sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        tuple(per_worker),
        bool(results) and ttft_met / n >= attainment and tpot_met / n >= attainment,
    )


def peak_tps(points: Sequence[E2EPoint]) -> float:
    return max((p.tps for p in points if p.meets_slo), default=0.0)


# ---- processes ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sglang_router_python(configured: str | None = None) -> str:
    """The interpreter that runs sglang-router: ``configured``, else this one if it has it."""
    if configured:
        return configured
    if importlib.util.find_spec("sglang_router") is None:
        raise RuntimeError(
            "sglang-router is not installed in this environment: pip install "
            "'sglang-router==0.3.2' (it is in smetric's [test] extras), or pass --sglang-python"
        )
    return sys.executable


def router_command(spec: RouterSpec, urls: Sequence[str], port: int, cfg: SweepConfig) -> list[str]:
    if cfg.pd is None:
        common = ["--worker-urls", *urls]
    else:
        # The emulator lists prefill workers first; their bootstrap port is not used by it.
        common = ["--pd-disaggregation"]
        for url in urls[: cfg.pd[0]]:
            common += ["--prefill", url, "8998"]
        for url in urls[cfg.pd[0] :]:
            common += ["--decode", url]
    common += ["--policy", spec.policy, "--host", "127.0.0.1"]
    common += ["--port", str(port), "--log-level", "warn"]
    if spec.router == SGLANG_ROUTER:
        # Its metrics server binds 29000 by default: give it a port of its own.
        python = sglang_router_python(cfg.sglang_python)
        extra = ["--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1"]
        return [python, "-m", "sglang_router.launch_router", *common, *extra]
    if spec.router == OURS:
        extra = ["--profile", cfg.profile]
        return [sys.executable, "-m", "smetric.launch_router", *common, *extra]
    raise ValueError(f"unknown router {spec.router!r}")


def router_env() -> dict[str, str]:
    """sglang-router 0.3.2 tries to fetch a tokenizer for the workers' model name from the
    Hugging Face hub; the emulated model has none, so make that fail at once, not after a
    network timeout. Loopback (the workers) stays direct."""
    env = dict(os.environ)
    env.update(
        HTTPS_PROXY="http://127.0.0.1:9",
        https_proxy="http://127.0.0.1:9",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        HF_HUB_OFFLINE="1",
    )
    return env


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM (SIGINT may be ignored: a background job inherits it ignored), then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_WORKER_URL = re.compile(r"=(http://[^,\s]+)")


def start_emulator(cfg: SweepConfig) -> tuple[subprocess.Popen[bytes], list[str]]:
    """``smetric emulate`` on free ports; returns the process and its workers' URLs."""
    cmd = [sys.executable, "-m", "smetric", "emulate", "--workers", str(cfg.workers)]
    cmd += ["--base-port", "0", "--time-scale", str(cfg.time_scale), "--profile", cfg.profile]
    if cfg.pd is not None:
        cmd += ["--pd", f"{cfg.pd[0]},{cfg.pd[1]}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        urls = _WORKER_URL.findall(line)
        if len(urls) != cfg.worker_count:
            raise RuntimeError(f"the emulator did not start: {line!r}")
        proc.stdout.close()
    except BaseException:
        stop_process(proc)
        raise
    return proc, urls


async def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until ``/readiness`` answers 200 (every worker registered), or the process dies."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited with status {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url + "/readiness") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"router at {url} not ready after {timeout_s:.0f} s")


_REQUESTS_TOTAL = re.compile(r"^sglang:num_requests_total\{[^}]*\} ([0-9.]+)$", re.M)


async def requests_per_worker(urls: Sequence[str]) -> list[int]:
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for url in urls:
            async with http.get(url + "/metrics") as r:
                m = _REQUESTS_TOTAL.search(await r.text())
                out.append(int(float(m.group(1))) if m else -1)
    return out


async def run_point(
    spec: RouterSpec, sessions: Sequence[Session], factor: float, cfg: SweepConfig
) -> E2EPoint:
    """One router at one load factor, on a fresh cluster."""
    slo = SLOModel(load_profile(cfg.profile))
    emulator, urls = start_emulator(cfg)
    router: subprocess.Popen[bytes] | None = None
    try:
        port = free_port()
        router = subprocess.Popen(
            router_command(spec, urls, port, cfg),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=router_env(),
        )
        base = f"http://127.0.0.1:{port}"
        await wait_ready(base, router, STARTUP_TIMEOUT_S)
        t0 = time.perf_counter()
        results = await replay_sessions(
            base,
            sessions,
            start_gap_s=cfg.session_gap_s,
            think_s=cfg.think_s,
            time_scale=cfg.time_scale,
            scale=factor,
        )
        makespan_s = (time.perf_counter() - t0) * cfg.time_scale
        served = await requests_per_worker(urls)
    finally:
        if router is not None:
            stop_process(router)
        stop_process(emulator)
    return evaluate(spec.label, factor, results, makespan_s, slo, served, cfg.attainment)


def sweep(
    routers: Sequence[RouterSpec],
    cfg: SweepConfig,
    progress: Callable[[E2EPoint], None] | None = None,
) -> dict[str, list[E2EPoint]]:
    """Each router up the ladder until a run misses the SLO (heavier steps cannot do better
    once one has failed), then ``cfg.refine`` bisections (geometric) between the last load that
    met it and the first that did not."""
    sessions = replicate(load_sessions(limit=cfg.sessions), cfg.copies)
    out: dict[str, list[E2EPoint]] = {}
    for spec in routers:
        points = out.setdefault(spec.label, [])

        def run(factor: float, spec: RouterSpec = spec, points: list[E2EPoint] = points) -> bool:
            point = asyncio.run(run_point(spec, sessions, factor, cfg))
            points.append(point)
            if progress:
                progress(point)
            return point.meets_slo

        good: float | None = None
        for factor in cfg.ladder:
            if not run(factor):
                if good is not None:
                    lo, hi = good, factor
                    for _ in range(cfg.refine):
                        mid = (lo * hi) ** 0.5
                        lo, hi = (mid, hi) if run(mid) else (lo, mid)
                break
            good = factor
    return out


# ---- report -------------------------------------------------------------------------------


def format_point(p: E2EPoint) -> str:
    return (
        f"  {p.label:<26} x{p.factor:<5.3g} {'ok  ' if p.meets_slo else 'MISS'} "
        f"TPS {p.tps:>8.0f}  TTFT met {p.ttft_attainment:6.1%}  TPOT met {p.tpot_attainment:6.1%}"
        f"  TTFT p90 {p.ttft_p90_s * 1e3:6.0f} ms  TPOT p90 {p.tpot_p90_s * 1e3:5.1f} ms"
        f"  cached {p.cached:5.1%}  per worker {'/'.join(map(str, p.per_worker))}"
        f"  errors {p.errors}"
    )


def table(results: dict[str, list[E2EPoint]]) -> str:
    rows = [
        "| router / policy | peak TPS under SLO | at load | TTFT p90 there | cached there "
        "| requests per worker there | first load over SLO |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for label, points in results.items():
        good = [p for p in points if p.meets_slo]
        best = max(good, key=lambda p: p.tps) if good else None
        miss = min((p for p in points if not p.meets_slo), key=lambda p: p.factor, default=None)
        if best is None:
            first = min(p.factor for p in points)
            rows.append(f"| {label} | 0 (none met the SLO) | | | | | x{first:.3g} |")
            continue
        rows.append(
            f"| {label} | {best.tps:.0f} | x{best.factor:.3g} | {best.ttft_p90_s * 1e3:.0f} ms "
            f"| {best.cached:.1%} | {'/'.join(map(str, best.per_worker))} "
            f"| {f'x{miss.factor:.3g}' if miss else 'none'} |"
        )
    return "\n".join(rows)


def parse_routers(values: Sequence[str]) -> list[RouterSpec]:
    """``smetric/lmetric``, ``sglang-router/round_robin``, ... (``router/policy``)."""
    from smetric.policies import POLICIES

    specs = []
    for v in values:
        router, _, policy = v.partition("/")
        known = (
            POLICIES if router == OURS else SGLANG_ALL_POLICIES if router == SGLANG_ROUTER else ()
        )
        if policy not in known:
            raise ValueError(f"not a router/policy: {v!r}")
        specs.append(RouterSpec(router, policy))
    return specs


def main(argv: Sequence[str] | None = None, prog: str = "e2e_sweep") -> int:
    from smetric.cli import pd_shape

    ap = argparse.ArgumentParser(
        prog=prog,
        description="Peak TPS under SLO, end to end: our router and sglang-router 0.3.2 in "
        "front of emulated SGLang workers, replaying the bundled agent sessions.",
    )
    ap.add_argument(
        "--routers",
        nargs="+",
        default=[s.label for s in DEFAULT_ROUTERS],
        help="router/policy pairs (default: %(default)s)",
    )
    d = SweepConfig()
    ap.add_argument("--workers", type=int, default=d.workers)
    ap.add_argument("--profile", default=d.profile)
    ap.add_argument("--time-scale", type=float, default=d.time_scale)
    ap.add_argument("--copies", type=int, default=d.copies, help="users per bundled session")
    ap.add_argument(
        "--sessions", type=int, default=d.sessions, help="first N bundled sessions (default 12)"
    )
    ap.add_argument(
        "--start-gap", type=float, default=None, help="model seconds (default 2 / copies)"
    )
    ap.add_argument("--think", type=float, default=d.think_s, help="model seconds")
    ap.add_argument("--ladder", type=float, nargs="+", default=list(d.ladder))
    ap.add_argument("--refine", type=int, default=d.refine, help="bisections after the first miss")
    ap.add_argument("--sglang-python", default=None, help="interpreter with sglang-router")
    ap.add_argument("--pd", type=pd_shape, metavar="P,D", help="PD: P prefill, D decode workers")
    args = ap.parse_args(argv)
    pd: tuple[int, int] | None = args.pd
    try:
        routers = parse_routers(args.routers)
        load_profile(args.profile)
    except ValueError as e:
        ap.error(str(e))
    if args.workers < 1 or args.time_scale <= 0 or args.copies < 1 or args.refine < 0:
        ap.error("--workers, --copies >= 1, --time-scale > 0, --refine >= 0")
    if any(f <= 0 for f in args.ladder):
        ap.error("--ladder factors must be > 0")
    cfg = SweepConfig(
        args.workers,
        args.profile,
        args.time_scale,
        args.copies,
        args.sessions,
        args.start_gap,
        args.think,
        tuple(sorted(args.ladder)),
        refine=args.refine,
        sglang_python=args.sglang_python,
        pd=pd,
    )
    if any(r.router == SGLANG_ROUTER for r in routers):
        try:
            sglang_router_python(cfg.sglang_python)
        except RuntimeError as e:
            ap.error(str(e))
    n = len(replicate(load_sessions(limit=cfg.sessions), cfg.copies))
    print(
        f"{n} agent sessions, "
        + (f"{cfg.workers} emulated workers" if pd is None else f"PD {pd[0]}+{pd[1]} emulated")
        + f" ({cfg.profile}, x{cfg.time_scale:g}"
        f" time), global KV tier; load ladder {' '.join(f'x{f:g}' for f in cfg.ladder)}",
        flush=True,
    )
    # SIGTERM unwinds like Ctrl-C, so the emulator and router of the run in progress are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = sweep(routers, cfg, progress=lambda p: print(format_point(p), flush=True))
    print()
    print(table(results))
    return 0


__all__ = [
    "DEFAULT_ROUTERS",
    "E2EPoint",
    "RouterSpec",
    "SweepConfig",
    "evaluate",
    "main",
    "peak_tps",
    "sweep",
]

if __name__ == "__main__":
    sys.exit(main())
