"""The router's configuration and its command line, compatible with ``sglang_router.launch_router``.

Flags that mean something here take sglang-router's names and defaults, with three deliberate
differences, all toward safety: the router binds to 127.0.0.1 unless told otherwise (sglang-router
binds 0.0.0.0), loads are polled every 0.5 s (sglang-router: 30 s, which leaves power_of_two
blind), and Prometheus gets its own port only when ``--prometheus-port`` is given (``/metrics``
is always on the main port). Flags of sglang-router's that do not apply to this router (service
discovery, tokenizer caches, history backends, TLS, JWT, ...) are accepted and ignored with a
warning, so an existing command line keeps working after swapping the module name.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from smetric.perf import DEFAULT_PROFILE, load_profile
from smetric.policies import POLICIES
from smetric.request import BYTES_PER_TOKEN, TEXT_BLOCK_BYTES

log = logging.getLogger("smetric.router")

# sglang-router's policies, plus ours; "manual" and "bucket" have no counterpart here.
SGLANG_POLICY_ALIASES = {"manual": "sticky", "bucket": "least_load"}


@dataclass
class RouterConfig:
    worker_urls: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 30000
    policy: str = "smetric"
    prefill_policy: str | None = None
    decode_policy: str | None = None
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_secs: float = 60.0
    max_tree_size: int = 67_108_864
    """Cap on the blocks the prefix index holds per worker (sglang-router: tree size)."""
    pd_disaggregation: bool = False
    prefill: list[tuple[str, int | None]] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    request_timeout_secs: float = 1800.0
    shutdown_grace_secs: float = 25.0
    """On SIGINT or SIGTERM, how long requests in progress (streams too) may take to finish
    before the router stops anyway: within Kubernetes' default 30 s termination grace."""
    max_payload_size: int = 536_870_912
    retry_max_retries: int = 5
    retry_initial_backoff_ms: float = 50.0
    retry_max_backoff_ms: float = 30_000.0
    retry_backoff_multiplier: float = 1.5
    disable_retries: bool = False
    cb_failure_threshold: int = 10
    cb_success_threshold: int = 3
    cb_timeout_duration_secs: float = 60.0
    disable_circuit_breaker: bool = False
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    health_check_timeout_secs: float = 5.0
    health_check_interval_secs: float = 60.0
    health_check_endpoint: str = "/health"
    disable_health_check: bool = False
    worker_startup_timeout_secs: float = 1800.0
    load_poll_interval_secs: float = 0.5
    prometheus_port: int | None = None
    prometheus_host: str = "127.0.0.1"
    api_key: str | None = None
    log_level: str = "info"
    decision_header: bool = True
    request_id_headers: list[str] = field(
        default_factory=lambda: ["x-request-id", "x-correlation-id", "x-trace-id"]
    )
    data_plane: str = "rust"
    """Who carries the bytes: ``rust`` (tokio/hyper, Python only decides) or ``aiohttp``."""
    data_plane_threads: int = 1
    seed: int = 0
    profile: str = DEFAULT_PROFILE
    ttft_slo_scale: float = 5.0
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float = 100.0
    global_tier: bool = True
    slo_gate: bool = True
    migration: bool = True
    turn_detection: bool = True
    load_metric: str = "cost"
    global_tier_blocks: int = 4_000_000
    """Capacity of the modelled global tier, in 64-byte text blocks (~75 M tokens)."""

    @property
    def max_attempts(self) -> int:
        return 1 if self.disable_retries else max(self.retry_max_retries, 1)


