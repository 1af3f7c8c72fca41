"""A small pure-Python model of ``PrefixIndex``, for differential tests.

Each instance holds a set of whole prefixes (tuples of block ids), each stamped with the tick of
its last use and its depth. Eviction removes the prefix with the smallest (tick, -depth): the
deepest block of the least recently used path, so what remains is still a set of whole prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence

Prefix = tuple[int, ...]


class ReferenceIndex:
    def __init__(self) -> None:
        self.capacity: dict[str, int] = {}
        self.held: dict[str, dict[Prefix, tuple[int, int]]] = {}
        self.tick = 0

    def add_instance(self, name: str, capacity_blocks: int) -> None:
        self.capacity[name] = capacity_blocks
        self.held[name] = {}

    def _evict(self, name: str) -> None:
        held = self.held[name]
        while len(held) > self.capacity[name]:
            victim = min(held, key=lambda p: (held[p][0], -held[p][1]))
            del held[victim]

    def insert(self, name: str, prompt: Sequence[int]) -> int:
        self.tick += 1
        held = self.held[name]
        added = 0
        for depth in range(1, len(prompt) + 1):
            prefix = tuple(prompt[:depth])
            added += prefix not in held
            held[prefix] = (self.tick, depth)
        self._evict(name)
        return added

    def matched(self, name: str, prompt: Sequence[int]) -> int:
        held = self.held[name]
        depth = 0
        while depth < len(prompt) and tuple(prompt[: depth + 1]) in held:
            depth += 1
        return depth

    def match(self, prompt: Sequence[int], touch: bool) -> dict[str, int]:
        result = {name: self.matched(name, prompt) for name in self.held}
        if touch:
            self.tick += 1
            for name, depth in result.items():
                for d in range(1, depth + 1):
                    self.held[name][tuple(prompt[:d])] = (self.tick, d)
        return result

    def remove(self, name: str, prefixes: Sequence[Prefix]) -> int:
        held = self.held[name]
        removed = 0
        for prefix in prefixes:
            if prefix in held:
                gone = [p for p in held if p[: len(prefix)] == prefix]
                for p in gone:
                    del held[p]
                removed += len(gone)
        return removed

    def clear(self, name: str) -> int:
        n = len(self.held[name])
        self.held[name].clear()
        return n

    def set_capacity(self, name: str, capacity_blocks: int) -> None:
        self.capacity[name] = capacity_blocks
        self._evict(name)
