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
        # Fields read by name (see ``WorkerView``); the uncached part worked out once per hit, as
        # most workers share a few (none, or a shared system prompt), and ``int`` of a float is
        # not cheap.
        uncached: dict[int, int] = {}
        for i, w in enumerate(cluster.workers):
            blocks, load = w.local_hit_blocks, w.in_flight
            rest = uncached.get(blocks)
            if rest is None:
                hit = int(blocks * block_tokens)
                rest = uncached[blocks] = prompt - (hit if hit < prompt else prompt)
            cost = (w.queued_prefill_tokens + rest) * (load + 1)
            if i == 0 or cost < best_cost or (cost == best_cost and load < best_load):
                best, best_cost, best_load = i, cost, load
        return Decision(best, "lmetric_cost")
