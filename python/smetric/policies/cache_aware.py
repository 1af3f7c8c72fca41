from __future__ import annotations

from smetric.cluster import ClusterView, Decision
from smetric.policies import PolicyConfig
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
        # One pass: the in-flight spread, the least loaded worker (``least_loaded``'s order)
        # and the longest match (ties: the less loaded, then the first).
        c = self.config
        workers = cluster.workers
        if not workers:
            raise ValueError("cache_aware: no worker to choose from")
        w = workers[0]
        lo = hi = least_load = best_load = w.in_flight
        least_queued = w.queued_prefill_tokens
        best_hit = w.local_hit_blocks
        least = best = 0
        for i in range(1, len(workers)):
            w = workers[i]
            load = w.in_flight
            if load > hi:
                hi = load
            elif load < lo:
                lo = load
            if load < least_load or (load == least_load and w.queued_prefill_tokens < least_queued):
                least, least_load, least_queued = i, load, w.queued_prefill_tokens
            hit = w.local_hit_blocks
            if hit > best_hit or (hit == best_hit and load < best_load):
                best, best_hit, best_load = i, hit, load
        if hi - lo > c.balance_abs_threshold and hi > c.balance_rel_threshold * lo:
            return Decision(least, "imbalance_balance")
        if cluster.query_blocks and best_hit / cluster.query_blocks > c.cache_threshold:
            return Decision(best, "cache_hit")
        return Decision(least, "cache_miss_balance")
