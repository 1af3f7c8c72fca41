from __future__ import annotations

from smetric.cluster import ClusterView, Decision
from smetric.policies import PolicyConfig, least_loaded
from smetric.request import RequestView


class CacheAware:
    """sglang-router 0.3.2's ``cache_aware``: when the load is imbalanced (max - min in-flight >
    ``balance_abs_threshold`` and max > ``balance_rel_threshold`` x min), the least loaded
    worker; else the worker with the longest prefix match if the match covers more than
    ``cache_threshold`` of the prompt; else the least loaded. (sglang-router matches characters
    in its own tree; here the match is over the index's blocks.)"""

    name = "cache_aware"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()

    def select(self, req: RequestView, cluster: ClusterView) -> Decision:
        c = self.config
        loads = [w.in_flight for w in cluster.workers]
        if max(loads) - min(loads) > c.balance_abs_threshold and max(loads) > (
            c.balance_rel_threshold * min(loads)
        ):
            return Decision(least_loaded(cluster), "imbalance_balance")
        hits = [w.local_hit_blocks for w in cluster.workers]
        best = max(range(len(hits)), key=lambda i: (hits[i], -loads[i]))
        if cluster.query_blocks and hits[best] / cluster.query_blocks > c.cache_threshold:
            return Decision(best, "cache_hit")
        return Decision(least_loaded(cluster), "cache_miss_balance")
