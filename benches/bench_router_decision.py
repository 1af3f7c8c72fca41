"""The router's routing decision on its own: parse a 128 KB chat request, key it, match it against
64 workers' prefix index, and let the policy decide. Target: median <= 100 us on this machine.
"""

from __future__ import annotations

import json
import random

import pytest

from smetric import PrefixIndex
from smetric.cluster import ClusterView
from smetric.policies import make_policy
from smetric.request import loads, view_request
from smetric.router.workers import Worker

WORKERS = 64


@pytest.fixture(scope="module")
def setup():
    return build()


def build() -> tuple[bytes, PrefixIndex, list[Worker]]:
    rng = random.Random(5)
    system = "You are a coding agent. Follow the rules. " * 150  # ~6 KB shared opening
    history = "".join(
        f"tool output line {rng.randrange(10**9)}: ok\n" for _ in range(3800)
    )  # ~122 KB of session
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": history},
            {"role": "assistant", "content": "Running the tests now."},
            {"role": "user", "content": "What failed?"},
        ],
        "tools": [
            {"type": "function", "function": {"name": f"tool{i}", "parameters": {}}}
            for i in range(10)
        ],
        "max_tokens": 256,
    }
    raw = json.dumps(body).encode()
    assert 120_000 < len(raw) < 140_000
    index = PrefixIndex()
    workers = [Worker(f"http://10.0.0.{i}:30000") for i in range(WORKERS)]
    for w in workers:
        index.add_instance(w.url, 2_000_000)
    # Every worker holds the system prompt; one holds the session's previous turn.
    prev = dict(body, messages=body["messages"][:2])
    prev_keys = view_request("chat", prev).key.keys
    for w in workers:
        index.insert(w.url, prev_keys[:90])
    index.insert(workers[17].url, prev_keys)
    return raw, index, workers


def decide(raw: bytes, index: PrefixIndex, workers: list[Worker], policy) -> int:
    view = view_request("chat", loads(raw))
    match = index.match(view.key.keys, touch=False)
    hits = dict(zip(index.instances(), match.blocks, strict=True))
    cluster = ClusterView(
        tuple(w.view(hits.get(w.url, 0)) for w in workers),
        match.global_blocks,
        len(view.key.keys),
        view.key.block_tokens,
    )
    return policy.select(view, cluster).worker


@pytest.mark.parametrize("policy", ["smetric", "cache_aware", "least_load", "lmetric"])
def test_routing_decision_128kb_chat_64_workers(benchmark, setup, policy):
    raw, index, workers = setup
    chosen = benchmark(decide, raw, index, workers, make_policy(policy))
    if policy == "cache_aware":
        assert chosen == 17  # the worker holding the session


@pytest.fixture(scope="module")
def snapshot():
    raw, index, workers = build()
    view = view_request("chat", loads(raw))
    match = index.match(view.key.keys, touch=False)
    hits = dict(zip(index.instances(), match.blocks, strict=True))
    for i, w in enumerate(workers):  # some load, so the delay and SLO arithmetic is exercised
        w.in_flight, w.queued_prefill_tokens, w.running_decode_tokens = i % 7, 997 * i, 5000 * i
    cluster = ClusterView(
        tuple(w.view(hits.get(w.url, 0)) for w in workers),
        match.global_blocks,
        len(view.key.keys),
        view.key.block_tokens,
    )
    return view, cluster


@pytest.mark.parametrize("policy", ["least_load", "smetric"])
def test_policy_select_alone_64_workers(benchmark, snapshot, policy):
    """The policy's own cost on one snapshot (SMetric's target: <= 20 us over least_load)."""
    view, cluster = snapshot
    p = make_policy(policy)
    d = benchmark(p.select, view, cluster)
    if policy == "smetric":
        assert d.reason == "stick" and cluster.workers[d.worker].url.endswith(".17:30000")
