"""Routing policies: one module each, one protocol, one registry.

A policy is a pure function of the request view and a cluster snapshot (it may keep its own
state, such as a round-robin counter or a seeded random generator, but does no I/O), so the same
code runs in the router, the simulator and unit tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from smetric.cluster import ClusterView, Decision
from smetric.policies.smetric import SMetric, SMetricConfig
from smetric.request import RequestView


@dataclass(frozen=True)
class PolicyConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    seed: int = 0
    smetric: SMetricConfig = SMetricConfig()


class Policy(Protocol):
    name: str

    def select(self, req: RequestView, cluster: ClusterView) -> Decision:
        """Chooses a worker from a non-empty ``cluster``."""
        ...


def least_loaded(cluster: ClusterView, candidates: range | list[int] | None = None) -> int:
    """Fewest in-flight requests, then the least queued prefill (the first on ties)."""
    w = cluster.workers
    idx = range(len(w)) if candidates is None else candidates
    if not idx:
        raise ValueError("no worker to choose from")
    # Over every worker, on many requests: a plain loop, fields read by name (see WorkerView).
    best, best_load, best_queued = -1, 0, 0
    for i in idx:
        v = w[i]
        load, queued = v.in_flight, v.queued_prefill_tokens
        if best < 0 or load < best_load or (load == best_load and queued < best_queued):
            best, best_load, best_queued = i, load, queued
    return best


from smetric.policies.cache_aware import CacheAware  # noqa: E402
from smetric.policies.kv_cost import KvCost  # noqa: E402
from smetric.policies.least_load import LeastLoad  # noqa: E402
from smetric.policies.lmetric import LMetric  # noqa: E402
from smetric.policies.power_of_two import PowerOfTwo  # noqa: E402
from smetric.policies.random import Random  # noqa: E402
from smetric.policies.round_robin import RoundRobin  # noqa: E402
from smetric.policies.sticky import Sticky  # noqa: E402

POLICIES: dict[str, Callable[[PolicyConfig], Policy]] = {
    "smetric": SMetric,
    "round_robin": RoundRobin,
    "random": Random,
    "power_of_two": PowerOfTwo,
    "least_load": LeastLoad,
    "cache_aware": CacheAware,
    "lmetric": LMetric,
    "kv_cost": KvCost,
    "sticky": Sticky,
}


def make_policy(name: str, config: PolicyConfig | None = None) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    return factory(config or PolicyConfig())


__all__ = [
    "POLICIES",
    "Policy",
    "PolicyConfig",
    "SMetricConfig",
    "least_loaded",
    "make_policy",
]
