"""The Python API of the prefix index: keys, matching, eviction, the global tier, bad input."""

from __future__ import annotations

import hashlib
import pickle
import struct
import threading
from array import array

import pytest

from smetric import (
    GLOBAL_TIER,
    BlockKeys,
    PrefixIndex,
    hash_text,
    hash_tokens,
    hash_tokens_sglang,
)

SYSTEM = "You are an airline agent. Follow the policy below. " * 40


def make_index(*names: str, capacity: int = 10_000, global_capacity: int | None = None):
    index = PrefixIndex(global_capacity_blocks=global_capacity)
    for name in names:
        index.add_instance(name, capacity)
    return index


# ---- keys ---------------------------------------------------------------------------------


def test_text_keys_cover_full_blocks_only():
    assert len(hash_text("x" * 63)) == 0
    assert len(hash_text("x" * 64)) == 1
    assert len(hash_text("x" * 200, block_bytes=100)) == 2
    assert len(hash_text("é" * 32)) == 1  # 64 UTF-8 bytes


def test_str_and_its_utf8_bytes_give_equal_keys():
    text = SYSTEM + "Ünïcödé ✈"
    assert hash_text(text) == hash_text(text.encode())


def test_follow_up_turn_keys_extend_the_previous_turn():
    turn1 = SYSTEM + "User: change my flight."
    turn2 = turn1 + " Assistant: which one? User: the one to Boston."
    k1, k2 = hash_text(turn1), hash_text(turn2)
    assert k2[: len(k1)] == k1
    assert k2.common_prefix(k1) == len(k1)


def test_a_changed_byte_changes_every_later_key():
    a = hash_text("a" * 64 + "b" * 64 + "c" * 64)
    b = hash_text("a" * 64 + "B" + "b" * 63 + "c" * 64)
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]
    assert a.common_prefix(b) == 1


def test_token_keys_accept_lists_and_integer_buffers():
    ids = list(range(1000, 1064))
    want = hash_tokens(ids)
    assert len(want) == 4
    assert hash_tokens(array("I", ids)) == want
    assert hash_tokens(array("i", ids)) == want
    assert hash_tokens(array("q", ids)) == want
    assert hash_tokens(tuple(ids)) == want
    assert hash_tokens(iter(ids)) == want
    assert len(hash_tokens(ids, block_tokens=30)) == 2


def test_text_and_token_keys_never_collide():
    data = struct.pack("<16I", *range(16))
    assert hash_text(data)[0] != hash_tokens(list(range(16)))[0]


def test_sglang_page_hashes_equal_sglangs_event_values():
    ids = list(range(100, 140))
    keys = hash_tokens_sglang(ids, page_size=16)
    assert len(keys) == 2
    # SGLang: digest_i = sha256(digest_{i-1} || page ids as LE u32); event: 8 bytes, BE int64.
    d0 = hashlib.sha256(struct.pack("<16I", *ids[:16])).digest()
    d1 = hashlib.sha256(d0 + struct.pack("<16I", *ids[16:32])).digest()
    want = [struct.unpack(">q", d[:8])[0] for d in (d0, d1)]
    assert keys == BlockKeys.from_ids(want, chained=True)
    assert [k - (1 << 64) if k >= 1 << 63 else k for k in keys] == want


def test_from_ids_chains_unless_told_the_ids_are_chained():
    chained = BlockKeys.from_ids([7, 8, 9])
    assert chained != BlockKeys.from_ids([7, 8, 9], chained=True)
    assert chained[:2] == BlockKeys.from_ids([7, 8])
    assert BlockKeys.from_ids([7, 8, 9], chained=True).to_list() == [7, 8, 9]
    assert BlockKeys.from_ids([-1], chained=True)[0] == (1 << 64) - 1