IGNORED_FLAGS = {
    # flag: number of values it takes (None: zero or more)
    "--bucket-adjust-interval-secs": 1,
    "--max-idle-secs": 1,
    "--assignment-mode": 1,
    "--dp-aware": 0,
    "--enable-igw": 0,
    "--mini-lb": 0,
    "--worker-startup-check-interval": 1,
    "--log-dir": 1,
    "--service-discovery": 0,
    "--selector": None,
    "--service-discovery-port": 1,
    "--service-discovery-namespace": 1,
    "--prefill-selector": None,
    "--decode-selector": None,
    "--prometheus-duration-buckets": None,
    "--shutdown-grace-period-secs": 1,
    "--cors-allowed-origins": None,
    "--max-concurrent-requests": 1,
    "--queue-size": 1,
    "--queue-timeout-secs": 1,
    "--rate-limit-tokens-per-second": 1,
    "--retry-jitter-factor": 1,
    "--cb-window-duration-secs": 1,
    "--model-path": 1,
    "--tokenizer-path": 1,
    "--chat-template": 1,
    "--tokenizer-cache-enable-l0": 0,
    "--tokenizer-cache-l0-max-entries": 1,
    "--tokenizer-cache-enable-l1": 0,
    "--tokenizer-cache-l1-max-memory": 1,
    "--reasoning-parser": 1,
    "--tool-call-parser": 1,
    "--mcp-config-path": 1,
    "--backend": 1,
    "--history-backend": 1,
    "--oracle-wallet-path": 1,
    "--oracle-tns-alias": 1,
    "--oracle-connect-descriptor": 1,
    "--oracle-username": 1,
    "--oracle-password": 1,
    "--oracle-pool-min": 1,
    "--oracle-pool-max": 1,
    "--oracle-pool-timeout-secs": 1,
    "--postgres-db-url": 1,
    "--postgres-pool-max": 1,
    "--redis-url": 1,
    "--redis-pool-max": 1,
    "--redis-retention-days": 1,
    "--client-cert-path": 1,
    "--client-key-path": 1,
    "--ca-cert-paths": None,
    "--tls-cert-path": 1,
    "--tls-key-path": 1,
    "--enable-trace": 0,
    "--otlp-traces-endpoint": 1,
    "--control-plane-api-keys": None,
    "--control-plane-audit-enabled": 0,
    "--jwt-issuer": 1,
    "--jwt-audience": 1,
    "--jwt-jwks-uri": 1,
    "--jwt-role-mapping": None,
}


def _number(kind: Callable[[str], float], strictly_positive: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < 0 or (strictly_positive and value == 0):
            bound = "> 0" if strictly_positive else ">= 0"
            raise argparse.ArgumentTypeError(f"must be {bound}: {text!r}")
        return value

    return parse


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}")
    return value


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")) or len(text) < 10:
        raise argparse.ArgumentTypeError(f"not a worker URL (http://host:port): {text!r}")
    return text.rstrip("/")


