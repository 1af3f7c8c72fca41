"""Emulated SGLang workers: many in one process, sharing one global KV tier."""

from __future__ import annotations

import contextlib

from aiohttp import web

from smetric.emulator.worker import EmulatedWorker, Fault, PDRendezvous, ScaledClock
from smetric.engine import Cluster, EngineConfig, GlobalTierConfig
from smetric.perf import Profile

STOP_GRACE_S = 1.0
"""How long stopping waits for requests still in flight before it cancels them."""


class EmulatedCluster:
    """``workers`` colocated workers, or with ``pd=(p, d)`` p prefill and d decode workers, on
    consecutive ports from ``base_port`` (0: any free port each)."""

    def __init__(
        self,
        profile: Profile,
        workers: int = 4,
        base_port: int = 0,
        host: str = "127.0.0.1",
        time_scale: float = 1.0,
        config: EngineConfig = EngineConfig(),
        global_tier: GlobalTierConfig | None = GlobalTierConfig(),
        pd: tuple[int, int] | None = None,
        model_name: str = "default",
        pd_timeout_s: float = 30.0,
    ) -> None:
        self.host = host
        self.base_port = base_port
        self.clock = ScaledClock(time_scale)
        self.cluster = Cluster(global_tier)
        rendezvous = PDRendezvous(pd_timeout_s)
        roles = ["mixed"] * workers if pd is None else ["prefill"] * pd[0] + ["decode"] * pd[1]
        self.workers = [
            EmulatedWorker(
                f"{role[0] if pd else 'w'}{i}",
                profile,
                self.cluster,
                self.clock,
                config,
                role,
                model_name,
                rendezvous=rendezvous,
            )
            for i, role in enumerate(roles)
        ]
        self._runners: list[web.AppRunner] = []
        self.urls: list[str] = []

    async def start(self) -> list[str]:
        for i, worker in enumerate(self.workers):
            # On stop the engines stop first, so a request still in flight can never finish:
            # its handler is cancelled after a second rather than aiohttp's default minute.
            runner = web.AppRunner(
                worker.app(),
                access_log=None,
                handler_cancellation=True,
                shutdown_timeout=STOP_GRACE_S,
            )
            await runner.setup()
            port = self.base_port + i if self.base_port else 0
            site = web.TCPSite(runner, self.host, port)
            await site.start()
            actual = int(runner.addresses[-1][1])
            worker.port = actual
            worker.start()
            self._runners.append(runner)
            self.urls.append(f"http://{self.host}:{actual}")
        return self.urls

    async def stop(self) -> None:
        for worker in self.workers:
            await worker.stop()
        for runner in self._runners:
            with contextlib.suppress(Exception):
                await runner.cleanup()
        self._runners.clear()


__all__ = ["EmulatedCluster", "EmulatedWorker", "Fault", "ScaledClock"]
