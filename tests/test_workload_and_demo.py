"""Chat keying, the agent-session loader and the demo on the bundled real sessions."""

from __future__ import annotations

import gzip
import itertools
import json

import pytest

from smetric import hash_text
from smetric.cli import main
from smetric.demo import replay
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


def test_demo_shows_the_trade_off_on_real_sessions():
    sessions = load_sessions(limit=12)
    rr = replay(sessions, "round_robin")
    affinity = replay(sessions, "cache_affinity")
    balanced = replay(sessions, "session_balance")
    assert rr.prompt_blocks == affinity.prompt_blocks == balanced.prompt_blocks
    # Affinity wins on local hits but piles every session onto the instance holding the prompt.
    assert affinity.local_blocks > rr.local_blocks
    assert max(affinity.requests) == sum(affinity.requests)
    # Session balancing keeps nearly all of affinity's local hits with the load spread.
    assert balanced.local_blocks > rr.local_blocks
    assert max(balanced.requests) < sum(balanced.requests) / 2
    assert max(rr.requests) - min(rr.requests) <= 1


def test_cli_demo_runs_and_rejects_bad_flags(capsys):
    assert main(["demo", "--instances", "2"]) == 0
    out = capsys.readouterr().out
    for name in ("round_robin", "cache_affinity", "session_balance"):
        assert name in out
    with pytest.raises(SystemExit) as e:
        main(["demo", "--instances", "0"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["demo", "--bogus"])
