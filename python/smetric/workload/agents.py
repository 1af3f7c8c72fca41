"""Agent sessions with real chat messages (JSONL, one session a line; see shared traces README).

Turn k's request messages are turn k-1's request messages, plus turn k-1's ``output_message``,
plus turn k's ``appended_messages`` (turn 0: its ``appended_messages``).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from smetric.workload import read_jsonl

BUNDLED = "taubench_airline_24.jsonl.gz"
"""A slice of real tau-bench airline sessions shipped with the package (see data/NOTICE.md)."""


@dataclass(frozen=True)
class Turn:
    messages: list[dict[str, Any]]
    output_text: str
    tool_time_s: float | None


@dataclass(frozen=True)
class Session:
    session_id: str
    tools: list[dict[str, Any]]
    turns: list[Turn]


def load_sessions(path: str | Path | None = None, limit: int | None = None) -> list[Session]:
    """Sessions from a JSONL file (``.gz`` allowed), or the bundled slice when ``path`` is None."""

    def parse(raw: Any) -> Session:
        messages: list[dict[str, Any]] = []
        turns = []
        for t in raw["turns"]:
            messages = messages + t["appended_messages"]
            turns.append(Turn(list(messages), t.get("output_text") or "", t.get("tool_time_s")))
            messages = [*messages, t["output_message"]]
        return Session(raw["session_id"], raw.get("tools") or [], turns)

    if path is None:
        data = resources.files("smetric.data").joinpath(BUNDLED).read_bytes()
        lines = gzip.decompress(data).decode().splitlines()
        return read_jsonl(BUNDLED, parse, "an agent session", limit, lines)
    return read_jsonl(path, parse, "an agent session", limit)


def output_tokens(turn: Turn) -> int:
    """Output length of a recorded turn: the answer's size at 3.4 bytes a token (tool-call
    answers carry their JSON in ``output_text`` too), at least 1."""
    return max(1, round(len(turn.output_text.encode()) / 3.4))


def replicate(sessions: list[Session], copies: int) -> list[Session]:
    """``copies`` copies of every session, interleaved (copy c of session i comes after copy c
    of every earlier session), for loads larger than a trace's sessions can make on their own.
    A copy keeps the system prompt and the tools, which real sessions share, and gets a tag in
    front of its first non-system message, so its conversation shares no cache with the
    original's beyond that shared opening."""
    if copies < 1:
        raise ValueError("copies must be >= 1")
    if copies == 1:
        return list(sessions)
    out = []
    for c in range(copies):
        for s in sessions:
            if c == 0:
                out.append(s)
                continue
            tag = f"[session copy {c}] "
            turns = [
                Turn(_tag_first_non_system(t.messages, tag), t.output_text, t.tool_time_s)
                for t in s.turns
            ]
            out.append(Session(f"{s.session_id}~{c}", s.tools, turns))
    return out


def _tag_first_non_system(messages: list[dict[str, Any]], tag: str) -> list[dict[str, Any]]:
    out = list(messages)
    for j, m in enumerate(out):
        if m.get("role") != "system" and isinstance(m.get("content"), str):
            out[j] = {**m, "content": tag + m["content"]}
            break
    return out


def sim_requests(
    sessions: list[Session], start_gap_s: float = 1.0, think_s: float = 1.0
) -> list[Any]:
    """The sessions as simulator requests: session i starts at ``i * start_gap_s``; each next turn
    arrives ``tool_time_s`` (or ``think_s`` where unrecorded) after the previous answer."""
    from smetric.request import chat_prompt_text, key_text
    from smetric.sim import SimRequest

    out = []
    for i, s in enumerate(sessions):
        prev = None
        for k, turn in enumerate(s.turns):
            key = key_text(chat_prompt_text(turn.messages, s.tools))
            rid = f"{s.session_id}#{k}"
            out.append(
                SimRequest(
                    rid,
                    key.prompt_tokens,
                    output_tokens(turn),
                    key.keys,
                    key.block_tokens,
                    arrival_s=i * start_gap_s if prev is None else None,
                    after=prev,
                    delay_s=0.0 if prev is None else (turn.tool_time_s or think_s),
                    session=s.session_id,
                    is_first_turn=k == 0,
                )
            )
            prev = rid
    return out
