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
        prompt, block_tokens = req.prompt_tokens, cluster.block_tokens
        # The lowest cost, then the fewest requests, then the first worker. A plain loop: it
        # runs over every worker on every request (``ClusterView.local_hit_tokens`` inline).
        if not cluster.workers:
            raise ValueError("no worker to choose from")
        best, best_cost, best_load = 0, 0, 0
        # Unpacked rather than read by name: WorkerView's fields, in order.
        for i, (_, load, queued, _, _, _, _, blocks) in enumerate(cluster.workers):
            hit = int(blocks * block_tokens)
            cost = (queued + prompt - (hit if hit < prompt else prompt)) * (load + 1)
            if i == 0 or cost < best_cost or (cost == best_cost and load < best_load):
                best, best_cost, best_load = i, cost, load
        return Decision(best, "lmetric_cost")
