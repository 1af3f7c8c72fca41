from __future__ import annotations

from smetric.cluster import ClusterView, Decision
from smetric.request import RequestView

GLOBAL_TIER_CREDIT = 0.5
"""Dynamo credits blocks found in a shared (HiCache / Mooncake) tier at half a local hit."""


class KvCost:
    """Dynamo's KV router cost: the lowest ``prefill_blocks x weight + decode_blocks``, where
    ``prefill_blocks`` are the prompt's blocks left after the overlap credit (1 for a local hit,
    0.5 for a global-tier hit) and ``decode_blocks`` the worker's active KV blocks."""

    name = "kv_cost"

    def __init__(self, config: object = None, overlap_weight: float = 1.0) -> None:
        self.overlap_weight = overlap_weight

    def select(self, req: RequestView, cluster: ClusterView) -> Decision:
        q, bt, found = cluster.query_blocks, cluster.block_tokens, cluster.global_hit_blocks
        weight = self.overlap_weight
        if not cluster.workers:
            raise ValueError("no worker to choose from")
        # The lowest cost, the first worker on a tie. A plain loop: it runs over every worker on
        # every request.
        best, best_cost = 0, 0.0
        # Fields read by name (see ``WorkerView``).
        for i, w in enumerate(cluster.workers):
            local = w.local_hit_blocks
            shared = found - local if found > local else 0
            prefill = q - local - GLOBAL_TIER_CREDIT * shared
            cost = prefill * weight + (w.queued_prefill_tokens + w.running_decode_tokens) / bt
            if i == 0 or cost < best_cost:
                best, best_cost = i, cost
        return Decision(best, "kv_cost")