def build_parser(prog: str = "smetric serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="smetric router: a drop-in for sglang_router.launch_router, with the "
        "SMetric policy and sglang-router's own policies.",
    )
    pos_f, nonneg_f, pos_i, nonneg_i = (
        _number(float, True),
        _number(float, False),
        _number(int, True),
        _number(int, False),
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; sglang-router binds 0.0.0.0)",
    )
    p.add_argument("--port", type=_port, default=30000)
    p.add_argument("--worker-urls", nargs="*", type=_url, default=[])
    names = sorted({*POLICIES, *SGLANG_POLICY_ALIASES})
    p.add_argument(
        "--policy",
        choices=names,
        default="smetric",
        help="routing policy (default smetric; sglang-router's default is cache_aware)",
    )
    p.add_argument("--prefill-policy", choices=names, default=None)
    p.add_argument("--decode-policy", choices=names, default=None)
    p.add_argument("--cache-threshold", type=nonneg_f, default=0.3)
    p.add_argument("--balance-abs-threshold", type=nonneg_i, default=64)
    p.add_argument("--balance-rel-threshold", type=pos_f, default=1.5)
    p.add_argument("--eviction-interval-secs", type=pos_f, default=60.0)
    p.add_argument("--max-tree-size", type=pos_i, default=67_108_864)
    p.add_argument("--max-payload-size", type=pos_i, default=536_870_912)
    p.add_argument("--pd-disaggregation", action="store_true")
    p.add_argument(
        "--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT")
    )
    p.add_argument("--decode", action="append", type=_url, default=[], metavar="URL")
    p.add_argument("--worker-startup-timeout-secs", type=nonneg_f, default=1800.0)
    p.add_argument("--log-level", choices=["debug", "info", "warn", "error"], default="info")
    p.add_argument("--prometheus-port", type=_port, default=None)
    p.add_argument("--prometheus-host", default="127.0.0.1")
    p.add_argument("--request-id-headers", nargs="*", default=None)
    p.add_argument("--request-timeout-secs", type=pos_f, default=1800.0)
    p.add_argument(
        "--shutdown-grace-secs",
        type=nonneg_f,
        default=25.0,
        help="on SIGINT/SIGTERM, stop accepting and let requests in progress finish for up to "
        "this long (default 25, within Kubernetes' 30 s termination grace)",
    )
    p.add_argument("--retry-max-retries", type=pos_i, default=5)
    p.add_argument("--retry-initial-backoff-ms", type=nonneg_f, default=50.0)
    p.add_argument("--retry-max-backoff-ms", type=nonneg_f, default=30_000.0)
    p.add_argument("--retry-backoff-multiplier", type=pos_f, default=1.5)
    p.add_argument("--disable-retries", action="store_true")
    p.add_argument("--cb-failure-threshold", type=pos_i, default=10)
    p.add_argument("--cb-success-threshold", type=pos_i, default=3)
    p.add_argument("--cb-timeout-duration-secs", type=nonneg_f, default=60.0)
    p.add_argument("--disable-circuit-breaker", action="store_true")
    p.add_argument("--health-failure-threshold", type=pos_i, default=3)
    p.add_argument("--health-success-threshold", type=pos_i, default=2)
    p.add_argument("--health-check-timeout-secs", type=pos_f, default=5.0)
    p.add_argument("--health-check-interval-secs", type=pos_f, default=60.0)
    p.add_argument("--health-check-endpoint", default="/health")
    p.add_argument("--disable-health-check", action="store_true")
    p.add_argument("--api-key", default=None, help="guards the admin endpoints")
    g = p.add_argument_group("smetric only")
    g.add_argument(
        "--load-poll-interval-secs",
        type=pos_f,
        default=0.5,
        help="how often worker loads are polled (default 0.5)",
    )
    g.add_argument(
        "--no-decision-header",
        action="store_true",
        help="do not name the chosen worker and reason in response headers",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the random policies")
    g.add_argument(
        "--data-plane",
        choices=["rust", "aiohttp"],
        default="rust",
        help="what carries requests and responses: rust (default: a tokio/hyper server and "
        "client; Python keeps the decisions and the accounting) or aiohttp (all in Python)",
    )
    g.add_argument(
        "--data-plane-threads",
        type=pos_i,
        default=1,
        help="threads of the rust data plane (default 1: the decisions run one at a time under "
        "Python's GIL anyway, and one thread saves the hand-overs between threads; more can help "
        "with large bodies on many cores)",
    )
    g.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help="performance profile of the workers for the SLO model: a preset or a "
        "profile JSON file",
    )
    g.add_argument(
        "--ttft-slo-scale",
        type=pos_f,
        default=5.0,
        help="TTFT SLO = this x the request's TTFT on an idle instance (default 5)",
    )
    g.add_argument("--ttft-slo-ms", type=pos_f, default=None, help="an absolute TTFT SLO")
    g.add_argument("--tpot-slo-ms", type=pos_f, default=100.0, help="TPOT SLO (default 100)")
    g.add_argument(
        "--global-tier-capacity-tokens",
        type=pos_i,
        default=75_000_000,
        help="capacity of the global tier the index models (default 75 M tokens)",
    )
    g.add_argument(
        "--no-global-tier",
        action="store_true",
        help="the workers share no global KV tier (a migration recomputes)",
    )
    g.add_argument("--no-slo-gate", action="store_true", help="ablation: follow-ups always stick")
    g.add_argument(
        "--no-migration",
        action="store_true",
        help="ablation: stick even when the SLO would be missed",
    )
    g.add_argument(
        "--no-turn-detection",
        action="store_true",
        help="ablation: every request is a follow-up (hit only)",
    )
    g.add_argument(
        "--load-metric",
        choices=["cost", "delay", "requests"],
        default="cost",
        help="how SMetric measures load: cost (default: predicted TTFT there x the requests it "
        "would delay), or the ablations delay (predicted queueing delay) and requests",
    )
    for flag, nargs in IGNORED_FLAGS.items():
        kw: dict[str, object] = {"help": argparse.SUPPRESS, "default": None}
        if nargs == 0:
            kw["action"] = "store_true"
        elif nargs is None:
            kw["nargs"] = "*"
        p.add_argument(flag, **kw)  # type: ignore[arg-type]
    return p


