"""Benchmarks of the prefix index's hot path (pytest-benchmark).

Run: ``pytest benches --benchmark-only``. CI runs them once with ``--benchmark-disable`` so they
cannot rot. Numbers and the machine are in the README. Each group has a pure-Python peer doing
the same job the way a Python router would, so results read as ratios.
"""

from __future__ import annotations

import random
from itertools import count, cycle

import pytest
import xxhash

from smetric import GLOBAL_TIER, BlockKeys, PrefixIndex, hash_text, hash_tokens

TEXT_BYTES = 128 * 1024
TOKENS = 32_768
INSTANCES = 64
BLOCKS_PER_INSTANCE = 16_384  # 64 x 16,384 = 1,048,576 resident blocks
SYSTEM_PROMPTS = 8
SYSTEM_BLOCKS = 120  # ~7.5 KB of text at 64 bytes a block: an agent's policy + tool schemas
QUERY_BLOCKS = 2048


def _text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["flight", "booking", "the", "agent", "tool", "call", "user", "reservation", "{", "}"]
    out, size = [], 0
    while size < n:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


# ---- hashing ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_128k() -> str:
    return _text(TEXT_BYTES)


def _python_chained_xxh3(data: bytes, block: int = 64) -> list[int]:
    keys, prev = [], 0
    for i in range(0, len(data) - block + 1, block):
        prev = xxhash.xxh3_64_intdigest(data[i : i + block], seed=prev)
        keys.append(prev)
    return keys


@pytest.mark.benchmark(group="hash_text 128 KB")
def test_hash_text_128k(benchmark, text_128k):
    keys = benchmark(hash_text, text_128k)
    assert len(keys) == TEXT_BYTES // 64
    benchmark.extra_info["bytes"] = TEXT_BYTES


@pytest.mark.benchmark(group="hash_text 128 KB")
def test_peer_python_xxhash_chain_128k(benchmark, text_128k):
    data = text_128k.encode()
    keys = benchmark(_python_chained_xxh3, data)
    assert len(keys) == TEXT_BYTES // 64


@pytest.fixture(scope="module")
def tokens_32k() -> list[int]:
    rng = random.Random(1)
    return [rng.randrange(150_000) for _ in range(TOKENS)]


@pytest.mark.benchmark(group="hash_tokens 32k")
def test_hash_tokens_32k_list(benchmark, tokens_32k):
    keys = benchmark(hash_tokens, tokens_32k)
    assert len(keys) == TOKENS // 16


@pytest.mark.benchmark(group="hash_tokens 32k")
def test_hash_tokens_32k_array(benchmark, tokens_32k):
    from array import array

    ids = array("I", tokens_32k)
    keys = benchmark(hash_tokens, ids)
    assert len(keys) == TOKENS // 16


@pytest.mark.benchmark(group="hash_tokens 32k")
def test_peer_python_xxhash_chain_tokens_32k(benchmark, tokens_32k):
    from array import array

    def run() -> list[int]:
        return _python_chained_xxh3(array("I", tokens_32k).tobytes(), block=64)

    keys = benchmark(run)
    assert len(keys) == TOKENS // 16


# ---- a cluster-sized index ----------------------------------------------------------------


