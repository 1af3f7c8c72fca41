"""Workers as the router knows them: health, circuit breaker, and load accounting."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from smetric.cluster import WorkerView

_VIEW_FIELDS = frozenset(WorkerView._fields) - {"local_hit_blocks"}
"""The worker's fields a ``WorkerView`` shows (all but the request's hit): setting one drops
the cached view."""
_ROTATION_FIELDS = frozenset(("role", "healthy", "removed", "opened_at"))
"""The fields that decide whether a worker is eligible: setting one counts a rotation change."""
_new_tuple = tuple.__new__


@dataclass
class Worker:
    url: str
    role: str = "regular"
    """``regular``, ``prefill`` or ``decode``."""
    bootstrap_port: int | None = None
    healthy: bool = True
    model: str | None = None
    max_total_tokens: int | None = None
    time_scale: float = 1.0
    """How much faster than real time the worker runs (an emulated worker says so in
    ``/server_info``): its latencies are compared with the SLO model in its own time."""

    # Health checks: consecutive results.
    health_failures: int = 0
    health_successes: int = 0
    # Circuit breaker: opens after consecutive request failures, half-opens after a timeout.
    failures: int = 0
    half_open_successes: int = 0
    opened_at: float | None = None

    # The router's own accounting, updated at dispatch, first token and finish.
    in_flight: int = 0
    queued_prefill_tokens: int = 0
    prefill_since: float = 0.0
    """When the worker began the prefill at the head of its queue (dispatch to an empty queue,
    or the last first token), on the monotonic clock."""
    running_decode_tokens: int = 0
    # What the worker last reported (/v1/loads or /get_load).
    polled_running: int = 0
    polled_waiting: int = 0
    token_usage: float = 0.0

    requests_total: int = 0
    errors_total: int = 0
    removed: bool = False
    id: str = field(init=False)
    index_slot: int = field(default=-1, init=False, repr=False, compare=False)
    """The worker's position in the prefix index's ``instances()``, which is where its hit is in
    a match (the router sets it as workers come and go)."""
    _view: WorkerView | None = field(default=None, init=False, repr=False, compare=False)
    """The last view handed out; a policy sees every worker on every request, and most of them
    have not changed since."""
    rotation_changes: ClassVar[int] = 0
    """Changes, to any worker, of a field that decides whether it is eligible."""

    def __post_init__(self) -> None:
        self.id = "w-" + hashlib.sha1(self.url.encode()).hexdigest()[:10]

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _VIEW_FIELDS:
            self.__dict__["_view"] = None
        elif name in _ROTATION_FIELDS:
            Worker.rotation_changes += 1

    # ---- the router's accounting (hot: each writes its fields at once, and drops the view) --

    def dispatched(self, uncached_tokens: int) -> None:
        """A request went to the worker, with this much prefill to do."""
        d = self.__dict__
        if d["queued_prefill_tokens"] <= 0:
            d["prefill_since"] = time.monotonic()
        d["in_flight"] += 1
        d["requests_total"] += 1
        d["queued_prefill_tokens"] += uncached_tokens
        d["_view"] = None

    def prefilled(
        self,
        uncached_tokens: int,
        prompt_tokens: int,
        prefill_tokens_per_s: float = 0.0,
        chunk_tokens: int = 0,
        now: float | None = None,
    ) -> None:
        """A request's first token came: its prefill is done and it decodes, and the next
        queued prefill has begun. Chunked prefill filled the iteration that finished it up to a
        chunk with the next ones in the queue, so what the worker got through since
        ``prefill_since`` (at the given rate) beyond this request's tokens is a head start on
        them. More than a chunk beyond says the progress estimate ran ahead of this request
        instead (a long cached context makes its prefill slower than the rate): none then.
        ``now``: when the first token came, on the monotonic clock (default: now)."""
        d = self.__dict__
        if now is None:
            now = time.monotonic()
        queued = d["queued_prefill_tokens"] - uncached_tokens
        d["queued_prefill_tokens"] = queued
        rate = d["time_scale"] * prefill_tokens_per_s
        ahead = (now - d["prefill_since"]) * rate - uncached_tokens if queued > 0 else 0.0
        d["prefill_since"] = now - min(ahead, queued) / rate if 0 < ahead < chunk_tokens else now
        d["running_decode_tokens"] += prompt_tokens
        d["_view"] = None

    def finished(self, prefilled: bool, uncached_tokens: int, prompt_tokens: int) -> None:
        """A request left the worker, decoding (``prefilled``) or still queued for prefill."""
        d = self.__dict__
        d["in_flight"] -= 1
        if prefilled:
            d["running_decode_tokens"] -= prompt_tokens
        else:
            d["queued_prefill_tokens"] -= uncached_tokens
        d["_view"] = None

    # ---- circuit breaker -----------------------------------------------------------------

    def circuit_open(self, now: float, timeout_s: float) -> bool:
        if self.opened_at is None:
            return False
        return now - self.opened_at < timeout_s  # after the timeout: half-open, may be tried

    def eligible(self, now: float, cb_timeout_s: float) -> bool:
        # Asked of every worker on every request: the closed circuit is decided without a call.
        return (
            self.healthy
            and not self.removed
            and (self.opened_at is None or not self.circuit_open(now, cb_timeout_s))
        )

    def record_failure(self, threshold: int, enabled: bool) -> None:
        self.errors_total += 1
        self.failures += 1
        self.half_open_successes = 0
        if enabled and (self.failures >= threshold or self.opened_at is not None):
            self.opened_at = time.monotonic()

    def record_success(self, success_threshold: int) -> None:
        if self.failures:
            self.failures = 0
        if self.opened_at is not None:
            self.half_open_successes += 1
            if self.half_open_successes >= success_threshold:
                self.opened_at = None
                self.half_open_successes = 0

    # ---- the view policies get -----------------------------------------------------------

    def view(
        self, local_hit_blocks: int, now: float = 0.0, prefill_tokens_per_s: float = 0.0
    ) -> WorkerView:
        """The worker as a policy sees it, built again only when its load or the hit changed;
        with a prefill rate, its queued prefill less what it has got through meanwhile.
        (``Router._snapshot`` takes the kept view itself where it holds as it is, without this
        call: a change to when it holds must be made there too.)"""
        d = self.__dict__
        v: WorkerView | None = d["_view"]
        if v is None:
            # Own accounting is instant; what the worker reports also counts traffic that did
            # not come through this router. The larger of the two is the better guess.
            # (Built as a plain tuple of the named tuple's type, in its field order: the named
            # tuple's own constructor is a Python function.)
            running, waiting = d["polled_running"], d["polled_waiting"]
            v = d["_view"] = _new_tuple(
                WorkerView,
                (
                    d["url"],
                    max(d["in_flight"], running + waiting),
                    d["queued_prefill_tokens"],
                    d["running_decode_tokens"],
                    running,
                    waiting,
                    d["token_usage"],
                    local_hit_blocks,
                ),
            )
        elif v[7] != local_hit_blocks:  # the hit, the view's last field
            v = d["_view"] = _new_tuple(WorkerView, (*v[:7], local_hit_blocks))
        queued = v[2]  # queued_prefill_tokens
        if queued > 0 and prefill_tokens_per_s > 0:
            # Queued prefill leaves only at a first token, but the worker has been at it since
            # ``prefill_since``: count what it has got through meanwhile as done (a fresh tuple:
            # this part changes with the clock, so it is not kept).
            done = (now - d["prefill_since"]) * d["time_scale"] * prefill_tokens_per_s
            v = _new_tuple(WorkerView, (v[0], v[1], max(queued - round(done), 0), *v[3:]))
        return v

    def describe(self) -> dict[str, object]:
        return {
            "id": self.id,
            "url": self.url,
            "worker_type": self.role,
            "bootstrap_port": self.bootstrap_port,
            "is_healthy": self.healthy,
            "circuit_open": self.opened_at is not None,
            "model_id": self.model,
            "load": self.in_flight,
            "queued_prefill_tokens": self.queued_prefill_tokens,
            "running_decode_tokens": self.running_decode_tokens,
        }