def test_block_keys_behave_as_an_immutable_sequence():
    keys = hash_text(SYSTEM)
    assert list(keys) == keys.to_list()
    assert keys[-1] == keys.to_list()[-1]
    assert keys[2:5].to_list() == keys.to_list()[2:5]
    assert pickle.loads(pickle.dumps(keys)) == keys
    assert hash(keys) == hash(pickle.loads(pickle.dumps(keys)))
    assert len({keys, hash_text(SYSTEM)}) == 1
    with pytest.raises(IndexError):
        keys[len(keys)]
    with pytest.raises(ValueError, match="step 1"):
        keys[::2]
    with pytest.raises(AttributeError):
        keys.foo = 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: hash_text(123), TypeError),
        (lambda: hash_text(["a"]), TypeError),
        (lambda: hash_text("abc", block_bytes=0), ValueError),
        (lambda: hash_text("abc", block_bytes=-4), ValueError),
        (lambda: hash_tokens("abc"), TypeError),
        (lambda: hash_tokens(b"abc"), TypeError),
        (lambda: hash_tokens([1, "2"]), TypeError),
        (lambda: hash_tokens([1, 2.5]), TypeError),
        (lambda: hash_tokens([1, -2]), ValueError),
        (lambda: hash_tokens([1, 2**32]), ValueError),
        (lambda: hash_tokens(array("q", [-5] * 16)), ValueError),
        (lambda: hash_tokens([1, 2], block_tokens=0), ValueError),
        (lambda: hash_tokens_sglang([1, 2], page_size=0), ValueError),
        (lambda: BlockKeys.from_ids([1, 2, 1], chained=True), ValueError),
        (lambda: BlockKeys.from_ids([2**64]), OverflowError),
        (lambda: BlockKeys.from_ids(["a"]), TypeError),
        (lambda: BlockKeys.from_ids("abc"), TypeError),
    ],
)
def test_bad_key_input_raises_a_clear_error(call, error):
    with pytest.raises(error):
        call()


# ---- the index ----------------------------------------------------------------------------


def test_match_returns_every_instance_at_once_in_add_order():
    index = make_index("w0", "w1", "w2")
    turn1 = hash_text(SYSTEM + "User: hi.")
    turn2 = hash_text(SYSTEM + "User: hi. Assistant: hello! User: book a flight to Paris.")
    index.insert("w1", turn1)
    index.insert("w2", hash_text(SYSTEM))
    m = index.match(turn2)
    assert index.instances() == ["w0", "w1", "w2"]
    assert m.blocks == [0, len(turn1), len(hash_text(SYSTEM))]
    assert list(m.blocks) == [m[0], m[1], m[2]]
    assert m.best() == (1, len(turn1))
    assert m.query_blocks == len(turn2)
    assert index.match_instance("w1", turn2) == len(turn1)


def test_best_is_none_without_instances_and_first_on_ties():
    assert PrefixIndex().match(hash_text(SYSTEM)).best() is None
    index = make_index("w0", "w1")
    keys = hash_text(SYSTEM)
    index.insert("w0", keys)
    index.insert("w1", keys)
    assert index.match(keys).best() == (0, len(keys))


def test_eviction_keeps_whole_prefixes_and_forgets_the_least_recent():
    index = make_index("w0", capacity=40)
    shared = list(range(10))
    a = BlockKeys.from_ids([*shared, *range(100, 110)])
    b = BlockKeys.from_ids([*shared, *range(200, 210)])
    c = BlockKeys.from_ids(range(300, 310))
    for keys in (a, b, c):
        index.insert("w0", keys)
    index.insert("w0", c)  # refresh c; a is now the least recent
    index.insert("w0", BlockKeys.from_ids(range(400, 410)))
    assert index.match(a).blocks == [10]  # its own tail went; the shared prefix stays (b uses it)
    assert index.match(b).blocks == [20]
    assert index.match(c).blocks == [10]
    stats = index.stats()["instances"]["w0"]
    assert stats["blocks"] == 40
    assert stats["evicted_blocks"] == 10
    index._check_invariants()


def test_a_touching_match_refreshes_the_path_and_a_plain_one_does_not():
    def run(touch: bool) -> list[int]:
        index = make_index("w0", capacity=20)
        a, b = BlockKeys.from_ids(range(10)), BlockKeys.from_ids(range(10, 20))
        index.insert("w0", a)
        index.insert("w0", b)
        index.match(a, touch=touch)
        index.insert("w0", BlockKeys.from_ids(range(20, 30)))
        return [index.match(a).blocks[0], index.match(b).blocks[0]]

    assert run(touch=True) == [10, 0]
    assert run(touch=False) == [0, 10]


