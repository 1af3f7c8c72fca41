from __future__ import annotations

import random

from smetric.cluster import ClusterView, Decision
from smetric.policies import least_loaded
from smetric.request import RequestView


class PowerOfTwo:
    """The less loaded of two random workers (in-flight requests, then queued prefill)."""

    name = "power_of_two"

    def __init__(self, config: object = None) -> None:
        self._rng = random.Random(getattr(config, "seed", 0))

    def select(self, req: RequestView, cluster: ClusterView) -> Decision:
        n = len(cluster.workers)
        if n == 1:
            return Decision(0, "only_worker")
        pair = self._rng.sample(range(n), 2)
        return Decision(least_loaded(cluster, pair), "power_of_two")
