"""The ``smetric`` command line."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

from smetric import __version__
from smetric.perf import DEFAULT_PROFILE, PRESETS, load_profile


def pd_shape(text: str) -> tuple[int, int]:
    """``--pd P,D``: how many prefill and decode workers (argparse type)."""
    try:
        prefill, decode = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("--pd takes P,D (two integers)") from None
    if min(prefill, decode) < 1:
        raise argparse.ArgumentTypeError("--pd needs at least one prefill and one decode worker")
    return prefill, decode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sweep"] and "--e2e" in argv:
        from smetric.workload.e2e_sweep import main as e2e_main

        return e2e_main([a for a in argv[1:] if a != "--e2e"], prog="smetric sweep --e2e")
    if argv[:1] == ["serve"]:
        from smetric.launch_router import main as serve_main

        return serve_main(argv[1:], prog="smetric serve")
    parser = argparse.ArgumentParser(
        prog="smetric", description="Session-aware router for LLM clusters serving agents."
    )
    parser.add_argument("--version", action="version", version=f"smetric {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "serve", help="run the router (sglang_router.launch_router's flags)", add_help=False
    )
    demo = sub.add_parser(
        "demo",
        help="the router in front of an emulated cluster, on bundled real agent sessions",
    )
    demo.add_argument("--workers", type=int, default=4)
    demo.add_argument(
        "--policies",
        nargs="+",
        default=None,
        help="policies to compare (default: smetric lmetric cache_aware)",
    )
    demo.add_argument("--profile", default="qwen3-30b-a3b-h20")
    demo.add_argument("--time-scale", type=float, default=4.0)
    demo.add_argument("--sessions", type=int, default=24)
    emulate = sub.add_parser(
        "emulate",
        help="run emulated SGLang workers (engine model behind SGLang's HTTP API)",
        description="Runs emulated SGLang workers in one process, sharing one global KV tier, "
        "until interrupted. Each listens on its own port from --base-port.",
    )
    emulate.add_argument("--workers", type=int, default=4, help="colocated workers (default 4)")
    emulate.add_argument("--base-port", type=int, default=30000)
    emulate.add_argument("--host", default="127.0.0.1")
    emulate.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"a preset ({', '.join(sorted(PRESETS))}) or a profile JSON file",
    )
    emulate.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="run this many times faster than real time (default 1)",
    )
    emulate.add_argument("--model-name", default="default")
    emulate.add_argument("--chunk-tokens", type=int, default=8192)
    emulate.add_argument("--max-running-requests", type=int, default=256)
    emulate.add_argument(
        "--kv-pool-tokens",
        type=int,
        default=None,
        help="KV pool per worker (default: from the profile)",
    )
    emulate.add_argument(
        "--no-global-tier", action="store_true", help="workers share no global KV tier"
    )
    emulate.add_argument("--global-capacity-tokens", type=int, default=64_000_000)
    emulate.add_argument(
        "--global-bandwidth-gbps",
        type=float,
        default=25.0,
        help="global tier load bandwidth, GB/s (default 25)",
    )
    emulate.add_argument(
        "--pd",
        type=pd_shape,
        metavar="P,D",
        default=None,
        help="PD disaggregation: P prefill and D decode workers",
    )
    sw = sub.add_parser(
        "sweep",
        help="each policy's peak TPS under SLO in the simulator, raising the load until the "
        "SLO breaks",
    )
    sw.add_argument(
        "--trace",
        choices=["agents", "mooncake", "bailian", "generated"],
        default="agents",
        help="agents: agent-session JSONL (default: the bundled slice); mooncake, bailian: a "
        "Mooncake / Alibaba Bailian trace (--path required); generated: synthetic agent "
        "sessions (--sessions, --seed)",
    )
    sw.add_argument("--path", default=None)
    sw.add_argument("--limit", type=int, default=None, help="use the first N sessions / requests")
    sw.add_argument(
        "--closed-loop",
        action="store_true",
        help="mooncake, bailian: a next turn waits for its previous turn's answer, then the "
        "trace's think time",
    )
    sw.add_argument("--sessions", type=int, default=None, help="generated: sessions (default 200)")
    sw.add_argument("--seed", type=int, default=0, help="generated: random seed (default 0)")
    sw.add_argument("--workers", type=int, default=4)
    sw.add_argument("--profile", default=DEFAULT_PROFILE)
    sw.add_argument(
        "--policies",
        nargs="+",
        default=["smetric", "lmetric", "cache_aware", "kv_cost", "least_load"],
    )
    sw.add_argument(
        "--e2e",
        action="store_true",
        help="end to end instead: routers (ours and sglang-router 0.3.2) in front of emulated "
        "workers; see `smetric sweep --e2e --help`",
    )
    sw.add_argument(
        "--ladder",
        type=float,
        nargs="+",
        default=None,
        help="load factors to climb (default 1 1.5 2 3 4 6 8 12 16 24 32)",
    )
    sw.add_argument("--no-global-tier", action="store_true")
    sw.add_argument(
        "--engine-view",
        action="store_true",
        help="policies see the hits the engines hold (default: as the router does, from an "
        "index that counts a prompt as held where it was routed from the moment it was routed)",
    )
    sw.add_argument(
        "--copies",
        type=int,
        default=1,
        help="agents: replay N copies of every session (each its own conversation after the "
        "shared opening), for loads the trace's sessions cannot make alone",
    )
    sw.add_argument(
        "--pd",
        type=pd_shape,
        metavar="P,D",
        default=None,
        help="PD disaggregation: P prefill workers (chosen by the policy) and D decode workers "
        "(least loaded) instead of --workers colocated ones",
    )
    sw.add_argument(
        "--ttft-slo-scale",
        type=float,
        default=5.0,
        help="TTFT SLO = k x the request's TTFT alone on an idle instance (default 5)",
    )
    sw.add_argument("--tpot-slo-ms", type=float, default=100.0, help="TPOT SLO (default 100)")
    sw.add_argument(
        "--out", metavar="DIR", default=None, help="also write DIR/sweep.json (smetric report)"
    )
    rp = sub.add_parser(
        "replay",
        help="replay agent sessions or a Mooncake trace against an HTTP endpoint and measure "
        "TTFT, TPOT, TPS and SLO attainment",
        description="Sends agent sessions (streaming /v1/chat/completions with tools, each turn "
        "after the previous answer plus its tool or think time) or Mooncake trace rows "
        "(streaming /v1/completions at their timestamps, one deterministic text block per hash "
        "id) to any SGLang-compatible endpoint: the smetric router, sglang-router, one worker.",
    )
    rp.add_argument("--url", required=True, help="the endpoint, e.g. http://127.0.0.1:30000")
    rp.add_argument("--trace", choices=["agents", "mooncake"], default="agents")
    rp.add_argument(
        "--path", default=None, help="agent sessions (default: the bundled slice) or trace JSONL"
    )
    rp.add_argument("--limit", type=int, default=None, help="the first N sessions / rows")
    rp.add_argument("--scale", type=float, default=1.0, help="load factor: arrivals N times faster")
    rp.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="the endpoint runs this many times faster than real time (an emulator's "
        "--time-scale); latencies are reported in its model seconds",
    )
    rp.add_argument(
        "--seed", type=int, default=0, help="seeds think times of turns with no recorded one"
    )
    rp.add_argument(
        "--start-gap-s", type=float, default=2.0, help="agents: seconds between session starts"
    )
    rp.add_argument("--model", default="default", help="the model field of each request")
    rp.add_argument("--out", default="replay.jsonl", help="per-request results (JSONL)")
    rp.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help="profile whose idle TTFT sets each request's TTFT SLO",
    )
    rp.add_argument("--ttft-slo-scale", type=float, default=5.0)
    rp.add_argument("--ttft-slo-ms", type=float, default=None)
    rp.add_argument("--tpot-slo-ms", type=float, default=100.0)
    rep = sub.add_parser(
        "report",
        help="markdown table and PNG plots from sweep.json files (smetric sweep --out)",
    )
    rep.add_argument("dir", help="where report.md and the plots go; its sweep.json is read")
    rep.add_argument(
        "more", nargs="*", help="more sweep.json (or .json.gz) files, or folders holding one"
    )
    args = parser.parse_args(argv)
    if args.command == "sweep":
        return _sweep(parser, args)
    if args.command == "replay":
        return _replay(parser, args)
    if args.command == "report":
        return _report(parser, args)
    if args.command == "emulate":
        return _emulate(parser, args)
    if args.command == "demo":
        from smetric.demo import DEFAULT_POLICIES
        from smetric.demo import main as demo_main
        from smetric.policies import POLICIES

        policies = args.policies or list(DEFAULT_POLICIES)
        if args.workers < 1 or args.time_scale <= 0 or not 1 <= args.sessions <= 24:
            parser.error("--workers >= 1, --time-scale > 0, --sessions in 1..24")
        if unknown := [p for p in policies if p not in POLICIES]:
            parser.error(f"unknown policies: {', '.join(unknown)}")
        try:
            load_profile(args.profile)
        except ValueError as e:
            parser.error(str(e))
        return demo_main(
            policies, args.workers, args.profile, args.time_scale, sessions=args.sessions
        )
    return 2


def _emulate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import asyncio

    from smetric.emulator import EmulatedCluster
    from smetric.engine import EngineConfig, GlobalTierConfig
    from smetric.signals import until_stopped

    try:
        profile = load_profile(args.profile)
    except ValueError as e:
        parser.error(str(e))
    if args.workers < 1 or args.time_scale <= 0 or args.chunk_tokens < 1:
        parser.error("--workers and --chunk-tokens must be >= 1, --time-scale > 0")
    if not 0 <= args.base_port < 65536:
        parser.error("--base-port must be a TCP port")
    config = EngineConfig(
        chunk_tokens=args.chunk_tokens,
        max_running_requests=args.max_running_requests,
        kv_pool_tokens=args.kv_pool_tokens,
    )
    tier = (
        None
        if args.no_global_tier
        else GlobalTierConfig(
            capacity_tokens=args.global_capacity_tokens,
            load_bytes_per_s=args.global_bandwidth_gbps * 1e9,
        )
    )
    cluster = EmulatedCluster(
        profile,
        args.workers,
        args.base_port,
        args.host,
        args.time_scale,
        config,
        tier,
        args.pd,
        args.model_name,
    )

    async def serve() -> None:
        urls = await cluster.start()
        roles = ", ".join(f"{w.name}={u}" for w, u in zip(cluster.workers, urls, strict=True))
        print(
            f"emulating {len(urls)} SGLang workers ({profile.name}, x{args.time_scale}): {roles}",
            flush=True,
        )
        try:
            await until_stopped()
        finally:
            await cluster.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0


def _replay(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import asyncio

    from smetric.slo import SLOConfig, SLOModel
    from smetric.workload.replay import check_reachable, format_summary, replay_to_file

    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        parser.error("--url must start with http:// or https://")
    if args.scale <= 0 or args.time_scale <= 0 or args.start_gap_s < 0:
        parser.error("--scale and --time-scale must be > 0, --start-gap-s >= 0")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    if args.ttft_slo_scale <= 0 or args.tpot_slo_ms <= 0 or (args.ttft_slo_ms or 1) <= 0:
        parser.error("SLOs must be > 0")
    try:
        profile = load_profile(args.profile)
        if args.trace == "mooncake":
            from smetric.workload.mooncake import read_trace

            if not args.path:
                parser.error("--trace mooncake needs --path")
            workload: list[Any] = list(read_trace(args.path, args.limit))
            what = f"{len(workload)} trace rows"
        else:
            from smetric.workload.agents import load_sessions

            workload = list(load_sessions(args.path, args.limit))
            turns = sum(len(s.turns) for s in workload)
            what = f"{len(workload)} agent sessions ({turns} requests)"
    except (OSError, ValueError) as e:
        parser.error(str(e))
    if not workload:
        parser.error("nothing to replay: the workload is empty")
    config = SLOConfig(
        ttft_slo_scale=args.ttft_slo_scale,
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
    )
    slo = SLOModel(profile, config)

    async def go() -> dict[str, Any]:
        await check_reachable(url)
        print(f"replaying {what} against {url} (x{args.scale:g} load)", flush=True)
        with open(args.out, "w", encoding="utf-8") as out:
            return await replay_to_file(
                url,
                workload,
                out,
                slo,
                scale=args.scale,
                time_scale=args.time_scale,
                seed=args.seed,
                start_gap_s=args.start_gap_s,
                model=args.model,
            )

    try:
        summary = asyncio.run(go())
    except (ConnectionError, OSError) as e:
        print(f"smetric replay: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    print(f"wrote {args.out}")
    return 0 if summary["errors"] == 0 else 1


def _report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from smetric.report import write_report

    own = os.path.join(args.dir, "sweep.json")
    sweeps = ([own] if os.path.exists(own) else []) + args.more
    if not sweeps:
        parser.error(f"no sweep.json in {args.dir} and no other sweeps given")
    try:
        print(f"wrote {write_report(args.dir, sweeps)}")
    except (OSError, ValueError) as e:
        parser.error(str(e))
    return 0


def _sweep(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from smetric.policies import POLICIES
    from smetric.slo import SLOConfig
    from smetric.workload.sweep import ABLATIONS, LADDER, Point, load_workload, peak_tps, sweep

    if unknown := [p for p in args.policies if p not in POLICIES and p not in ABLATIONS]:
        parser.error(f"unknown policies: {', '.join(unknown)} (ablations: {', '.join(ABLATIONS)})")
    if args.workers < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--workers and --limit must be >= 1")
    if args.copies < 1 or (args.copies > 1 and args.trace != "agents"):
        parser.error("--copies (>= 1) is for --trace agents")
    if args.ladder is not None and (
        min(args.ladder) <= 0 or list(args.ladder) != sorted(set(args.ladder))
    ):
        parser.error("--ladder takes increasing load factors > 0")
    if args.ttft_slo_scale <= 0 or args.tpot_slo_ms <= 0:
        parser.error("--ttft-slo-scale and --tpot-slo-ms must be > 0")
    slo_config = SLOConfig(ttft_slo_scale=args.ttft_slo_scale, tpot_slo_ms=args.tpot_slo_ms)
    pd: tuple[int, int] | None = args.pd
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out}: not a directory")
    try:
        profile = load_profile(args.profile)
    except ValueError as e:
        parser.error(str(e))
    try:
        requests = load_workload(
            args.trace,
            args.path,
            profile,
            args.limit,
            args.closed_loop,
            args.copies,
            args.sessions,
            args.seed,
        )
    except (OSError, ValueError) as e:
        parser.error(str(e))

    def show(p: Point) -> None:
        mark = "ok " if p.meets_slo else "SLO"
        print(
            f"  {p.policy:<26} x{p.factor:<5g} {mark} TPS {p.tps:>10.0f}  TTFT attained "
            f"{p.ttft_attainment:6.1%}  TPOT attained {p.tpot_attainment:6.1%}",
            flush=True,
        )

    cluster = f"{args.workers} simulated workers" if pd is None else f"PD {pd[0]}+{pd[1]} workers"
    print(
        f"{len(requests)} requests ({args.trace}), {cluster} ({profile.name}), global tier "
        f"{'off' if args.no_global_tier else 'on'}, TTFT SLO {args.ttft_slo_scale:g}x idle, "
        f"TPOT SLO {args.tpot_slo_ms:g} ms"
    )
    from smetric.engine import GlobalTierConfig

    tier = None if args.no_global_tier else GlobalTierConfig()
    results = sweep(
        requests,
        args.policies,
        profile,
        args.workers,
        tier,
        ladder=args.ladder or LADDER,
        progress=show,
        slo_config=slo_config,
        pd=pd,
        routed_index=not args.engine_view,
    )
    peaks = {name: peak_tps(points) for name, points in results.items()}
    baselines = [v for k, v in peaks.items() if not k.startswith("smetric")]
    best = max(baselines, default=0.0)
    print(f"\n{'policy':<26} {'peak TPS under SLO':>19} {'vs best baseline':>17}")
    for name, peak in peaks.items():
        ratio = f"{peak / best:.3f}x" if best else "-"
        print(f"{name:<26} {peak:>19.0f} {ratio:>17}")
    if args.out:
        from smetric.workload.sweep import write_sweep

        if args.path:
            source = os.path.basename(args.path)
        elif args.trace == "generated":
            source = f"{len(requests)} requests, seed {args.seed}"
        else:
            source = "bundled tau-bench airline slice"
        name = f"{args.trace}: {source}" + (f", first {args.limit}" if args.limit else "")
        if args.closed_loop:
            name += ", closed loop"
        if args.copies > 1:
            name += f", x{args.copies} copies"
        if args.no_global_tier:
            name += ", no global tier"
        if args.engine_view:
            name += ", engine view"
        workload = {
            "name": name,
            "trace": args.trace,
            "path": args.path,
            "limit": args.limit,
            "requests": len(requests),
        }
        written = write_sweep(
            args.out,
            workload,
            requests,
            results,
            profile,
            args.workers,
            tier,
            slo_config,
            ladder=args.ladder or LADDER,
            pd=pd,
            routed_index=not args.engine_view,
        )
        print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
