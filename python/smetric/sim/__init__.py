"""The simulator: the engine model on a virtual clock, driven by an event queue.

``simulate`` replays requests (each arriving at a time, or after an earlier request finished plus
a delay, as an agent's next turn does) on a cluster of engines, routing each with a function of
the request and the cluster state, and returns per-request latencies and cache hits and
per-instance load over time.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from smetric import GLOBAL_TIER, BlockKeys, PrefixIndex
from smetric.cluster import ClusterView, WorkerView
from smetric.engine import (
    Batch,
    Cluster,
    Engine,
    EngineConfig,
    EngineRequest,
    GlobalTierConfig,
    RequestTooLarge,
    WorkerLoad,
)
from smetric.perf import Profile
from smetric.policies import Policy
from smetric.request import PromptKey, RequestView


@dataclass
class SimRequest:
    rid: str
    prompt_tokens: int
    output_tokens: int
    keys: BlockKeys
    block_tokens: float
    arrival_s: float | None = None
    """Open-loop arrival time; None when the request follows ``after``."""
    after: str | None = None
    """The request whose completion releases this one (the previous turn)."""
    delay_s: float = 0.0
    """Think / tool time between ``after`` finishing and this request arriving."""
    session: str | None = None
    is_first_turn: bool | None = None
    """None where the trace cannot tell (raw prompts): policies then judge from the hit."""


@dataclass(frozen=True)
class RequestResult:
    rid: str
    worker: str
    arrival_s: float
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    prompt_tokens: int
    output_tokens: int
    local_cached_tokens: int
    global_cached_tokens: int
    session: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class LoadSample:
    t_s: float
    running: int
    waiting: int
    used_tokens: int
    queued_prefill_tokens: int


@dataclass
class SimResult:
    requests: list[RequestResult]
    load: dict[str, list[LoadSample]]
    makespan_s: float
    cpu_s: float
    iterations: int
    decisions: dict[str, int]
    """Routing decisions by reason (policies run through ``policy_route``)."""

    def ok(self) -> list[RequestResult]:
        return [r for r in self.requests if r.error is None]


class ClusterState:
    """What a routing function sees: worker names, their loads, the shared prefix index."""

    def __init__(self, engines: dict[str, Engine], index: PrefixIndex) -> None:
        self._engines = engines
        self.workers = list(engines)
        self.index = index
        self.decisions: dict[str, int] = {}
        """Decisions by reason, for policies run through ``policy_route``."""

    def load(self, worker: str) -> WorkerLoad:
        return self._engines[worker].load()


Route = Callable[[SimRequest, ClusterState], str]


def policy_route(
    policy: Policy, max_new_tokens: int | None = None, routed_index: bool = False
) -> Route:
    """Runs a router policy, unchanged, in the simulator: the request becomes a ``RequestView``
    and the engines' loads plus the index's match become the ``ClusterView`` it decides on (the
    simulator knows each engine's queued prefill exactly, where the router estimates it).

    The hits come from what the engines hold (``routed_index=False``), or, as the router sees
    them, from an index that learns by prediction: a prompt counts as held by its worker and the
    global tier from the moment it is routed there, before it is served, with each worker's pool
    as its capacity (``routed_index=True``). The two differ most for requests that share a
    prefix and arrive together: the engines hold it only once one has been prefilled."""
    routed: dict[int, PrefixIndex] = {}

    def hits_index(req: SimRequest, state: ClusterState) -> PrefixIndex:
        if not routed_index:
            return state.index
        index = routed.get(id(state))
        if index is None:
            routed.clear()  # a new run
            tier = state.index.has_global_tier
            index = PrefixIndex(global_capacity_blocks=1 << 40 if tier else None)
            for name in state.workers:
                pool = state.load(name).pool_tokens
                index.add_instance(name, max(int(pool / max(req.block_tokens, 1e-9)), 1))
            routed[id(state)] = index
        return index

    def route(req: SimRequest, state: ClusterState) -> str:
        key = PromptKey(req.keys, req.prompt_tokens, req.block_tokens)
        view = RequestView(
            "chat",
            key,
            max_new_tokens or req.output_tokens,
            False,
            req.session,
            req.is_first_turn,
        )
        index = hits_index(req, state)
        match = index.match(req.keys, touch=False)
        hits = dict(zip(index.instances(), match.blocks, strict=True))
        workers = []
        for name in state.workers:
            load = state.load(name)
            workers.append(
                WorkerView(
                    name,
                    load.running + load.waiting,
                    load.queued_prefill_tokens,
                    load.decode_context_tokens,
                    load.running,
                    load.waiting,
                    load.used_tokens / load.pool_tokens if load.pool_tokens else 0.0,
                    hits.get(name, 0),
                )
            )
        cluster = ClusterView(tuple(workers), match.global_blocks, len(req.keys), req.block_tokens)
        decision = policy.select(view, cluster)
        state.decisions[decision.reason] = state.decisions.get(decision.reason, 0) + 1
        chosen = state.workers[decision.worker]
        if routed_index:
            index.insert(chosen, req.keys)
            if index.has_global_tier:
                index.insert(GLOBAL_TIER, req.keys)
        return chosen

    return route


def least_loaded(req: SimRequest, state: ClusterState) -> str:
    """Fewest running + waiting requests, then the least queued prefill."""

    def key(w: str) -> tuple[int, int]:
        load = state.load(w)
        return (load.running + load.waiting, load.queued_prefill_tokens)

    return min(state.workers, key=key)


def round_robin() -> Route:
    counter = itertools.count()
    return lambda req, state: state.workers[next(counter) % len(state.workers)]


_ARRIVE, _ITER_END, _HANDOFF = 0, 1, 2


def simulate(
    requests: Sequence[SimRequest],
    route: Route,
    profile: Profile,
    workers: int = 16,
    config: EngineConfig = EngineConfig(),
    global_tier: GlobalTierConfig | None = GlobalTierConfig(),
    pd: tuple[int, int] | None = None,
    decode_route: Route = least_loaded,
    sample_interval_s: float = 1.0,
) -> SimResult:
    """Replays ``requests``. With ``pd=(p, d)``, ``route`` picks among ``p`` prefill workers and
    ``decode_route`` among ``d`` decode workers; otherwise ``workers`` colocated workers."""
    cpu0 = time.process_time()
    cluster = Cluster(global_tier)
    if pd is None:
        engines = {f"w{i}": Engine(f"w{i}", profile, cluster, config) for i in range(workers)}
        decoders: dict[str, Engine] = {}
    else:
        engines = {
            f"p{i}": Engine(f"p{i}", profile, cluster, config, "prefill") for i in range(pd[0])
        }
        decoders = {
            f"d{i}": Engine(f"d{i}", profile, cluster, config, "decode") for i in range(pd[1])
        }
    state = ClusterState(engines, cluster.index)
    decode_state = ClusterState(decoders, cluster.index)
    everyone = {**engines, **decoders}

    heap: list[tuple[float, int, int, object]] = []
    seq = itertools.count()
    followers: dict[str, list[SimRequest]] = defaultdict(list)
    rids = [r.rid for r in requests]
    if len(set(rids)) != len(rids):
        raise ValueError("request ids must be unique")
    known = set(rids)
    for r in requests:
        if r.after is not None and r.after not in known:
            raise ValueError(f"request {r.rid}: follows unknown request {r.after!r}")
        if r.after is not None:
            followers[r.after].append(r)
        elif r.arrival_s is not None:
            heapq.heappush(heap, (r.arrival_s, next(seq), _ARRIVE, r))
        else:
            raise ValueError(f"request {r.rid}: needs arrival_s or after")

    sims: dict[str, SimRequest] = {}
    results: list[RequestResult] = []
    samples: dict[str, list[LoadSample]] = {name: [] for name in everyone}
    next_sample = 0.0
    iterations = 0
    now = 0.0

    def start(engine: Engine, t: float) -> None:
        if engine.busy_until_s is not None:
            return
        batch = engine.next_batch(t)
        if batch is not None:
            heapq.heappush(heap, (t + batch.duration_s, next(seq), _ITER_END, (engine, batch)))

    def done(req: EngineRequest | None, sim: SimRequest, t: float, error: str | None) -> None:
        if req is None:
            results.append(
                RequestResult(
                    sim.rid, "", t, None, None, None, sim.prompt_tokens, 0, 0, 0, sim.session, error
                )
            )
        else:
            results.append(
                RequestResult(
                    sim.rid,
                    req.worker,
                    req.arrival_s,
                    req.ttft_s,
                    req.tpot_s,
                    None if req.finish_s is None else req.finish_s - req.arrival_s,
                    req.prompt_tokens,
                    req.generated_tokens,
                    req.local_cached_tokens,
                    req.global_cached_tokens,
                    sim.session,
                    error,
                )
            )
        for nxt in followers.pop(sim.rid, ()):
            heapq.heappush(heap, (t + nxt.delay_s, next(seq), _ARRIVE, nxt))

    while heap:
        now, _, kind, obj = heapq.heappop(heap)
        while next_sample <= now:
            for name, e in everyone.items():
                load = e.load()
                samples[name].append(
                    LoadSample(
                        next_sample,
                        load.running,
                        load.waiting,
                        load.used_tokens,
                        load.queued_prefill_tokens,
                    )
                )
            next_sample += sample_interval_s
        if kind == _ARRIVE:
            sim = cast(SimRequest, obj)
            name = route(sim, state)
            engine = engines[name]
            req = EngineRequest(
                sim.rid,
                sim.prompt_tokens,
                max(sim.output_tokens, 1),
                sim.keys,
                sim.block_tokens,
                arrival_s=now,
            )
            try:
                engine.add_request(req)
            except RequestTooLarge as e:
                done(None, sim, now, str(e))
                continue
            sims[sim.rid] = sim
            start(engine, now)
        elif kind == _ITER_END:
            engine, batch = cast(tuple[Engine, Batch], obj)
            iterations += 1
            events = engine.finish_batch(batch, now)
            for req in events.finished:
                done(req, sims.pop(req.rid), now, None)
            for req in events.handoff:
                target = decoders[decode_route(sims[req.rid], decode_state)]
                heapq.heappush(
                    heap, (now + engine.transfer_time_s(req), next(seq), _HANDOFF, (target, req))
                )
            start(engine, now)
        else:
            target, req = cast(tuple[Engine, EngineRequest], obj)
            try:
                target.add_decode(req)
            except RequestTooLarge as e:
                done(None, sims.pop(req.rid), now, str(e))
                continue
            start(target, now)

    return SimResult(results, samples, now, time.process_time() - cpu0, iterations, state.decisions)


__all__ = [
    "ClusterState",
    "LoadSample",
    "RequestResult",
    "Route",
    "SimRequest",
    "SimResult",
    "least_loaded",
    "policy_route",
    "round_robin",
    "simulate",
]
