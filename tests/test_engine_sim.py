"""The engine model on the simulator's virtual clock: timing against the profile's formulas,
the local cache, the global tier, the KV pool, eviction, chunking, PD."""

from __future__ import annotations

from pathlib import Path

import pytest

from smetric import BlockKeys
from smetric.engine import EngineConfig, GlobalTierConfig
from smetric.perf import PRESETS, Profile
from smetric.sim import SimRequest, round_robin, simulate
from smetric.workload.mooncake import load_mooncake

PROFILE = PRESETS["qwen2.5-7b-h200"]
BT = 16  # tokens per block in these tests
TIER = GlobalTierConfig(capacity_tokens=10_000_000, load_bytes_per_s=20e9, load_latency_s=0.003)


def req(rid, prompt, out, first_id=0, at=0.0, **kw) -> SimRequest:
    keys = BlockKeys.from_ids(range(first_id, first_id + prompt // BT))
    return SimRequest(rid, prompt, out, keys, BT, arrival_s=at, **kw)


def on(worker: str):
    return lambda r, state: worker


def by_rid(result):
    return {r.rid: r for r in result.requests}


def expected_tpot(profile: Profile, prompt: int, out: int) -> float:
    steps = [profile.decode_step_s(1, prompt + i) for i in range(1, out)]
    return sum(steps) / len(steps)


@pytest.mark.parametrize(
    "profile_name", ["qwen2.5-7b-h200", "llama-3.1-8b-h100", "qwen3-30b-a3b-h20"]
)
def test_single_request_ttft_and_tpot_follow_the_profile(profile_name):
    profile = PRESETS[profile_name]
    r = simulate([req("a", 4000, 50)], round_robin(), profile, workers=1).requests[0]
    assert r.ttft_s == pytest.approx(profile.prefill_time_s(4000), rel=0.02)
    assert r.tpot_s == pytest.approx(expected_tpot(profile, 4000, 50), rel=0.02)
    assert r.output_tokens == 50
    assert r.e2e_s == pytest.approx(r.ttft_s + 49 * r.tpot_s, rel=1e-9)


def test_a_long_prompt_is_prefilled_in_chunks():
    cfg = EngineConfig(chunk_tokens=2048)
    r = simulate([req("a", 6144, 2)], round_robin(), PROFILE, workers=1, config=cfg).requests[0]
    chunks = sum(PROFILE.prefill_time_s(2048, done) for done in (0, 2048, 4096))
    assert r.ttft_s == pytest.approx(chunks, rel=1e-6)


def test_a_repeated_prompt_is_served_from_the_local_cache():
    first, again = req("a", 4096, 10), req("b", 4096, 10, after="a")
    res = by_rid(simulate([first, again], on("w0"), PROFILE, workers=2, global_tier=None))
    assert res["a"].local_cached_tokens == 0
    assert res["b"].local_cached_tokens == 4095  # all but the last token, which is recomputed
    assert res["b"].ttft_s == pytest.approx(PROFILE.prefill_time_s(1, 4095), rel=1e-6)


def test_a_second_worker_loads_the_prompt_from_the_global_tier_at_its_cost():
    first, again = req("a", 4096, 10), req("b", 4096, 10, after="a")
    workers = iter(["w0", "w1"])
    res = by_rid(simulate([first, again], lambda r, s: next(workers), PROFILE, 2, global_tier=TIER))
    b = res["b"]
    assert (b.local_cached_tokens, b.global_cached_tokens) == (0, 4095)
    load = 4095 * PROFILE.kv_bytes_per_token / TIER.load_bytes_per_s + TIER.load_latency_s
    assert b.ttft_s == pytest.approx(PROFILE.prefill_time_s(1, 4095) + load, rel=1e-6)
    # Without a global tier the second worker recomputes everything.
    workers = iter(["w0", "w1"])
    res = by_rid(simulate([first, again], lambda r, s: next(workers), PROFILE, 2, global_tier=None))
    assert res["b"].global_cached_tokens == 0
    assert res["b"].ttft_s == pytest.approx(PROFILE.prefill_time_s(4096), rel=1e-6)


def test_requests_wait_when_the_kv_pool_is_full():
    cfg = EngineConfig(kv_pool_tokens=10_000)
    a, b = req("a", 5000, 100), req("b", 5000, 100, first_id=10_000, at=0.001)
    res = by_rid(simulate([a, b], round_robin(), PROFILE, workers=1, config=cfg))
    # a holds 5,100 tokens: b (5,100 more) cannot start until a finishes.
    assert res["b"].ttft_s + 0.001 >= res["a"].e2e_s
    roomy = by_rid(simulate([a, b], round_robin(), PROFILE, 1, config=EngineConfig()))
    assert roomy["b"].ttft_s + 0.001 < roomy["a"].e2e_s


def test_running_requests_are_capped():
    cfg = EngineConfig(max_running_requests=1)
    res = by_rid(
        simulate([req("a", 100, 20), req("b", 100, 20, 1000)], round_robin(), PROFILE, 1, cfg)
    )
    assert res["b"].ttft_s >= res["a"].e2e_s


def test_eviction_forgets_the_least_recently_used_prompt():
    # Room for about two 1,600-token prompts in the cache: a third pushes out the least recent.
    cfg = EngineConfig(kv_pool_tokens=3700)
    chain = ["a", "b", "c", "c2", "a2"]
    first_ids = {"a": 0, "b": 1000, "c": 2000, "c2": 2000, "a2": 0}
    reqs = [
        req(rid, 1600, 2, first_ids[rid], after=chain[i - 1] if i else None)
        for i, rid in enumerate(chain)
    ]
    res = by_rid(simulate(reqs, on("w0"), PROFILE, 1, cfg, global_tier=None))
    assert res["c2"].local_cached_tokens == 1599  # the most recent stays
    # While c ran (1,602 tokens reserved) the cache had (3700 - 1602) // 16 = 131 blocks: a and b
    # held 200, so a, the least recent, lost its last 69 blocks and kept 31 (496 tokens).
    assert res["a2"].local_cached_tokens == 31 * BT
    keep = [
        req("a", 1600, 2, 0),
        req("b", 1600, 2, 1000, after="a"),
        req("a2", 1600, 2, 0, after="b"),
    ]
    assert by_rid(simulate(keep, on("w0"), PROFILE, 1, cfg, None))["a2"].local_cached_tokens == 1599


def test_a_follow_up_request_arrives_after_its_predecessor_plus_the_delay():
    res = by_rid(
        simulate([req("a", 500, 5), req("b", 800, 5, after="a", delay_s=2.0)], on("w0"), PROFILE, 1)
    )
    assert res["b"].arrival_s == pytest.approx(res["a"].arrival_s + res["a"].e2e_s + 2.0)


def test_pd_prefill_hands_off_to_a_decode_worker_after_the_kv_transfer():
    cfg = EngineConfig(pd_transfer_bytes_per_s=10e9, pd_transfer_latency_s=0.002)
    r = simulate([req("a", 4096, 20)], round_robin(), PROFILE, config=cfg, pd=(1, 1)).requests[0]
    transfer = 4096 * PROFILE.kv_bytes_per_token / 10e9 + 0.002
    # The first token comes out with the decode worker's first step.
    first_step = PROFILE.decode_step_s(1, 4096)
    assert r.ttft_s == pytest.approx(PROFILE.prefill_time_s(4096) + transfer + first_step, rel=1e-6)
    assert r.tpot_s == pytest.approx(expected_tpot(PROFILE, 4096, 20), rel=0.02)
    assert r.output_tokens == 20


def test_a_request_larger_than_the_pool_fails_cleanly():
    cfg = EngineConfig(kv_pool_tokens=1000)
    res = simulate([req("big", 2000, 10), req("ok", 100, 10, 500)], round_robin(), PROFILE, 1, cfg)
    errors = {r.rid: r.error for r in res.requests}
    assert "exceeds the KV pool" in errors["big"]
    assert errors["ok"] is None


def test_load_over_time_is_sampled_per_instance():
    reqs = [req(f"r{i}", 2000, 200, i * 1000, at=i * 0.01) for i in range(20)]
    res = simulate(reqs, round_robin(), PROFILE, workers=2, sample_interval_s=0.1)
    assert set(res.load) == {"w0", "w1"}
    assert max(s.running for s in res.load["w0"]) > 1
    assert res.load["w0"][0].t_s == 0.0


def test_mooncake_trace_slice_replays_with_its_counts_and_cache_reuse():
    # The first 600 lines of the trace, copied into the fixtures (see their NOTICE.md).
    fixture = Path(__file__).parent / "fixtures" / "mooncake_conversation_600.jsonl"
    reqs = load_mooncake(fixture, limit=400)
    res = simulate(reqs, round_robin(), PROFILE, workers=4)
    assert len(res.requests) == 400 and not [r for r in res.requests if r.error]
    assert sum(r.prompt_tokens for r in res.requests) == sum(r.prompt_tokens for r in reqs)
    assert sum(r.output_tokens for r in res.requests) == sum(max(r.output_tokens, 1) for r in reqs)
    assert sum(r.local_cached_tokens + r.global_cached_tokens for r in res.requests) > 0


# ---- regressions ------------------------------------------------------------------------------


def engine(pool: int = 100_000, role: str = "mixed", **cfg):
    from smetric.engine import Cluster, Engine

    return Engine("w0", PROFILE, Cluster(None), EngineConfig(kv_pool_tokens=pool, **cfg), role)


def ereq(rid: str, prompt: int, out: int, first_id: int = 0, at: float = 0.0):
    from smetric.engine import EngineRequest

    keys = BlockKeys.from_ids(range(first_id, first_id + prompt // BT))
    return EngineRequest(rid, prompt, out, keys, BT, arrival_s=at)


def drain(e, t: float = 0.0) -> float:
    while e.has_work():
        b = e.next_batch(t)
        assert b is not None
        t += b.duration_s
        e.finish_batch(b, t)
    return t


def test_a_request_is_not_admitted_before_it_arrives():
    e = engine()
    e.add_request(ereq("late", 100, 2, at=5.0))
    assert e.next_batch(1.0) is None
    assert e.next_batch(5.0) is not None


def test_a_cached_prefix_in_use_is_locked_so_other_requests_wait():
    e = engine(pool=10_000)
    e.add_request(ereq("warm", 8000, 1))
    drain(e)
    e.add_request(ereq("b1", 8016, 50))  # same first 8,000 tokens
    e.add_request(ereq("x", 8000, 50, first_id=10_000))
    b = e.next_batch(10.0)
    assert [r.rid for r, _ in b.prefill] == ["b1"]  # x waits: b1 locks the 8,000 cached tokens
    assert b.prefill[0][0].local_cached_tokens == 8000
    assert e.load().used_tokens == 8000 + 16 + 50
    assert e.cluster.index.match_instance("w0", ereq("b", 8016, 1).keys) == 500


def test_the_cache_capacity_does_not_change_with_each_requests_block_size():
    e = engine(pool=20_000)
    e.add_request(ereq("tok", 15_008, 1))
    drain(e)
    held = e.cluster.index.stats()["instances"]["w0"]["blocks"]
    from smetric.engine import EngineRequest

    text = EngineRequest("txt", 10, 1, BlockKeys.from_ids([99]), 18.8, arrival_s=0.0)
    e.add_request(text)
    drain(e, 1.0)
    assert e.cluster.index.match_instance("w0", ereq("tok", 15_008, 1).keys) == held


def test_a_decode_worker_admits_handoffs_only_as_its_pool_and_cap_allow():
    e = engine(pool=3000, role="decode", max_running_requests=1)
    for i in range(3):
        r = ereq(f"d{i}", 1000, 5, first_id=i * 1000)
        r.prefilled_tokens = 1000
        e.add_decode(r)
    b = e.next_batch(0.0)
    assert len(b.decode) == 1 and e.load().waiting == 2
    assert e.load().used_tokens == 1005


def test_simulator_rejects_duplicate_ids_and_unknown_predecessors():
    with pytest.raises(ValueError, match="unique"):
        simulate([req("a", 100, 1), req("a", 100, 1)], round_robin(), PROFILE, 1)
    with pytest.raises(ValueError, match="unknown request"):
        simulate([req("a", 100, 1), req("b", 100, 1, after="typo")], round_robin(), PROFILE, 1)


def test_queued_prefill_counts_a_waiting_requests_uncached_tokens_not_its_cached_prefix():
    # What a policy sees as queued prefill is the work still to compute (WorkerView's contract,
    # and what the router counts): a waiting follow-up whose prefix the worker holds adds only
    # its new tokens, one whose prefix the global tier holds adds only what the tier lacks.
    from smetric.engine import Cluster, Engine

    cluster = Cluster(TIER)
    w0, w1 = (Engine(n, PROFILE, cluster, EngineConfig(kv_pool_tokens=100_000)) for n in "ab")
    w0.add_request(ereq("first", 8000, 1))
    drain(w0)  # "first" is now cached on w0 and written through to the tier
    w0.add_request(ereq("running", 4000, 50, first_id=10_000))
    w0.next_batch(0.0)  # admitted: 4000 tokens in prefill
    w0.add_request(ereq("follow-up", 8800, 5))  # 8000 cached + 800 new
    w0.add_request(ereq("new", 1600, 5, first_id=20_000))
    assert w0.load().waiting == 2
    assert w0.load().queued_prefill_tokens == 4000 + 800 + 1600
    w1.add_request(ereq("elsewhere", 8800, 5))  # its 8000 cached tokens load from the tier
    assert w1.load().queued_prefill_tokens == 800
