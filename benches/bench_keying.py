"""Keying real agent requests: the router's fast path (``view_body``: the body's bytes viewed and
keyed in Rust) against the path a Python router takes (``orjson`` + ``view_request``), on chat
bodies rebuilt from the bundled tau-bench airline sessions (``smetric.data``, real messages,
tool calls and tool schemas).

Run: ``pytest benches/bench_keying.py --benchmark-only``. The synthetic 128 KB chat of the
decision benchmark is mostly one long string; real agent turns are many small messages, tool
calls whose arguments are JSON in a string, and tool schemas written back as compact JSON.
"""

from __future__ import annotations

import json

import pytest

from smetric.request import loads, view_body, view_request
from smetric.workload.agents import load_sessions


def _bodies() -> list[bytes]:
    """Every turn of every bundled session as the chat request an agent sends."""
    bodies = []
    for s in load_sessions():
        for turn in s.turns:
            body = {"model": "m", "messages": turn.messages, "tools": s.tools, "max_tokens": 256}
            bodies.append(json.dumps(body).encode())
    return bodies


@pytest.fixture(scope="module")
def bodies() -> list[bytes]:
    return _bodies()


def _key_all_fast(bodies: list[bytes]) -> int:
    n = 0
    for raw in bodies:
        view = view_body("chat", raw)
        assert view is not None  # every real turn takes the fast path
        n += len(view.key.keys)
    return n


def _key_all_reference(bodies: list[bytes]) -> int:
    return sum(len(view_request("chat", loads(raw)).key.keys) for raw in bodies)


def test_the_fast_path_keys_real_turns_as_the_reference_does(bodies):
    assert len(bodies) > 200
    for raw in bodies:
        fast = view_body("chat", raw)
        assert fast is not None
        assert list(fast.key.keys) == list(view_request("chat", loads(raw)).key.keys)


@pytest.mark.benchmark(group="keying every turn of 24 real agent sessions")
def test_key_real_agent_turns_fast_path(benchmark, bodies):
    assert benchmark(_key_all_fast, bodies) == _key_all_reference(bodies)


@pytest.mark.benchmark(group="keying every turn of 24 real agent sessions")
def test_peer_key_real_agent_turns_orjson_and_view_request(benchmark, bodies):
    assert benchmark(_key_all_reference, bodies) > 0


@pytest.mark.benchmark(group="keying the longest real agent turn")
def test_key_longest_real_agent_turn_fast_path(benchmark, bodies):
    longest = max(bodies, key=len)
    assert benchmark(_key_all_fast, [longest]) == _key_all_reference([longest])


@pytest.mark.benchmark(group="keying the longest real agent turn")
def test_peer_key_longest_real_agent_turn_orjson_and_view_request(benchmark, bodies):
    longest = max(bodies, key=len)
    assert benchmark(_key_all_reference, [longest]) > 0
