from __future__ import annotations

from smetric.cluster import ClusterView, Decision
from smetric.policies import least_loaded
from smetric.request import RequestView


class LeastLoad:
    """Fewest in-flight requests, then the least queued prefill."""

    name = "least_load"

    def __init__(self, config: object = None) -> None:
        pass

    def select(self, req: RequestView, cluster: ClusterView) -> Decision:
        return Decision(least_loaded(cluster), "least_load")
