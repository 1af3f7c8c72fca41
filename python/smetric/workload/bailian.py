"""Alibaba Bailian traces (Qwen-Bailian usage traces, KVCache@ATC'25), JSONL, one request a line.

Format, from the release's README (github.com/alibaba-edu/qwen-bailian-usagetraces-anon)::

    {"chat_id": 159, "parent_chat_id": 55, "timestamp": 61.114, "input_length": 521,
     "output_length": 132, "type": "text", "turn": 2, "hash_ids": [1089, 1090, ...]}

``chat_id`` names the request; ``parent_chat_id`` is the previous turn's ``chat_id``, -1 for a
first turn; ``timestamp`` is seconds since the trace began; ``turn`` counts from 1; ``type`` is
text / search / image / file (not used here); ``hash_ids`` are salted SipHash-2-4 hashes of each
16-token block, remapped to integers. Each hash covers one block's tokens only, so the ids are
chained here into prefix keys. The release's notes (docs/qa-context-growth-pattern.md) say a next
turn may not repeat every token of the previous answer (the chat template's think markers are
stripped) and that the last block of a prompt is padded, so a next turn shares its previous
turn's blocks except the last one, like Mooncake's.

Tolerated variations: ``parent_chat_id`` absent or null means a first turn; a ``timestamp_ms``
field instead of ``timestamp`` is milliseconds; ``timestamp_unit="ms"`` reads ``timestamp`` as
milliseconds for files that use it so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from smetric import BlockKeys
from smetric.sim import SimRequest
from smetric.workload import read_jsonl
from smetric.workload.sessions import ServiceTime, link_turns

BAILIAN_BLOCK_TOKENS = 16


def _arrival_s(row: dict[str, Any], unit: Literal["s", "ms"]) -> float:
    if "timestamp" in row:
        t = float(row["timestamp"])
        return t / 1000.0 if unit == "ms" else t
    return float(row["timestamp_ms"]) / 1000.0


def _parent(row: dict[str, Any]) -> str | None:
    parent = row.get("parent_chat_id")
    if parent is None or parent == -1 or parent == "-1":
        return None
    if isinstance(parent, bool) or not isinstance(parent, int | str):
        raise TypeError(f"parent_chat_id must be an id or -1, not {parent!r}")
    return str(parent)


def load_bailian(
    path: str | Path,
    limit: int | None = None,
    closed_loop: bool = False,
    service_time_s: ServiceTime | None = None,
    timestamp_unit: Literal["s", "ms"] = "s",
) -> list[SimRequest]:
    """The first ``limit`` requests of a Bailian trace, rid ``bl<chat_id>``, with ``session``
    (the first turn's rid) and ``is_first_turn`` from ``parent_chat_id``.

    A request whose parent is not among the loaded rows (the trace window, or ``limit``, cut the
    conversation) starts a session here: nothing in the replay holds its earlier turns, so to a
    router it is a first turn. Open loop by default; ``closed_loop=True`` as in ``link_turns``.
    """
    if timestamp_unit not in ("s", "ms"):
        raise ValueError(f"timestamp_unit must be 's' or 'ms', not {timestamp_unit!r}")
    seen: set[str] = set()

    def parse(row: Any) -> tuple[SimRequest, str | None]:
        chat_id = row["chat_id"]
        if isinstance(chat_id, bool) or not isinstance(chat_id, int | str):
            raise TypeError(f"chat_id must be an int or a string, not {chat_id!r}")
        cid = str(chat_id)
        if cid in seen:
            raise ValueError(f"chat_id {cid} appears twice")
        ids = row["hash_ids"]
        if not isinstance(ids, list) or not all(isinstance(x, int) for x in ids):
            raise TypeError("hash_ids must be a list of ints")
        prompt, output = int(row["input_length"]), int(row["output_length"])
        if prompt < 1 or output < 0:
            raise ValueError("input_length must be >= 1 and output_length >= 0")
        parent = _parent(row)
        if parent == cid:
            raise ValueError(f"chat {cid} names itself as its parent")
        seen.add(cid)
        request = SimRequest(
            rid=f"bl{cid}",
            prompt_tokens=prompt,
            output_tokens=output,
            keys=BlockKeys.from_ids(ids),
            block_tokens=BAILIAN_BLOCK_TOKENS,
            arrival_s=_arrival_s(row, timestamp_unit),
        )
        return request, parent

    rows = read_jsonl(path, parse, "a Bailian trace row", limit)
    requests = [r for r, _ in rows]
    parent_ids = [p for _, p in rows]
    index = {r.rid[2:]: i for i, r in enumerate(requests)}
    # Turns in arrival order, so that each parent precedes its follow-ups.
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s or 0.0, i))
    position = {i: k for k, i in enumerate(order)}
    parents: list[int | None] = []
    for i in order:
        parent_id = parent_ids[i]
        p = None if parent_id is None else index.get(parent_id)
        if p is not None and position[p] > position[i]:
            raise ValueError(
                f"{path}: chat {requests[i].rid[2:]} arrives before its parent {parent_id}"
            )
        parents.append(None if p is None else position[p])
    return link_turns([requests[i] for i in order], parents, closed_loop, service_time_s)
