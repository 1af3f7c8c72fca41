from __future__ import annotations

from collections import OrderedDict

from smetric.cluster import ClusterView, Decision
from smetric.policies import least_loaded
from smetric.request import RequestView


class Sticky:
    """Session affinity: requests with the same session key (``X-SMG-Routing-Key`` or
    ``X-Session-ID``) go to the same worker; a new key, a key whose worker is gone, or no key
    goes to the least loaded. Remembers the most recent ``max_sessions`` keys."""

    name = "sticky"

    def __init__(self, config: object = None, max_sessions: int = 1_000_000) -> None:
        self.max_sessions = max_sessions
        self._owner: OrderedDict[str, str] = OrderedDict()

    def select(self, req: RequestView, cluster: ClusterView) -> Decision:
        key = req.session_key
        if key is None:
            return Decision(least_loaded(cluster), "no_session_key")
        url = self._owner.get(key)
        if url is not None:
            for i, w in enumerate(cluster.workers):
                if w.url == url:
                    self._owner.move_to_end(key)
                    return Decision(i, "session_affinity")
        i = least_loaded(cluster)
        self._owner[key] = cluster.workers[i].url
        self._owner.move_to_end(key)
        while len(self._owner) > self.max_sessions:
            self._owner.popitem(last=False)
        return Decision(i, "session_new" if url is None else "session_moved")
