"""Session structure shared by the trace loaders: who follows whom, open or closed loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from smetric.perf import Profile
from smetric.sim import SimRequest

ServiceTime = Callable[[SimRequest], float]
"""An estimate of how long a request took to serve (arrival to last token), in seconds."""


def idle_service_time(profile: Profile) -> ServiceTime:
    """A request's service time alone on an idle instance with nothing cached: its prefill plus
    one decode step per output token at half its final context (the mean over the decode)."""
    from smetric.slo import SLOModel

    slo = SLOModel(profile)

    def estimate(r: SimRequest) -> float:
        decode = r.output_tokens * profile.decode_step_s(1, r.prompt_tokens + r.output_tokens // 2)
        return slo.idle_ttft_s(r.prompt_tokens) + decode

    return estimate


def link_turns(
    requests: Sequence[SimRequest],
    parents: Sequence[int | None],
    closed_loop: bool = False,
    service_time_s: ServiceTime | None = None,
) -> list[SimRequest]:
    """``requests`` (each with its trace arrival time) with their session structure:
    ``parents[i]`` is the index of request i's previous turn, or None for a first turn.
    Each request gets ``session`` = its root's rid and ``is_first_turn``.

    Open loop (default) keeps every trace arrival time. Closed loop releases a follow-up
    ``delay_s`` after its parent finishes in the replay, where ``delay_s`` = the trace's gap
    between the two arrivals minus the parent's ``service_time_s`` (floored at 0): the trace's
    gap is the parent's service plus the user's think time, and only the think time belongs to
    the user. So on an idle cluster a closed-loop replay arrives as the trace did, and under load
    follow-ups wait for slow answers as real users do. Without an estimate the whole gap counts
    as think time (an upper bound)."""
    if len(parents) != len(requests):
        raise ValueError("one parent entry per request")
    roots: list[int] = []
    for i, p in enumerate(parents):
        if p is not None and not 0 <= p < i:
            raise ValueError(f"request {requests[i].rid}: its parent must come before it")
        roots.append(i if p is None else roots[p])
    out = []
    for i, (r, p) in enumerate(zip(requests, parents, strict=True)):
        linked = replace(r, session=requests[roots[i]].rid, is_first_turn=p is None)
        if closed_loop and p is not None:
            parent = requests[p]
            if r.arrival_s is None or parent.arrival_s is None:
                raise ValueError(f"request {r.rid}: closed loop needs trace arrival times")
            service = service_time_s(parent) if service_time_s else 0.0
            linked = replace(
                linked,
                arrival_s=None,
                after=parent.rid,
                delay_s=max(0.0, r.arrival_s - parent.arrival_s - service),
            )
        out.append(linked)
    return out
