"""Chat keying, the agent-session loader and the demo on the bundled real sessions."""

from __future__ import annotations

import gzip
import itertools
import json

import pytest

from smetric import hash_text
from smetric.cli import main
from smetric.request import chat_prompt_text
from smetric.workload.agents import load_sessions

TOOLS = [{"type": "function", "function": {"name": "get_user", "parameters": {"type": "object"}}}]


def test_a_follow_up_chat_turn_serializes_to_an_extension_of_the_previous_turn():
    turn1 = [{"role": "system", "content": "policy"}, {"role": "user", "content": "hi"}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_user", "arguments": "{}"}}
    turn2 = [
        *turn1,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": '{"id": 1}', "tool_call_id": "c1"},
    ]
    a, b = chat_prompt_text(turn1, TOOLS), chat_prompt_text(turn2, TOOLS)
    assert b.startswith(a)
    assert '"name":"get_user"' in b and "<|id|>c1" in b


def test_chat_serialization_is_deterministic_and_reads_content_parts():
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert chat_prompt_text(parts) == "<|user|>ab\n"
    reordered = [
        {"type": "function", "function": {"parameters": {"type": "object"}, "name": "get_user"}}
    ]
    assert chat_prompt_text([], TOOLS) == chat_prompt_text([], reordered)


def test_bundled_sessions_rebuild_each_turn_from_the_previous_one():
    sessions = load_sessions()
    assert len(sessions) == 24
    for s in sessions:
        for prev, turn in zip(s.turns, s.turns[1:], strict=False):
            assert turn.messages[: len(prev.messages)] == prev.messages
            assert turn.messages[len(prev.messages)]["role"] == "assistant"
        assert not any(m["role"] in ("assistant", "tool") for m in s.turns[0].messages)


def test_follow_up_turns_of_real_sessions_share_most_of_their_blocks():
    s = load_sessions(limit=1)[0]
    keys = [hash_text(chat_prompt_text(t.messages, s.tools)) for t in s.turns]
    for prev, nxt in itertools.pairwise(keys):
        assert nxt.common_prefix(prev) == len(prev)


def test_replicated_sessions_share_only_the_common_opening_with_their_originals():
    from smetric.request import key_text
    from smetric.workload.agents import replicate, sim_requests

    sessions = load_sessions(limit=3)
    copies = replicate(sessions, 3)
    ids = [s.session_id for s in sessions]
    assert [s.session_id for s in copies[:4]] == [*ids, ids[0] + "~1"]
    assert [len(s.turns) for s in copies] == [len(s.turns) for s in sessions] * 3
    orig, copy = sessions[0], copies[3]
    a = key_text(chat_prompt_text(orig.turns[-1].messages, orig.tools)).keys
    b = key_text(chat_prompt_text(copy.turns[-1].messages, copy.tools)).keys
    system = key_text(chat_prompt_text(orig.turns[0].messages[:1], orig.tools)).keys
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert len(system) - 1 <= shared <= len(system) + 1 < len(a)  # the opening alone
    # Within the copy, each turn still extends the previous one.
    reqs = sim_requests(copies, 1.0, 1.0)
    assert len(reqs) == 3 * sum(len(s.turns) for s in sessions)
    with pytest.raises(ValueError):
        replicate(sessions, 0)


def test_loader_reads_a_file_and_rejects_lines_that_are_not_sessions(tmp_path):
    good = tmp_path / "s.jsonl.gz"
    session = {
        "session_id": "x",
        "tools": [],
        "turns": [
            {
                "appended_messages": [{"role": "user", "content": "hi"}],
                "output_message": {"role": "assistant", "content": "hello"},
                "output_text": "hello",
            }
        ],
    }
    with gzip.open(good, "wt") as f:
        f.write(json.dumps(session) + "\n")
    assert load_sessions(good)[0].turns[0].messages == [{"role": "user", "content": "hi"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session_id": "y"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_sessions(bad)


def test_demo_replays_real_sessions_through_the_router_for_each_policy():
    import asyncio

    from smetric.demo import _main

    rows = asyncio.run(_main(["smetric", "cache_aware"], 2, "qwen3-30b-a3b-h20", 20.0, 0.5, 4))
    turns = sum(len(s.turns) for s in load_sessions(limit=4))
    assert [r["policy"] for r in rows] == ["smetric", "cache_aware"]
    for r in rows:
        assert r["requests"] == turns and r["errors"] == 0
        assert 0.5 < r["cached"] < 1.0  # follow-ups reuse their prefix
    reasons = rows[0]["reasons"]
    assert reasons["first_turn_balance"] == 4 and reasons["stick"] == turns - 4
    assert rows[0]["spread"] != f"0-{turns}"  # SMetric used both workers
    assert set(rows[1]["reasons"]) <= {"cache_hit", "cache_miss_balance", "imbalance_balance"}


def test_cli_demo_runs_and_rejects_bad_flags(capsys):
    assert main(["demo", "--sessions", "2", "--policies", "smetric", "--time-scale", "20"]) == 0
    out = capsys.readouterr().out
    assert "smetric" in out and "SLO met" in out
    for bad in (
        ["demo", "--workers", "0"],
        ["demo", "--policies", "fastest"],
        ["demo", "--sessions", "99"],
        ["demo", "--profile", "nope"],
        ["demo", "--bogus"],
    ):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2