class Cluster:
    """64 instances holding >= 1M blocks: shared system prompts and long session chains, some
    sessions held twice (migrated). Sessions are inserted turn by turn, as a router would."""

    def __init__(self, seed: int = 7) -> None:
        rng = random.Random(seed)
        self.names = [f"w{i}" for i in range(INSTANCES)]
        self.index = PrefixIndex(global_capacity_blocks=4 * BLOCKS_PER_INSTANCE)
        systems = [[rng.getrandbits(63) for _ in range(SYSTEM_BLOCKS)] for _ in range(8)]
        self.sessions: list[tuple[str, list[int]]] = []
        for name in self.names:
            self.index.add_instance(name, BLOCKS_PER_INSTANCE)
        for name in self.names:
            held = 0
            while held < BLOCKS_PER_INSTANCE:
                length = rng.randint(200, 2000)
                ids = rng.choice(systems) + [rng.getrandbits(63) for _ in range(length)]
                keys = BlockKeys.from_ids(ids)
                turns = rng.randint(3, 8)
                for t in range(1, turns + 1):
                    prefix = keys[: SYSTEM_BLOCKS + length * t // turns]
                    self.index.insert(name, prefix)
                if rng.random() < 0.1:
                    self.index.insert(rng.choice(self.names), keys)
                if rng.random() < 0.3:
                    self.index.insert(GLOBAL_TIER, keys)
                self.sessions.append((name, ids))
                held += length
        stats = self.index.stats()
        self.resident_blocks = sum(v["blocks"] for v in stats["instances"].values())
        self.unique_blocks = stats["unique_blocks"]
        self.bytes_used = stats["bytes_used"]
        assert self.resident_blocks >= 1_000_000

        # The query: the next turn of the most recent long session of w0, 2048 blocks in all.
        name, ids = next((n, i) for n, i in reversed(self.sessions) if n == "w0" and len(i) > 900)
        extra = [rng.getrandbits(63) for _ in range(QUERY_BLOCKS - len(ids))]
        self.query = BlockKeys.from_ids(ids + extra)
        self.query_list = self.query.to_list()


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return Cluster()


@pytest.mark.benchmark(group="match 2048 blocks, 64 instances, 1M blocks")
def test_match_2048_blocks_64_instances(benchmark, cluster):
    m = benchmark(cluster.index.match, cluster.query)
    assert m.blocks[0] >= 900
    assert len(m.blocks) == INSTANCES
    benchmark.extra_info["resident_blocks"] = cluster.resident_blocks
    benchmark.extra_info["matched_blocks_w0"] = m.blocks[0]


@pytest.mark.benchmark(group="match 2048 blocks, 64 instances, 1M blocks")
def test_match_2048_blocks_64_instances_no_touch(benchmark, cluster):
    m = benchmark(cluster.index.match, cluster.query, touch=False)
    assert m.blocks[0] >= 900


@pytest.mark.benchmark(group="match 2048 blocks, 64 instances, 1M blocks")
def test_peer_python_sets_match(benchmark, cluster):
    """The naive Python router: a set of block keys per instance, scanned per request."""
    stats = cluster.index.stats()["instances"]
    # Rebuild each instance's held keys from the index itself (the sets hold the same data).
    held: dict[str, set[int]] = {n: set() for n in cluster.names}
    for _, ids in cluster.sessions:
        keys = BlockKeys.from_ids(ids)
        key_list = keys.to_list()
        for n in cluster.names:
            depth = cluster.index.match_instance(n, keys, touch=False)
            held[n].update(key_list[:depth])
    assert sum(len(s) for s in held.values()) >= sum(v["blocks"] for v in stats.values()) * 0.99

    def match() -> list[int]:
        out = []
        for n in cluster.names:
            s, d = held[n], 0
            for k in cluster.query_list:
                if k not in s:
                    break
                d += 1
            out.append(d)
        return out

    blocks = benchmark(match)
    assert blocks == cluster.index.match(cluster.query, touch=False).blocks


# ---- inserts with eviction ----------------------------------------------------------------


@pytest.mark.benchmark(group="insert 2048 blocks with eviction")
def test_insert_2048_blocks_with_eviction(benchmark):
    rng = random.Random(3)
    system = [rng.getrandbits(63) for _ in range(SYSTEM_BLOCKS)]
    tail = QUERY_BLOCKS - SYSTEM_BLOCKS
    pool = [
        BlockKeys.from_ids(system + [rng.getrandbits(63) for _ in range(tail)]) for _ in range(100)
    ]
    index = PrefixIndex()
    for i in range(4):
        index.add_instance(f"w{i}", 65_536)
    prompts = cycle(pool)
    # Fill w0 to capacity so every measured insert evicts about as much as it adds.
    for _ in range(40):
        index.insert("w0", next(prompts))
    assert index.stats()["instances"]["w0"]["evicted_blocks"] > 0

    added: list[int] = []
    benchmark.pedantic(lambda: added.append(index.insert("w0", next(prompts))), rounds=400)
    # Each measured insert really added (and evicted) all but the shared system prompt.
    assert set(added) == {QUERY_BLOCKS - SYSTEM_BLOCKS}
    stats = index.stats()["instances"]["w0"]
    assert stats["blocks"] == 65_536
    benchmark.extra_info["blocks_per_insert"] = QUERY_BLOCKS


RECORD_BLOCKS = 8_192  # a 512 KB text prompt
GLOBAL_BLOCKS = 4_000_000  # the router's default global tier


@pytest.mark.benchmark(group="record a distinct 8192-block prompt at capacity")
def test_record_8192_blocks_worker_and_global_tier_at_capacity(benchmark):
    """What the router's index does after serving a distinct 512 KB prompt (``record``): insert
    it for the worker and the global tier, in 1,024-block steps, both at capacity, so that each
    record also evicts as much from each. The key table then holds ~4 M keys, well beyond the
    caches: each new key and each evicted one is a cache miss."""
    index = PrefixIndex(global_capacity_blocks=GLOBAL_BLOCKS)
    for w in ("w0", "w1"):
        index.add_instance(w, 1_000_000)
    prompts = (BlockKeys.from_ids(range(i << 20, (i << 20) + RECORD_BLOCKS)) for i in count())

    def record(worker: str) -> int:
        keys = next(prompts)
        added = index.insert(worker, keys, step=1_024)
        index.insert(GLOBAL_TIER, keys, step=1_024)
        return added

    for i in range(GLOBAL_BLOCKS // RECORD_BLOCKS + 20):
        record(f"w{i % 2}")
    stats = index.stats()
    assert stats["global"]["blocks"] == GLOBAL_BLOCKS and stats["global"]["evicted_blocks"] > 0
    assert stats["instances"]["w0"]["evicted_blocks"] > 0

    turns = cycle(("w0", "w1"))
    added: list[int] = []
    benchmark.pedantic(lambda: added.append(record(next(turns))), rounds=200)
    assert set(added) == {RECORD_BLOCKS}
    assert index.stats()["global"]["blocks"] == GLOBAL_BLOCKS
    benchmark.extra_info["blocks_per_record"] = RECORD_BLOCKS


# ---- memory -------------------------------------------------------------------------------


def test_memory_per_resident_block(cluster, record_property):
    """Bytes of index structures per resident block (an instance holding a block = one)."""
    per_resident = cluster.bytes_used / cluster.resident_blocks
    per_unique = cluster.bytes_used / cluster.unique_blocks
    record_property("bytes_per_resident_block", round(per_resident, 1))
    record_property("bytes_per_unique_block", round(per_unique, 1))
    print(
        f"\nresident blocks {cluster.resident_blocks:,}, unique {cluster.unique_blocks:,}, "
        f"index bytes {cluster.bytes_used:,}: {per_resident:.1f} B/resident block, "
        f"{per_unique:.1f} B/unique block"
    )
    assert cluster.bytes_used > 8 * cluster.unique_blocks  # at least the keys themselves