def test_remove_follows_kv_event_evictions():
    index = make_index("w0", "w1")
    keys = hash_tokens(list(range(16 * 8)))
    index.insert("w0", keys)
    index.insert("w1", keys)
    # An event names blocks 5 and 3 (any order): w0 loses 3..8.
    assert index.remove("w0", BlockKeys.from_ids([keys[5], keys[3]], chained=True)) == 5
    assert index.match(keys).blocks == [3, 8]
    assert index.remove("w0", BlockKeys.from_ids([12345], chained=True)) == 0


def test_sglang_kv_event_hashes_land_on_predicted_keys():
    index = make_index("w0")
    prompt = list(range(5000, 5000 + 64))
    index.insert("w0", hash_tokens_sglang(prompt, page_size=16))
    d = b""
    event_hashes = []
    for i in range(4):
        d = hashlib.sha256(d + struct.pack("<16I", *prompt[16 * i : 16 * i + 16])).digest()
        event_hashes.append(struct.unpack(">q", d[:8])[0])
    removed = BlockKeys.from_ids(event_hashes[2:], chained=True)  # BlockRemoved
    assert index.remove("w0", removed) == 2
    assert index.match(hash_tokens_sglang(prompt, 16)).blocks == [2]


def test_clear_and_remove_instance():
    index = make_index("w0", "w1")
    keys = hash_text(SYSTEM)
    index.insert("w0", keys)
    index.insert("w1", keys)
    assert index.clear("w0") == len(keys)
    assert index.match(keys).blocks == [0, len(keys)]
    assert index.remove_instance("w1") == len(keys)
    assert index.instances() == ["w0"]
    assert "w1" not in index
    assert index.stats()["unique_blocks"] == 0
    index.add_instance("w1", 10)  # the name can be used again
    assert index.match(keys).blocks == [0, 0]


def test_global_tier_has_its_own_capacity_and_is_reported_apart():
    index = make_index("w0", global_capacity=5)
    keys = hash_text(SYSTEM)
    assert len(keys) > 5
    index.insert(GLOBAL_TIER, keys)
    m = index.match(keys)
    assert m.blocks == [0]
    assert m.global_blocks == 5
    assert index.instances() == ["w0"]
    assert index.has_global_tier
    assert index.stats()["global"]["blocks"] == 5
    assert not PrefixIndex().has_global_tier
    assert PrefixIndex().match(keys).global_blocks == 0


def test_stats_count_shared_blocks_once():
    index = make_index("w0", "w1")
    keys = hash_text(SYSTEM)
    index.insert("w0", keys)
    index.insert("w1", keys)
    stats = index.stats()
    assert stats["unique_blocks"] == len(keys)
    assert stats["instances"]["w0"]["blocks"] == stats["instances"]["w1"]["blocks"] == len(keys)
    assert stats["nodes"] == 1
    assert 0 < stats["bytes_used"] < 100 * 2 * len(keys) + 4096


def _snapshot(index: PrefixIndex, keys: BlockKeys):
    return index.stats(), index.match(keys, touch=False).blocks, index.instances()


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda i, k: i.insert("nope", k), KeyError),
        (lambda i, k: i.remove("nope", k), KeyError),
        (lambda i, k: i.clear("nope"), KeyError),
        (lambda i, k: i.match_instance("nope", k), KeyError),
        (lambda i, k: i.remove_instance("nope"), KeyError),
        (lambda i, k: i.set_capacity("nope", 1), KeyError),
        (lambda i, k: i.add_instance("w0", 10), ValueError),
        (lambda i, k: i.add_instance("", 10), ValueError),
        (lambda i, k: i.add_instance("w9", -1), ValueError),
        (lambda i, k: i.set_capacity("w0", -1), ValueError),
        (lambda i, k: i.add_instance("w9", "10"), TypeError),
        (lambda i, k: i.add_instance("w9", 1.5), TypeError),
        (lambda i, k: i.add_instance(9, 10), TypeError),
        (lambda i, k: i.insert("w0", k.to_list()), TypeError),
        (lambda i, k: i.match([1, 2, 3]), TypeError),
        (lambda i, k: i.remove("w0", "abc"), TypeError),
        # The new blocks reuse a key already indexed under another prefix (unchained ids).
        (lambda i, k: i.insert("w0", BlockKeys.from_ids([1, k[3]], chained=True)), ValueError),
    ],
)
def test_bad_index_calls_raise_and_change_nothing(call, error):
    index = make_index("w0", "w1", global_capacity=100)
    keys = hash_text(SYSTEM)
    index.insert("w0", keys)
    index.insert("w1", keys[:4])
    before = _snapshot(index, keys)
    with pytest.raises(error):
        call(index, keys)
    after = _snapshot(index, keys)
    assert after[1:] == before[1:]
    for key in ("instances", "global", "nodes", "unique_blocks"):
        assert after[0][key] == before[0][key]
    index._check_invariants()


