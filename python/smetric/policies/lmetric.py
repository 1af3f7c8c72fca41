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
        prompt = req.prompt_tokens
        hit = cluster.local_hit_tokens
        # The lowest cost, then the fewest requests, then the first worker.
        _, _, best = min(
            ((w.queued_prefill_tokens + prompt - hit(i, prompt)) * (w.in_flight + 1), load, i)
            for i, w in enumerate(cluster.workers)
            for load in (w.in_flight,)
        )
        return Decision(best, "lmetric_cost")
