"""Mooncake FAST'25 traces: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``.

Each hash id names one 512-token block and ids are chained (equal ids mean equal prefixes), so
they key the index as they are. The last block of a prompt is usually partial.

The trace has no session ids; ``reconstruct_sessions`` recovers them from the hash ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smetric import BlockKeys
from smetric.sim import SimRequest
from smetric.workload import read_jsonl
from smetric.workload.sessions import ServiceTime, link_turns

MOONCAKE_BLOCK_TOKENS = 512

_SHARED = -1


def reconstruct_sessions(
    hash_ids: Sequence[Sequence[int]],
    input_lengths: Sequence[int],
    timestamps: Sequence[float],
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[int | None]:
    """The previous turn of each request (an index into the inputs), or None for a first turn.

    Requests come in arrival order. Request R is a next turn of an earlier request P when

    * P's **full** blocks (all its ids but a trailing partial one; all of them when its length
      is a whole number of blocks) are a prefix of R's ids. P's partial last block cannot be
      required: R's block at that position holds P's tail *plus* P's answer and R's new message,
      so it is a different block with a different id. This is the same as "R's ids except its
      last extend P's ids except P's last", the relation the trace's README describes;
    * R is longer (``input_length``) and arrived strictly later: a next turn carries the
      previous prompt plus at least the answer, and cannot arrive before it was answered;
    * the deepest block they share belongs to P's session alone. A block that two sessions
      already pass through is a prefix common to unrelated conversations (the system prompt that
      every request of the Kimi trace starts with, or a shared template or document); sharing
      only such blocks is no evidence of a conversation, so R then starts a session of its own.
      Sessions are attributed online, in arrival order, as a router would see them.

    Among the candidates, the one sharing the most blocks wins (the latest turn of the
    conversation rather than an early one it also extends), then the most recent (a retried or
    regenerated turn, rather than the original).

    Because ids are chained, "P's full blocks are a prefix of R's ids" is "R's id at P's last
    full position equals P's": an index from each request's last full id finds the candidates.
    A request whose full blocks are all shared (e.g. the system prompt plus a partial block) can
    never be a parent: its follow-ups are indistinguishable from new conversations.
    """
    if not len(hash_ids) == len(input_lengths) == len(timestamps):
        raise ValueError("hash_ids, input_lengths and timestamps must have the same length")
    ends: dict[int, list[int]] = {}  # a last full id -> the requests ending there, oldest first
    owner: dict[int, int] = {}  # a full block's id -> the one session through it, or _SHARED
    parents: list[int | None] = []
    roots: list[int] = []
    for i, ids in enumerate(hash_ids):
        parent = None
        for j in range(len(ids) - 1, -1, -1):
            session = owner.get(ids[j])
            if session is None:
                continue  # a block nobody has: no candidate ends here
            if session == _SHARED:
                break  # shared here, so shared at every shallower block too
            for p in reversed(ends.get(ids[j], ())):
                if input_lengths[p] < input_lengths[i] and timestamps[p] < timestamps[i]:
                    parent = p
                    break
            if parent is not None:
                break
        parents.append(parent)
        root = i if parent is None else roots[parent]
        roots.append(root)
        full = min(len(ids), input_lengths[i] // block_tokens)
        for block in ids[:full]:
            if owner.setdefault(block, root) != root:
                owner[block] = _SHARED
        if full:
            ends.setdefault(ids[full - 1], []).append(i)
    return parents


@dataclass(frozen=True)
class TraceRow:
    """One row of a Mooncake-style trace."""

    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _trace_row(raw: Any) -> TraceRow:
    ids, n_in, n_out = raw["hash_ids"], raw["input_length"], raw["output_length"]
    if not isinstance(n_in, int) or not isinstance(n_out, int) or n_in < 1 or n_out < 0:
        raise ValueError("input_length >= 1 and output_length >= 0 must be integers")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise TypeError("hash_ids must be a list of integers")
    if len(ids) != math.ceil(n_in / MOONCAKE_BLOCK_TOKENS):
        raise ValueError(
            f"{len(ids)} hash ids for {n_in} input tokens "
            f"(one per {MOONCAKE_BLOCK_TOKENS}-token block expected)"
        )
    return TraceRow(float(raw["timestamp"]) / 1000.0, n_in, n_out, tuple(ids))


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRow]:
    """The first ``limit`` rows of a Mooncake trace (``.gz`` allowed), checked: one hash id per
    512-token block of the input."""
    return read_jsonl(path, _trace_row, "a Mooncake trace row", limit)


def load_mooncake(
    path: str | Path,
    limit: int | None = None,
    closed_loop: bool = False,
    service_time_s: ServiceTime | None = None,
) -> list[SimRequest]:
    """The first ``limit`` requests of a Mooncake trace, with sessions reconstructed (see
    ``reconstruct_sessions``): ``session`` is the first turn's rid, ``is_first_turn`` set.

    Open loop by default: every request arrives at its trace time. ``closed_loop=True`` makes a
    next turn wait for its previous turn's answer, then the think time (see ``link_turns``;
    ``service_time_s`` estimates how long the previous turn took in the trace)."""
    rows = read_trace(path, limit)
    requests = []
    for i, row in enumerate(rows):
        try:
            keys = BlockKeys.from_ids(row.hash_ids, chained=True)
        except ValueError:  # a repeated id: chain them so keys stay prefix-unique
            keys = BlockKeys.from_ids(row.hash_ids)
        requests.append(
            SimRequest(
                rid=f"mc{i}",
                prompt_tokens=row.input_length,
                output_tokens=row.output_length,
                keys=keys,
                block_tokens=MOONCAKE_BLOCK_TOKENS,
                arrival_s=row.timestamp_s,
            )
        )
    parents = reconstruct_sessions(
        [r.hash_ids for r in rows],
        [r.input_length for r in rows],
        [r.timestamp_s for r in rows],
    )
    return link_turns(requests, parents, closed_loop, service_time_s)