def test_an_insert_in_steps_ends_as_one_insert_does():
    import random

    rng = random.Random(7)
    trunk = list(range(1_000, 1_300))
    prompts = []
    for i in range(40):  # sessions that share openings and grow turn by turn
        base = trunk[: rng.randrange(0, 300)] + [10_000 * (i % 8) + j for j in range(50)]
        prompts.append(BlockKeys.from_ids(base + list(range(100_000 * i, 100_000 * i + 600))))
    for capacity in (100_000, 2_000, 450):  # nothing evicted; some; more than a prompt holds
        whole = make_index("w0", "w1", capacity=capacity, global_capacity=5_000)
        stepped = make_index("w0", "w1", capacity=capacity, global_capacity=5_000)
        for i, keys in enumerate(prompts):
            name = f"w{i % 2}"
            added = whole.insert(name, keys)
            assert stepped.insert(name, keys, step=97) == added
            whole.insert(GLOBAL_TIER, keys)
            stepped.insert(GLOBAL_TIER, keys, step=1)
        for keys in prompts:
            a, b = whole.match(keys, touch=False), stepped.match(keys, touch=False)
            assert (a.blocks, a.global_blocks) == (b.blocks, b.global_blocks)
        # Only the last step evicts: the very same holdings, evictions and tree (the memory
        # differs by what growing a node's keys step by step leaves spare).
        a, b = whole.stats(), stepped.stats()
        del a["bytes_used"], b["bytes_used"]
        assert a == b
        stepped._check_invariants()
    with pytest.raises(ValueError, match="step"):
        stepped.insert("w0", prompts[0], step=0)


@pytest.mark.parametrize("tail", [150, 50])  # the failing step is not the last; it is
def test_a_stepped_insert_that_fails_midway_leaves_its_instance_within_capacity(tail):
    # Keys taken as they are (not chained): the prompt reuses, at block 700, a key that names
    # another prefix, which the step reaching it finds; the steps before went in over capacity.
    # (Prompts of 512 blocks or more go in steps.)
    index = make_index("w0", capacity=250)
    index.insert("w0", BlockKeys.from_ids([9_000, 9_001], chained=True))
    ids = [*range(1_000, 1_700), 9_001, *range(2_000, 2_000 + tail - 1)]
    with pytest.raises(ValueError, match="position 700"):
        index.insert("w0", BlockKeys.from_ids(ids, chained=True), step=100)
    assert index.stats()["instances"]["w0"]["blocks"] <= 250
    index._check_invariants()


def test_negative_global_capacity_is_rejected():
    with pytest.raises(ValueError, match="global_capacity_blocks"):
        PrefixIndex(global_capacity_blocks=-1)


def test_concurrent_use_from_threads_stays_consistent():
    index = make_index(*(f"w{i}" for i in range(4)), capacity=500)
    sessions = [hash_text(SYSTEM + f"session {s} " * 50) for s in range(16)]
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for step in range(200):
                keys = sessions[(t * 7 + step) % len(sessions)]
                name = f"w{(t + step) % 4}"
                index.insert(name, keys)
                m = index.match(keys)
                assert m.blocks[(t + step) % 4] >= min(len(keys), 1)
                if step % 50 == 0:
                    index.remove(name, keys[len(keys) - 1 :])
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    index._check_invariants()
    assert all(v["blocks"] <= 500 for v in index.stats()["instances"].values())
