"""Each baseline policy's decision on hand-built cluster states."""

from __future__ import annotations

from collections import Counter

import pytest

from smetric import BlockKeys
from smetric.cluster import ClusterView, WorkerView
from smetric.policies import POLICIES, PolicyConfig, make_policy
from smetric.request import PromptKey, RequestView, text_prompt_tokens, view_unkeyed


def req(prompt_tokens: int = 1600, session: str | None = None, first: bool | None = None):
    blocks = prompt_tokens // 16
    key = PromptKey(BlockKeys.from_ids(range(blocks)), prompt_tokens, 16.0)
    return RequestView("chat", key, 100, False, session, first)


def test_worker_views_keep_the_field_order_hot_code_reads_by_position():
    # Worker.view builds WorkerView by position and Router._snapshot reads fields by position.
    assert WorkerView._fields == (
        "url",
        "in_flight",
        "queued_prefill_tokens",
        "running_decode_tokens",
        "polled_running",
        "polled_waiting",
        "token_usage",
        "local_hit_blocks",
    )


def cluster(*workers: WorkerView, global_hit: int = 0, query_blocks: int = 100) -> ClusterView:
    return ClusterView(tuple(workers), global_hit, query_blocks, 16.0)


def w(url: str, in_flight: int = 0, queued: int = 0, decode: int = 0, hit: int = 0) -> WorkerView:
    return WorkerView(url, in_flight, queued, decode, local_hit_blocks=hit)


def test_registry_names_every_policy_and_rejects_unknown_names():
    assert set(POLICIES) == {
        "smetric",
        "round_robin",
        "random",
        "power_of_two",
        "least_load",
        "cache_aware",
        "lmetric",
        "kv_cost",
        "sticky",
    }
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")