def _policy(name: str | None) -> str | None:
    return None if name is None else SGLANG_POLICY_ALIASES.get(name, name)


def parse_config(argv: list[str] | None = None, prog: str = "smetric serve") -> RouterConfig:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    for flag in IGNORED_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value not in (None, False):
            log.warning("flag %s has no effect in smetric; ignored", flag)
    prefill: list[tuple[str, int | None]] = []
    for entry in args.prefill:
        if len(entry) > 2:
            parser.error(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(entry)}")
        try:
            url = _url(entry[0])
        except argparse.ArgumentTypeError as e:
            parser.error(f"--prefill: {e}")
        port: int | None = None
        if len(entry) == 2 and entry[1].lower() != "none":
            try:
                port = _port(entry[1])
            except argparse.ArgumentTypeError as e:
                parser.error(f"--prefill bootstrap port: {e}")
        prefill.append((url, port))
    if args.pd_disaggregation and (not prefill or not args.decode):
        parser.error("--pd-disaggregation needs at least one --prefill and one --decode")
    if not args.pd_disaggregation and (prefill or args.decode):
        parser.error("--prefill / --decode need --pd-disaggregation")
    config = RouterConfig(
        worker_urls=list(args.worker_urls),
        host=args.host,
        port=args.port,
        policy=_policy(args.policy) or "smetric",
        prefill_policy=_policy(args.prefill_policy),
        decode_policy=_policy(args.decode_policy),
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        eviction_interval_secs=args.eviction_interval_secs,
        max_tree_size=args.max_tree_size,
        pd_disaggregation=args.pd_disaggregation,
        prefill=prefill,
        decode=list(args.decode),
        request_timeout_secs=args.request_timeout_secs,
        shutdown_grace_secs=args.shutdown_grace_secs,
        max_payload_size=args.max_payload_size,
        retry_max_retries=args.retry_max_retries,
        retry_initial_backoff_ms=args.retry_initial_backoff_ms,
        retry_max_backoff_ms=args.retry_max_backoff_ms,
        retry_backoff_multiplier=args.retry_backoff_multiplier,
        disable_retries=args.disable_retries,
        cb_failure_threshold=args.cb_failure_threshold,
        cb_success_threshold=args.cb_success_threshold,
        cb_timeout_duration_secs=args.cb_timeout_duration_secs,
        disable_circuit_breaker=args.disable_circuit_breaker,
        health_failure_threshold=args.health_failure_threshold,
        health_success_threshold=args.health_success_threshold,
        health_check_timeout_secs=args.health_check_timeout_secs,
        health_check_interval_secs=args.health_check_interval_secs,
        health_check_endpoint=args.health_check_endpoint,
        disable_health_check=args.disable_health_check,
        worker_startup_timeout_secs=args.worker_startup_timeout_secs,
        load_poll_interval_secs=args.load_poll_interval_secs,
        prometheus_port=args.prometheus_port,
        prometheus_host=args.prometheus_host,
        api_key=args.api_key,
        log_level=args.log_level,
        decision_header=not args.no_decision_header,
        seed=args.seed,
        data_plane=args.data_plane,
        data_plane_threads=args.data_plane_threads,
        profile=args.profile,
        ttft_slo_scale=args.ttft_slo_scale,
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
        global_tier=not args.no_global_tier,
        global_tier_blocks=int(
            args.global_tier_capacity_tokens * BYTES_PER_TOKEN / TEXT_BLOCK_BYTES
        ),
        slo_gate=not args.no_slo_gate,
        migration=not args.no_migration,
        turn_detection=not args.no_turn_detection,
        load_metric=args.load_metric,
    )
    try:
        load_profile(config.profile)
    except ValueError as e:
        parser.error(f"--profile: {e}")
    if args.request_id_headers:
        config.request_id_headers = [h.lower() for h in args.request_id_headers]
    return config
