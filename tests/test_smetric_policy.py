"""The SMetric policy's rules and corner cases, on hand-built cluster states, and its SLO model
against the engine model."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from dataclasses import replace

import pytest

from smetric import BlockKeys
from smetric.cluster import ClusterView, WorkerView
from smetric.perf import PRESETS
from smetric.policies import PolicyConfig, SMetricConfig, make_policy
from smetric.request import PromptKey, RequestView
from smetric.sim import SimRequest, least_loaded, policy_route, simulate
from smetric.slo import CORRECTION_REFRESH_S, SLOConfig, SLOModel

PROFILE = PRESETS["qwen2.5-7b-h200"]
BT = 16.0
PROMPT = 16_000  # tokens; 1,000 blocks


def req(first: bool | None = False, session: str | None = None, prompt: int = PROMPT):
    key = PromptKey(BlockKeys.from_ids(range(int(prompt // BT))), prompt, BT)
    return RequestView("chat", key, 200, False, session, first)


def w(url: str, hit: int = 0, in_flight: int = 0, queued: int = 0, decode: int = 0):
    return WorkerView(url, in_flight, queued, decode, local_hit_blocks=hit)


def cluster(*workers: WorkerView, global_hit: int = 0, blocks: int = int(PROMPT // BT)):
    return ClusterView(tuple(workers), global_hit, blocks, BT)


def smetric(**kw):
    return make_policy("smetric", PolicyConfig(smetric=SMetricConfig(**kw)))


def decide(policy, r, c):
    d = policy.select(r, c)
    return c.workers[d.worker].url, d.reason


# ---- rules --------------------------------------------------------------------------------


def test_first_turn_goes_to_the_least_loaded_by_predicted_delay_not_request_count():
    # b has more requests in flight but far less prefill queued ahead: it starts sooner.
    c = cluster(
        w("a", in_flight=2, queued=60_000),
        w("b", in_flight=6, queued=2_000),
        w("c", in_flight=3, queued=30_000),
    )
    assert decide(smetric(), req(first=True), c) == ("b", "first_turn_balance")
    # The request-count ablation picks a instead.
    assert decide(smetric(load_metric="requests"), req(first=True), c) == (
        "a",
        "first_turn_balance",
    )


def test_first_turn_balance_counts_the_requests_its_prefill_would_delay():
    # b has a little less prefill queued than a, but is decoding 40 requests that the new
    # request's prefill chunks would stall; a serves 2. The predicted-delay ablation picks b;
    # the default cost measure picks a.
    c = cluster(
        w("b", in_flight=40, queued=6_000, decode=400_000),
        w("a", in_flight=2, queued=8_000),
    )
    assert decide(smetric(), req(first=True), c) == ("a", "first_turn_balance")
    assert decide(smetric(load_metric="delay"), req(first=True), c) == ("b", "first_turn_balance")
    # But a long queue is not outweighed by a busy batch when the queue dominates the TTFT.
    c = cluster(
        w("b", in_flight=40, queued=0, decode=400_000),
        w("a", in_flight=2, queued=2_000_000),
    )
    assert decide(smetric(), req(first=True), c) == ("b", "first_turn_balance")


def test_balancing_breaks_ties_by_requests_then_picks_then_order_and_leaves_out_the_excluded():
    r = req(first=True)
    # An idle cluster: all tie, so sessions spread in order, then start over.
    p = smetric()
    idle = cluster(w("a"), w("b"), w("c"), w("d"))
    assert [decide(p, r, idle)[0] for _ in range(5)] == ["a", "b", "c", "d", "a"]
    # c serves nothing, the others one request each (twice its cost). Left out, the others tie:
    # the one picked least often, then the first.
    p = smetric()
    c = cluster(w("a", in_flight=1), w("b", in_flight=1), w("c"), w("d", in_flight=1))
    assert p._least_loaded(r, c) == 2
    assert p._least_loaded(r, c, exclude=2) == 0
    assert p._least_loaded(r, c, exclude=2) == 1  # a has been picked once, b not yet
    assert p._least_loaded(r, cluster(w("only")), exclude=0) == 0  # nobody else to take it
    # The delay metric's tie-breaker is the request count: no queue anywhere, fewer requests.
    d = smetric(load_metric="delay")
    two = cluster(w("a", in_flight=3), w("b", in_flight=1))
    assert d._least_loaded(r, two) == 1
    assert d._least_loaded(r, two, exclude=1) == 0


def reference_least_loaded(p, r: RequestView, c: ClusterView, exclude: int = -1) -> int:
    """Balancing as defined, one instance at a time: the lowest load (each instance's
    ``predict_ttft_s`` holding nothing, times its requests served + 1; or its queueing delay;
    or its request count), then the tie-breaker (the request count; the queued prefill for
    ``requests``), then the fewest picks, then the first; ``exclude`` left out unless alone."""
    glob = min(int(c.global_hit_blocks * c.block_tokens), r.prompt_tokens)
    keys = []
    for i, x in enumerate(c.workers):
        if p.config.load_metric == "cost":
            ttft = p.slo.predict_ttft_s(x.url, x.queued_prefill_tokens, r.prompt_tokens, 0, glob)
            load, tie = ttft * (x.in_flight + 1), x.in_flight
        elif p.config.load_metric == "delay":
            load, tie = p.slo.queue_delay_s(x.url, x.queued_prefill_tokens), x.in_flight
        else:
            load, tie = x.in_flight, x.queued_prefill_tokens
        if i == exclude and len(c.workers) > 1:
            load = math.inf
        keys.append((load, tie, p._picks.get(x.url, 0), i))
    return min(keys)[3]


def test_balancing_decides_as_its_definition_on_random_clusters():
    # The balancing is written for speed (costs per distinct queue, corrections looked up once,
    # request counts standing for costs, ties narrowed a key at a time): on random clusters
    # with ties, corrections, picks and exclusions it picks what the definition picks.
    rng = random.Random(11)
    now = [1000.0]
    for trial in range(1500):
        metric = ("cost", "delay", "requests")[trial % 3]
        p = smetric(load_metric=metric)
        p.slo.clock = lambda: now[0]
        urls = [f"w{i}" for i in range(rng.randint(1, 12))]
        for url in urls:
            if rng.random() < 0.4:
                p.slo.observe_ttft(url, 1.0, rng.uniform(0.3, 3.0))
            if rng.random() < 0.3:
                p._picks[url] = rng.randint(0, 3)
        now[0] += rng.choice([0.0, 0.05, 30.0])
        c = ClusterView(
            tuple(
                w(u, in_flight=rng.choice([0, 0, 1, 2, 5]), queued=rng.choice([0, 0, 512, 9000]))
                for u in urls
            ),
            rng.choice([0, 50, 400]),
            1000,
            BT,
        )
        r = req(first=True, prompt=rng.choice([500, 1600, 30_000]))
        for exclude in range(-1, len(urls)):
            expected = reference_least_loaded(p, r, c, exclude)
            assert p._least_loaded(r, c, exclude) == expected, (trial, exclude)


def test_follow_up_sticks_to_the_instance_with_the_highest_local_hit_when_it_meets_the_slo():
    c = cluster(w("a", hit=100), w("b", hit=950, in_flight=3, queued=4_000), w("c"))
    assert decide(smetric(), req(), c) == ("b", "stick")


def test_follow_up_migrates_when_the_sticky_instance_would_miss_the_ttft_slo():
    # b holds the session but has ~400k prefill tokens queued ahead: far past 5x the idle TTFT.
    c = cluster(
        w("a", hit=100),
        w("b", hit=950, queued=400_000),
        w("c", hit=100, queued=1_000),
        global_hit=950,
    )
    assert decide(smetric(), req(), c) == ("a", "migrate_slo")


def test_follow_up_migrates_when_the_sticky_instance_would_miss_the_tpot_slo():
    # A huge decode batch and context on b: its next decode step exceeds 100 ms.
    c = cluster(w("a"), w("b", hit=950, in_flight=400, decode=30_000_000), global_hit=950)
    assert decide(smetric(), req(), c) == ("a", "migrate_slo")


def test_without_a_global_tier_migration_prices_in_recomputing_the_session():
    slo = SLOModel(PROFILE, SLOConfig(global_tier=False))
    with_tier = SLOModel(PROFILE, SLOConfig())
    assert slo.predict_ttft_s("a", 0, PROMPT, 0, 15_000) > with_tier.predict_ttft_s(
        "a", 0, PROMPT, 0, 15_000
    )
    assert slo.predict_ttft_s("a", 0, PROMPT, 0, 15_000) == pytest.approx(slo.idle_ttft_s(PROMPT))


def test_when_no_instance_meets_the_slo_the_faster_one_is_chosen():
    c = cluster(w("a", queued=300_000), w("b", hit=950, queued=400_000), global_hit=950)
    assert decide(smetric(), req(), c) == ("a", "migrate_over_slo")
    c = cluster(w("a", queued=900_000), w("b", hit=950, queued=400_000), global_hit=950)
    assert decide(smetric(), req(), c) == ("b", "stick_over_slo")


def test_a_follow_up_with_no_hit_anywhere_is_balanced():
    c = cluster(w("a", in_flight=1, queued=9_000), w("b", queued=1_000))
    assert decide(smetric(), req(), c) == ("b", "follow_up_no_hit_balance")


def test_a_hit_only_on_a_shared_system_prefix_is_not_a_session():
    # Every instance holds the first 300 blocks (the system prompt): no session locality.
    c = cluster(w("a", hit=300, queued=50_000), w("b", hit=300), w("c", hit=300, queued=8_000))
    assert decide(smetric(), req(), c) == ("b", "follow_up_no_hit_balance")


def test_raw_prompts_count_as_follow_ups_when_half_of_them_is_held_beyond_the_shared_prefix():
    c = cluster(w("a", hit=100), w("b", hit=700), w("c", hit=100, queued=5_000))
    assert decide(smetric(), req(first=None), c) == ("b", "stick")
    c = cluster(w("a", hit=100), w("b", hit=400), w("c", hit=100, queued=5_000))
    assert decide(smetric(), req(first=None), c) == ("a", "first_turn_balance")


def test_the_best_hit_instance_being_unhealthy_leaves_the_next_holder_or_balance():
    # The snapshot holds eligible instances only: without b, a (next-best holder) is chosen.
    c = cluster(w("a", hit=600), w("c", queued=2_000))
    assert decide(smetric(), req(), c) == ("a", "stick")


def test_a_session_key_marks_follow_ups_and_names_their_instance():
    p = smetric()
    first = cluster(w("a", queued=5_000), w("b"))
    assert decide(p, req(first=None, session="s1"), first) == ("b", "first_turn_balance")
    # Next turn: the index has not caught up (no hits anywhere), the key still says "b".
    later = cluster(w("a"), w("b", queued=2_000))
    assert decide(p, req(first=None, session="s1"), later) == ("b", "stick")


def test_ablation_without_slo_gate_always_sticks():
    c = cluster(w("a"), w("b", hit=950, queued=400_000), global_hit=950)
    assert decide(smetric(slo_gate=False), req(), c) == ("b", "stick")


def test_ablation_without_migration_sticks_over_the_slo():
    c = cluster(w("a"), w("b", hit=950, queued=400_000), global_hit=950)
    assert decide(smetric(migration=False), req(), c) == ("b", "stick_over_slo")


def test_ablation_without_turn_detection_treats_first_turns_as_follow_ups():
    c = cluster(w("a"), w("b", hit=950, in_flight=2))
    assert decide(smetric(), req(first=True), c) == ("a", "first_turn_balance")
    assert decide(smetric(turn_detection=False), req(first=True), c) == ("b", "stick")


# ---- the SLO model ------------------------------------------------------------------------


def test_slos_are_k_times_the_idle_ttft_or_absolute():
    slo = SLOModel(PROFILE)
    assert slo.ttft_slo_s(8000) == pytest.approx(5 * slo.idle_ttft_s(8000))
    assert slo.idle_ttft_s(8000) == pytest.approx(PROFILE.prefill_time_s(8000), rel=0.01)
    assert SLOModel(PROFILE, SLOConfig(ttft_slo_ms=250)).ttft_slo_s(8000) == 0.25
    assert slo.tpot_slo_s == 0.1


def test_online_correction_follows_observations_bounded_and_decaying():
    now = [0.0]
    slo = SLOModel(PROFILE, clock=lambda: now[0])
    base = slo.predict_ttft_s("a", 0, 8000, 0)
    for _ in range(50):
        slo.observe_ttft("a", slo.predict_ttft_s("a", 0, 8000, 0), 1.5 * base)
    assert slo.predict_ttft_s("a", 0, 8000, 0) == pytest.approx(1.5 * base, rel=0.02)
    for _ in range(50):
        slo.observe_ttft("a", slo.predict_ttft_s("a", 0, 8000, 0), 10 * base)
    assert slo.correction("a") == 2.0  # bounded
    now[0] += 60.0
    assert slo.correction("a") == pytest.approx(1.5)  # half-way back after a half-life
    assert slo.correction("b") == 1.0


def test_corrections_decay_to_the_present_at_least_every_refresh_and_new_ones_count_at_once():
    now = [1000.0]
    slo = SLOModel(PROFILE, clock=lambda: now[0])
    slo.observe_ttft("a", 1.0, 2.0)
    assert slo.correction("a") == 2.0
    now[0] = 1060.0
    assert slo.correction("a") == 1.5  # half-way back after a half-life
    now[0] = 1060.0 + 0.6 * CORRECTION_REFRESH_S
    assert slo.correction("a") == 1.5  # as of the last refresh
    slo.observe_ttft("b", 1.0, 0.5)
    assert slo.corrections() == {"a": 1.5, "b": 0.5}  # the one just set counts at once
    now[0] = 1060.0 + 1.2 * CORRECTION_REFRESH_S
    a = 1.0 + 0.5 ** ((60.0 + 1.2 * CORRECTION_REFRESH_S) / 60.0)
    b = 1.0 - 0.5 * 0.5 ** ((0.6 * CORRECTION_REFRESH_S) / 60.0)
    assert slo.corrections() == pytest.approx({"a": a, "b": b}, rel=1e-12)
    assert a < 1.5 and b > 0.5
    now[0] = 1050.0  # a clock that went back is read as it is
    assert slo.correction("a") == pytest.approx(1.0 + 0.5 ** (50.0 / 60.0), rel=1e-12)


def test_batched_hit_blind_predictions_and_corrections_equal_the_per_instance_ones_exactly():
    # SMetric's balancing costs every instance at once (``hit_blind_ttfts_s`` times each
    # instance's correction from ``corrections``); that must be ``predict_ttft_s`` of each, to
    # the last bit, or ties between equally loaded instances could go another way.
    now = [100.0]
    for config in (SLOConfig(), SLOConfig(global_tier=False), SLOConfig(chunk_tokens=2048)):
        slo = SLOModel(PROFILE, config, clock=lambda: now[0])
        for url, ratio in (("a", 1.7), ("b", 0.6)):
            slo.observe_ttft(url, 1.0, ratio)
        now[0] += 17.0
        queued = [0, 1, 2047, 2048, 2049, 8191, 8192, 8193, 50_000, 997 * 63]
        corrections = slo.corrections()
        assert set(corrections) == {"a", "b"}
        for prompt, glob in ((1, 0), (8000, 0), (16_000, 4096), (16_000, 16_000), (33_000, 900)):
            ttfts = slo.hit_blind_ttfts_s(queued, prompt, glob)
            assert set(ttfts) == set(queued)
            for url in ("a", "b", "c"):
                assert corrections.get(url, 1.0) == slo.correction(url)
                for q in queued:
                    assert ttfts[q] * corrections.get(url, 1.0) == slo.predict_ttft_s(
                        url, q, prompt, 0, glob
                    )


def test_ttft_correction_is_a_median_so_chunk_top_ups_do_not_drag_it():
    # Chunked prefill tops a request's last iteration up with prefill that arrives after it: its
    # TTFT is as predicted, or about one chunk longer. With one request in three topped up, the
    # correction stays at 1 (an average would settle near 1.33 and put the others off by 33%).
    slo = SLOModel(PROFILE, clock=lambda: 0.0)
    base = slo.predict_ttft_s("a", 0, 3000, 0)
    for i in range(60):
        observed = 2 * base if i % 3 == 0 else base
        slo.observe_ttft("a", slo.predict_ttft_s("a", 0, 3000, 0), observed)
    assert slo.correction("a") == pytest.approx(1.0)


def test_ttft_correction_ignores_what_a_top_up_by_a_later_arrival_explains():
    now = [0.0]
    slo = SLOModel(PROFILE, clock=lambda: now[0])
    pred = slo.predict_ttft_s("a", 0, 3000, 0)
    chunk_s = PROFILE.prefill_time_s(8192)
    band = 2 * PROFILE.model.active_params * 8192 / (PROFILE.gpu.bf16_flops * PROFILE.mfu)

    def one(observed: float, other_arrives: bool) -> None:
        slo.note_dispatch("a")  # this request
        now[0] += observed / 2
        if other_arrives:
            slo.note_dispatch("a")  # another one while it waits: it may top its last chunk up
        now[0] += observed / 2
        slo.observe_ttft("a", slo.predict_ttft_s("a", 0, 3000, 0), observed)
        now[0] += 0.01

    late = pred + 0.15 * chunk_s
    for _ in range(20):  # late by part of a chunk, with an arrival meanwhile: the model's story
        one(late, True)
    assert slo.correction("a") == 1.0
    for _ in range(20):  # the same lateness alone is the model's error: it is corrected
        one(late, False)
    assert slo.correction("a") == pytest.approx(late / pred, rel=0.02)
    slo = SLOModel(PROFILE, clock=lambda: now[0])
    for _ in range(20):  # later than any top-up: measured against the prediction plus a chunk
        one(1.2 * (pred + band), True)
    assert slo.correction("a") == pytest.approx(1.2, rel=0.05)
    for _ in range(20):  # early is the model's error, arrival or not
        one(0.8 * pred, True)
    assert slo.correction("a") == pytest.approx(0.8, rel=0.05)


def test_tpot_correction_is_its_own_bounded_factor_and_leaves_ttft_alone():
    now = [0.0]
    slo = SLOModel(PROFILE, clock=lambda: now[0])
    base = slo.predict_tpot_s("a", 8, 40_000, 2_000)
    ttft = slo.predict_ttft_s("a", 0, 8000, 0)
    for _ in range(50):
        slo.observe_tpot("a", slo.predict_tpot_s("a", 8, 40_000, 2_000), 0.8 * base)
    assert slo.predict_tpot_s("a", 8, 40_000, 2_000) == pytest.approx(0.8 * base, rel=0.02)
    assert slo.predict_ttft_s("a", 0, 8000, 0) == ttft and slo.correction("a") == 1.0
    for _ in range(50):
        slo.observe_tpot("a", slo.predict_tpot_s("a", 8, 40_000, 2_000), 0.01 * base)
    assert slo.tpot_correction("a") == 0.5  # bounded
    now[0] += 60.0
    assert slo.tpot_correction("a") == pytest.approx(0.75)  # half-way back after a half-life
    assert slo.tpot_correction("b") == 1.0


def test_smetric_decisions_carry_both_predictions_and_observations_correct_them():
    policy = smetric()
    c = cluster(w("a"), w("b", hit=900, in_flight=4, decode=30_000))
    d = policy.select(req(), c)
    assert (d.reason, d.predicted_ttft_s is not None, d.predicted_tpot_s is not None) == (
        "stick",
        True,
        True,
    )
    assert d.predicted_tpot_s is not None
    base = d.predicted_tpot_s
    for _ in range(30):  # each decision's prediction carries the correction so far
        policy.observe_tpot("b", policy.select(req(), c), 1.5 * base)
    assert policy.slo.tpot_correction("b") == pytest.approx(1.5, rel=0.02)
    assert policy.slo.tpot_correction("a") == 1.0


def test_predicted_ttft_is_within_ten_percent_of_the_engine_at_moderate_load():
    # Poisson-ish arrivals of distinct prompts on 4 workers; record each request's prediction at
    # dispatch (with the engines' real queues) and compare with the TTFT the engine produced.
    import random

    rng = random.Random(3)
    slo = SLOModel(PROFILE)
    predicted: dict[str, float] = {}

    def route(r, state):
        name = least_loaded(r, state)
        load = state.load(name)
        predicted[r.rid] = slo.predict_ttft_s(name, load.queued_prefill_tokens, r.prompt_tokens, 0)
        return name

    t, reqs = 0.0, []
    for i in range(300):
        t += rng.expovariate(12.0)
        n = rng.randrange(2_000, 12_000)
        reqs.append(
            SimRequest(
                f"r{i}",
                n,
                rng.randrange(20, 200),
                BlockKeys.from_ids(range(i << 20, (i << 20) + n // 16)),
                16,
                arrival_s=t,
            )
        )
    res = simulate(reqs, route, PROFILE, workers=4, global_tier=None)
    errors = [abs(predicted[r.rid] - r.ttft_s) / r.ttft_s for r in res.requests]
    assert statistics.median(errors) <= 0.10
    busy = sum(1 for r in res.requests if r.ttft_s > 1.5 * PROFILE.prefill_time_s(r.prompt_tokens))
    assert busy > 20  # moderate load: a fair share of requests did queue


def _router_view_on_engines(seed: int, n: int, rate: float) -> dict[str, float]:
    """Two engine models on a virtual clock, fed as the router feeds real workers: the router's
    own accounting (``Worker``: queued prefill less what the chunk rate got through, first tokens
    leaving their head start) and SMetric's SLO model (told of each dispatch and first token).
    Returns each request's median absolute TTFT error: predicted at dispatch (on the engine's
    iteration boundaries, with the likelier top-up) and, for comparison, plain."""
    import heapq
    import random
    from unittest import mock

    from smetric.engine import Cluster, Engine, EngineRequest
    from smetric.router import workers as workers_module
    from smetric.router.workers import Worker

    rng = random.Random(seed)
    now = [0.0]
    slo = SLOModel(PROFILE, clock=lambda: now[0])
    chunk = slo.config.chunk_tokens
    tokens_per_s = chunk / PROFILE.prefill_time_s(chunk)
    cluster = Cluster(None)
    engines = {u: Engine(u, PROFILE, cluster) for u in ("a", "b")}
    workers = {u: Worker(u) for u in engines}
    batches: dict[str, object] = {}
    events: list[tuple[float, int, str, object]] = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        heapq.heappush(events, (t, i, "arrive", rng.randrange(2_000, 8_000)))
    predicted: dict[str, tuple[float, float]] = {}
    errors: dict[str, list[float]] = {"aligned": [], "plain": []}
    seq = itertools.count(n)

    def start(u: str) -> None:
        batch = engines[u].next_batch(now[0])
        if batch is not None:
            batches[u] = batch
            heapq.heappush(events, (now[0] + batch.duration_s, next(seq), "end", u))

    def step() -> None:
        now[0], i, kind, what = heapq.heappop(events)
        if kind == "arrive":
            assert isinstance(what, int)
            views = {u: w.view(0, now[0], tokens_per_s) for u, w in workers.items()}
            u = min(views, key=lambda u: views[u].queued_prefill_tokens)
            q = views[u].queued_prefill_tokens
            predicted[f"r{i}"] = (
                slo.predict_ttft_s(u, q, what, 0, top_up=True),
                slo.predict_ttft_s(u, q, what, 0),
            )
            slo.note_dispatch(u)
            workers[u].dispatched(what)
            keys = BlockKeys.from_ids(range(i << 20, (i << 20) + what // 16))
            engines[u].add_request(EngineRequest(f"r{i}", what, 8, keys, 16, arrival_s=now[0]))
            if u not in batches:
                start(u)
        else:
            assert isinstance(what, str)
            done = engines[what].finish_batch(batches.pop(what), now[0])  # type: ignore[arg-type]
            for r in done.first_token:
                ttft = now[0] - r.arrival_s
                aligned, plain = predicted[r.rid]
                errors["aligned"].append(abs(aligned - ttft) / ttft)
                errors["plain"].append(abs(plain - ttft) / ttft)
                workers[what].prefilled(r.prompt_tokens, r.prompt_tokens, tokens_per_s, chunk)
                slo.observe_ttft(what, aligned, ttft)
            if engines[what].has_work():
                start(what)

    # The router's accounting reads the monotonic clock: here it reads the virtual one.
    with mock.patch.object(workers_module.time, "monotonic", lambda: now[0]):
        while events:
            step()
    return {k: statistics.median(v) for k, v in errors.items()}


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_ttft_predicted_from_the_routers_view_is_within_ten_percent_on_the_engines(seed):
    # The emulator benchmark's scenario (benches/bench_slo_prediction.py: 40 prompts of 2,000 to
    # 8,000 tokens at 14/s on two instances, i.e. ~70,000 tokens/s offered to ~58,000 of
    # prefill: queues build up), on the engine model in virtual time, where it is deterministic.
    # Without the iteration boundaries and top-ups the median error is 2-24% over seeds 1-10.
    errors = _router_view_on_engines(seed, n=40, rate=14.0)
    assert errors["aligned"] <= 0.10, errors


def test_ttft_predicted_from_the_routers_view_at_sixty_percent_load_is_near_exact():
    errors = _router_view_on_engines(1, n=200, rate=7.0)  # ~35,000 of ~58,000 tokens/s
    assert errors["aligned"] <= 0.02, errors


# ---- in the simulator, on real agent sessions ----------------------------------------------


def test_in_the_simulator_sessions_stick_first_turns_spread_and_overloads_migrate():
    from smetric.workload.agents import load_sessions, sim_requests

    sessions = load_sessions(limit=24)
    reqs = sim_requests(sessions, start_gap_s=0.05)
    res = simulate(reqs, policy_route(make_policy("smetric")), PROFILE, workers=4)
    assert not [r for r in res.requests if r.error]
    assert res.decisions["first_turn_balance"] == 24
    firsts = [r.worker for r in res.requests if r.rid.endswith("#0")]
    assert max(firsts.count(x) for x in set(firsts)) <= 24 // 4 + 1  # spread evenly
    by_session: dict[str, list[str]] = {}
    for r in sorted(res.requests, key=lambda r: (r.session, int(r.rid.split("#")[1]))):
        by_session.setdefault(r.session, []).append(r.worker)
    moves = sum(a != b for ws in by_session.values() for a, b in itertools.pairwise(ws))
    assert moves == 0 and res.decisions["stick"] == len(reqs) - 24
    # A tight TTFT SLO (20 ms) makes an instance with prefill queued miss it: those sessions
    # migrate, and their new instance loads the session from the global tier.
    tight = PolicyConfig(smetric=SMetricConfig(slo=replace(SLOConfig(), ttft_slo_ms=20)))
    res = simulate(reqs, policy_route(make_policy("smetric", tight)), PROFILE, workers=4)
    assert res.decisions["migrate_slo"] > 0
    loaded = {r.rid for r in res.requests if r.global_cached_tokens > 0}
    assert any(not rid.endswith("#0") for rid in loaded)  # migrated follow-ups
    # (First turns on a fresh instance load the shared system prompt from the tier too.)