def test_round_robin_visits_each_worker_in_turn():
    p, c = make_policy("round_robin"), cluster(w("a"), w("b"), w("c"))
    assert [p.select(req(), c).worker for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_random_is_seeded_and_spreads():
    c = cluster(w("a"), w("b"), w("c"))
    picks = [make_policy("random", PolicyConfig(seed=7)).select(req(), c).worker for _ in range(3)]
    again = [make_policy("random", PolicyConfig(seed=7)).select(req(), c).worker for _ in range(3)]
    assert picks == again
    p = make_policy("random")
    counts = Counter(p.select(req(), c).worker for _ in range(3000))
    assert all(800 < n < 1200 for n in counts.values())


def test_power_of_two_picks_the_less_loaded_of_its_pair():
    p = make_policy("power_of_two")
    c = cluster(w("a", in_flight=9), w("b", in_flight=1), w("c", in_flight=5))
    picks = Counter(p.select(req(), c).worker for _ in range(600))
    assert picks[0] == 0  # the busiest worker never wins a pair
    assert picks[1] > picks[2]
    assert make_policy("power_of_two").select(req(), cluster(w("a"))).reason == "only_worker"


def test_least_load_counts_in_flight_then_queued_prefill():
    p = make_policy("least_load")
    c = cluster(
        w("a", in_flight=3), w("b", in_flight=2, queued=900), w("c", in_flight=2, queued=100)
    )
    d = p.select(req(), c)
    assert (d.worker, d.reason) == (2, "least_load")


def test_cache_aware_follows_the_longest_match_above_the_threshold():
    p = make_policy("cache_aware")
    c = cluster(w("a", hit=10), w("b", hit=80, in_flight=5), w("c"))
    d = p.select(req(), c)
    assert (d.worker, d.reason) == (1, "cache_hit")


def test_cache_aware_balances_when_the_match_is_short():
    p = make_policy("cache_aware")
    c = cluster(w("a", hit=20, in_flight=3), w("b", in_flight=1), w("c", in_flight=2))
    d = p.select(req(), c)
    assert (d.worker, d.reason) == (1, "cache_miss_balance")


def test_cache_aware_balances_when_load_is_imbalanced_even_on_a_hit():
    p = make_policy("cache_aware")
    c = cluster(w("a", hit=100, in_flight=200), w("b", in_flight=10))
    assert p.select(req(), c).reason == "imbalance_balance"
    # Absolute gap over 64 but not 1.5x: still cache-aware.
    c = cluster(w("a", hit=100, in_flight=200), w("b", in_flight=150))
    assert p.select(req(), c).reason == "cache_hit"


def test_cache_aware_breaks_ties_as_sglang_router_does():
    p = make_policy("cache_aware")

    def pick(c: ClusterView) -> tuple[int, str]:
        d = p.select(req(), c)
        return d.worker, d.reason

    # Equal matches: the less loaded, then the first.
    c = cluster(w("a", hit=80, in_flight=2), w("b", hit=80, in_flight=1), w("c", hit=80))
    assert pick(c) == (2, "cache_hit")
    c = cluster(w("a", hit=80, in_flight=1), w("b", hit=80, in_flight=1))
    assert pick(c)[0] == 0
    # A miss: the fewest in flight, then the least queued prefill, then the first.
    c = cluster(w("a", in_flight=1, queued=10), w("b", in_flight=1, queued=5), w("c", in_flight=1))
    assert pick(c) == (2, "cache_miss_balance")
    c = cluster(w("a", in_flight=2), w("b", in_flight=1, queued=5), w("c", in_flight=1, queued=5))
    assert pick(c)[0] == 1
    # Imbalanced: the least loaded, wherever it sits.
    c = cluster(w("a", in_flight=100), w("b", hit=90, in_flight=300), w("c", in_flight=100))
    assert pick(c) == (0, "imbalance_balance")
    with pytest.raises(ValueError):
        p.select(req(), cluster())


def test_lmetric_weighs_queued_prefill_and_uncached_tokens_by_batch_size():
    p = make_policy("lmetric")
    # a: (0 + 1600) x 4 = 6400; b: (500 + 0) x 3 = 1500 (holds the whole prompt); c: 1600 x 1.
    c = cluster(w("a", in_flight=3), w("b", in_flight=2, queued=500, hit=100), w("c"))
    assert p.select(req(), c).worker == 1
    c = cluster(w("a", in_flight=3), w("b", in_flight=2, queued=5000, hit=100), w("c"))
    assert p.select(req(), c).worker == 2


def test_lmetric_and_kv_cost_break_ties_by_load_then_order():
    lm, kv = make_policy("lmetric"), make_policy("kv_cost")
    # lmetric: a and b both cost 1600 x 2 = 3200 with one request; c costs 800 x 4 = 3200 with
    # three. Equal costs go to the fewer requests, then to the first worker.
    c = cluster(w("a", in_flight=1), w("b", in_flight=1), w("c", in_flight=3, hit=50))
    assert lm.select(req(), c).worker == 0
    c = cluster(w("a", in_flight=3, hit=50), w("b", in_flight=1), w("c", in_flight=1))
    assert lm.select(req(), c).worker == 1
    # kv_cost: equal costs go to the first worker.
    c = cluster(w("a", decode=160), w("b"), w("c"))
    assert kv.select(req(), c).worker == 1
    # A negative cost (accounting that drifted below zero) is still the lowest.
    c = cluster(w("a"), w("b", queued=-5000), w("c"))
    assert lm.select(req(), c).worker == 1 and kv.select(req(), c).worker == 1
    for p in (lm, kv):
        with pytest.raises(ValueError):
            p.select(req(), cluster())


def test_kv_cost_credits_local_hits_fully_and_global_hits_by_half():
    p = make_policy("kv_cost")
    # a: 100 - 60 = 40 blocks to prefill; b: 100 - 0 - 0.5 x 60 = 70; decode load equal.
    c = cluster(w("a", hit=60), w("b"), global_hit=60)
    assert p.select(req(), c).worker == 0
    # a's 45 blocks (720 tokens) of active KV outweigh the 30-block difference.
    c = cluster(w("a", hit=60, decode=720), w("b"), global_hit=60)
    assert p.select(req(), c).worker == 1


def test_sticky_keeps_a_session_on_its_worker_and_falls_back_to_least_load():
    p = make_policy("sticky")
    c = cluster(w("a", in_flight=2), w("b"), w("c", in_flight=1))
    first = p.select(req(session="s1"), c)
    assert (first.worker, first.reason) == (1, "session_new")
    busy = cluster(w("a", in_flight=2), w("b", in_flight=9), w("c", in_flight=1))
    assert p.select(req(session="s1"), busy).worker == 1
    assert p.select(req(session="s1"), busy).reason == "session_affinity"
    assert p.select(req(), busy).reason == "no_session_key"
    gone = cluster(w("a", in_flight=2), w("c", in_flight=1))
    moved = p.select(req(session="s1"), gone)
    assert (gone.workers[moved.worker].url, moved.reason) == ("c", "session_moved")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_balances_a_request_with_nothing_to_key(name):
    # Embeddings, rerank, classification: no blocks, so no hits, and the least loaded of three
    # gets it (round_robin and random: each of them in turn, or by its seed).
    view = view_unkeyed("embeddings", 4000)
    assert len(view.key.keys) == 0 and view.prompt_tokens == text_prompt_tokens(4000) > 1
    assert view.session_key is None
    ws = (w("a", in_flight=3, queued=900), w("b"), w("c", in_flight=2, queued=500))
    p = make_policy(name)
    picks = {p.select(view, cluster(*ws, query_blocks=0)).worker for _ in range(30)}
    if name in ("round_robin", "random"):
        assert picks == {0, 1, 2}
    elif name == "power_of_two":  # the less loaded of the two it draws: never the busiest
        assert picks <= {1, 2}
    else:
        assert picks == {1}
