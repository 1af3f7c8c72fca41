"""What a policy sees of the cluster: an immutable snapshot, one entry per eligible worker.

The router builds it from its own accounting (updated at dispatch, first token and finish) and
the loads it polls from workers; the simulator builds it from its engines. Either way, a policy
is a pure function of a ``RequestView`` and a ``ClusterView``.
"""

from __future__ import annotations

from typing import NamedTuple


class WorkerView(NamedTuple):
    """One worker as a policy sees it (a named tuple: built per worker per request, so cheap).

    Hot code builds it by position (`Worker.view`, with `tuple.__new__`: the named tuple's own
    constructor is a Python function) and reads a few fields by position (`Router._snapshot`): its
    fields keep this order (a test pins it). Policies read fields by name: unpacking a named
    tuple is several times slower than reading its fields (only a plain tuple's has a fast
    path)."""

    url: str
    in_flight: int = 0
    """Requests dispatched and not finished."""
    queued_prefill_tokens: int = 0
    """Uncached prompt tokens of dispatched requests whose first token has not come back."""
    running_decode_tokens: int = 0
    """Context tokens of requests that are decoding."""
    polled_running: int = 0
    polled_waiting: int = 0
    token_usage: float = 0.0
    local_hit_blocks: int = 0
    """Leading blocks of this request the worker holds (the prefix index's answer)."""


class ClusterView(NamedTuple):
    """The cluster for one request (a named tuple, as are ``WorkerView`` and ``Decision``:
    built for every request, and tuples build fastest)."""

    workers: tuple[WorkerView, ...]
    """Eligible workers only (healthy, circuit closed); a decision names an index into this."""
    global_hit_blocks: int = 0
    query_blocks: int = 0
    block_tokens: float = 16.0

    def local_hit_tokens(self, i: int, prompt_tokens: int) -> int:
        return min(int(self.workers[i].local_hit_blocks * self.block_tokens), prompt_tokens)


class Decision(NamedTuple):
    worker: int
    """Index into ``ClusterView.workers``."""
    reason: str
    predicted_ttft_s: float | None = None
    """The policy's TTFT prediction for the chosen worker, where it made one (for its online
    correction: the router reports what it observed through ``observe``)."""
    predicted_tpot_s: float | None = None
    """Likewise for TPOT (reported through ``observe_tpot``)."""
