from __future__ import annotations

from smetric.cluster import ClusterView, Decision
from smetric.request import RequestView


class RoundRobin:
    """Each eligible worker in turn."""

    name = "round_robin"

    def __init__(self, config: object = None) -> None:
        self._next = 0

    def select(self, req: RequestView, cluster: ClusterView) -> Decision:
        i = self._next % len(cluster.workers)
        self._next += 1
        return Decision(i, "round_robin")
