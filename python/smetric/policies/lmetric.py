from __future__ import annotations

from smetric.cluster import ClusterView, Decision
from smetric.request import RequestView


class LMetric:
    """LMetric (arXiv 2603.15202): the lowest ``prefill_tokens x (bs + 1)``, where
    ``prefill_tokens`` is the prefill already queued on the worker plus this request's tokens the
    worker does not hold, and ``bs`` its running and queued requests."""

    name = "lmetric"

    def __init__(self, config: object = None) -> None:
        pass

    def select(self, req: RequestView, cluster: ClusterView) -> Decision:
        def cost(i: int) -> tuple[float, int]:
            w = cluster.workers[i]
            uncached = req.prompt_tokens - cluster.local_hit_tokens(i, req.prompt_tokens)
            return ((w.queued_prefill_tokens + uncached) * (w.in_flight + 1), w.in_flight)

        return Decision(min(range(len(cluster.workers)), key=cost), "lmetric_cost")
