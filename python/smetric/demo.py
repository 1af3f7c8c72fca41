"""``smetric demo``: the bundled real agent sessions, keyed and matched by the prefix index.

Replays the sessions' turns (all sessions in flight at once, turn by turn) onto a small cluster
of instances sharing a global KV tier, under three placements, and reports where each prompt's
blocks were found: in the chosen instance's cache (local), in the global tier, or nowhere
(recomputed), with how evenly requests spread. It shows the trade-off SMetric resolves; the
router with its policies and an emulated cluster come with the router and engine work.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from smetric import GLOBAL_TIER, Match, PrefixIndex, hash_text
from smetric.request import chat_prompt_text
from smetric.workload.agents import Session, load_sessions

# Chooses an instance position from the match, requests per instance, and first-turn-ness.
Placement = Callable[[Match, Sequence[int], bool], int]


def _least_requests(requests: Sequence[int]) -> int:
    return min(range(len(requests)), key=lambda i: requests[i])


def round_robin() -> Placement:
    counter = iter(range(1 << 62))
    return lambda match, requests, first: next(counter) % len(requests)


def cache_affinity() -> Placement:
    """Most local hit; fewest requests on ties."""
    return lambda match, requests, first: max(
        range(len(requests)), key=lambda i: (match.blocks[i], -requests[i])
    )


def session_balance() -> Placement:
    """First turns to the least loaded instance, follow-ups to the best local hit."""

    def place(match: Match, requests: Sequence[int], first: bool) -> int:
        if first:
            return _least_requests(requests)
        return cache_affinity()(match, requests, first)

    return place


PLACEMENTS: dict[str, Callable[[], Placement]] = {
    "round_robin": round_robin,
    "cache_affinity": cache_affinity,
    "session_balance": session_balance,
}


@dataclass
class Result:
    placement: str
    prompt_blocks: int = 0
    local_blocks: int = 0
    global_blocks: int = 0
    requests: list[int] = field(default_factory=list)
    keying_us: list[float] = field(default_factory=list)
    match_us: list[float] = field(default_factory=list)

    def share(self, blocks: int) -> float:
        return 100.0 * blocks / max(self.prompt_blocks, 1)


def replay(
    sessions: Sequence[Session],
    placement: str,
    instances: int = 4,
    capacity_blocks: int = 4096,
    global_capacity_blocks: int = 1 << 20,
) -> Result:
    index = PrefixIndex(global_capacity_blocks=global_capacity_blocks)
    names = [f"w{i}" for i in range(instances)]
    for name in names:
        index.add_instance(name, capacity_blocks)
    place = PLACEMENTS[placement]()
    result = Result(placement, requests=[0] * instances)
    for turn in range(max(len(s.turns) for s in sessions)):
        for s in sessions:
            if turn >= len(s.turns):
                continue
            t0 = time.perf_counter()
            keys = hash_text(chat_prompt_text(s.turns[turn].messages, s.tools))
            t1 = time.perf_counter()
            match = index.match(keys, touch=False)
            t2 = time.perf_counter()
            result.keying_us.append((t1 - t0) * 1e6)
            result.match_us.append((t2 - t1) * 1e6)
            chosen = place(match, result.requests, turn == 0)
            local = match.blocks[chosen]
            result.prompt_blocks += len(keys)
            result.local_blocks += local
            result.global_blocks += max(match.global_blocks - local, 0)
            result.requests[chosen] += 1
            index.insert(names[chosen], keys)
            index.insert(GLOBAL_TIER, keys)  # write-through, as HiCache + Mooncake do
    return result


def main(instances: int = 4, capacity_blocks: int = 4096) -> int:
    sessions = load_sessions()
    turns = sum(len(s.turns) for s in sessions)
    print(
        f"{len(sessions)} real agent sessions (tau-bench airline), {turns} requests, "
        f"{instances} instances of {capacity_blocks} blocks (64 B text blocks) + a global tier\n"
    )
    header = (
        f"{'placement':<16} {'local hit':>9} {'global hit':>10} {'recomputed':>10} "
        f"{'requests/instance':>18} {'serialize+hash µs':>17} {'match µs':>8}  (medians)"
    )
    print(header)
    print("-" * len(header))
    for name in PLACEMENTS:
        r = replay(sessions, name, instances, capacity_blocks)
        recomputed = r.prompt_blocks - r.local_blocks - r.global_blocks
        spread = f"{min(r.requests)}-{max(r.requests)}"
        print(
            f"{name:<16} {r.share(r.local_blocks):>8.1f}% {r.share(r.global_blocks):>9.1f}% "
            f"{r.share(recomputed):>9.1f}% {spread:>18} "
            f"{statistics.median(r.keying_us):>17.1f} {statistics.median(r.match_us):>8.1f}"
        )
    return 0
