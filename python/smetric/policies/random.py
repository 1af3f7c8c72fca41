from __future__ import annotations

import random

from smetric.cluster import ClusterView, Decision
from smetric.request import RequestView


class Random:
    """A uniformly random eligible worker (seeded)."""

    name = "random"

    def __init__(self, config: object = None) -> None:
        self._rng = random.Random(getattr(config, "seed", 0))

    def select(self, req: RequestView, cluster: ClusterView) -> Decision:
        return Decision(self._rng.randrange(len(cluster.workers)), "random")
