"""PrefixIndex against the pure-Python reference model, on random operation sequences."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference_index import ReferenceIndex
from smetric import GLOBAL_TIER, BlockKeys, PrefixIndex

NAMES = ["w0", "w1", "w2", GLOBAL_TIER]

names = st.sampled_from(NAMES)


def operations(prompts: st.SearchStrategy[list[int]], max_capacity: int) -> st.SearchStrategy:
    return st.one_of(
        st.tuples(st.just("insert"), names, prompts),
        st.tuples(st.just("insert"), names, prompts),
        st.tuples(st.just("match"), prompts, st.booleans()),
        st.tuples(st.just("match_instance"), names, prompts, st.booleans()),
        st.tuples(
            st.just("remove"), names, prompts, st.lists(st.integers(0, 39), max_size=3, unique=True)
        ),
        st.tuples(st.just("clear"), names),
        st.tuples(st.just("set_capacity"), names, st.integers(0, max_capacity)),
    )


# A three-letter alphabet and short prompts make shared prefixes, splits and evictions common.
SHORT = operations(st.lists(st.integers(0, 2), max_size=10), 16)
# Longer prompts over a larger alphabet: long runs that grow, split and get evicted in part.
LONG = operations(st.lists(st.integers(0, 4), max_size=40), 80)


def keys(prompt: list[int]) -> BlockKeys:
    return BlockKeys.from_ids(prompt)


DETERMINISTIC = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@settings(DETERMINISTIC, max_examples=500)
@given(capacities=st.lists(st.integers(0, 16), min_size=4, max_size=4), ops=st.lists(SHORT))
def test_index_agrees_with_reference_model_on_short_prompts(capacities, ops) -> None:
    run_against_reference(capacities, ops)


@settings(DETERMINISTIC, max_examples=300)
@given(capacities=st.lists(st.integers(0, 80), min_size=4, max_size=4), ops=st.lists(LONG))
def test_index_agrees_with_reference_model_on_long_prompts(capacities, ops) -> None:
    run_against_reference(capacities, ops)


def run_against_reference(capacities: list[int], ops: list[tuple]) -> None:
    index = PrefixIndex(global_capacity_blocks=capacities[3])
    model = ReferenceIndex()
    for name, cap in zip(NAMES[:3], capacities, strict=False):
        index.add_instance(name, cap)
    for name, cap in zip(NAMES, capacities, strict=True):
        model.add_instance(name, cap)

    for op in ops:
        kind = op[0]
        if kind == "insert":
            _, name, prompt = op
            assert index.insert(name, keys(prompt)) == model.insert(name, prompt)
        elif kind == "match":
            _, prompt, touch = op
            got = index.match(keys(prompt), touch=touch)
            want = model.match(prompt, touch)
            assert got.blocks == [want[n] for n in NAMES[:3]]
            assert got.global_blocks == want[GLOBAL_TIER]
            assert got.query_blocks == len(prompt)
        elif kind == "match_instance":
            _, name, prompt, touch = op
            want = model.matched(name, prompt)
            assert index.match_instance(name, keys(prompt), touch=touch) == want
            if touch:
                model.tick += 1
                for d in range(1, want + 1):
                    model.held[name][tuple(prompt[:d])] = (model.tick, d)
        elif kind == "remove":
            # A KV event names single blocks, in any order: pick some blocks of the prompt.
            _, name, prompt, picks = op
            chain = keys(prompt)
            chosen = [p for p in picks if p < len(prompt)]
            event = BlockKeys.from_ids([chain[p] for p in chosen], chained=True)
            prefixes = [tuple(prompt[: p + 1]) for p in chosen]
            assert index.remove(name, event) == model.remove(name, prefixes)
        elif kind == "clear":
            _, name = op
            assert index.clear(name) == model.clear(name)
        elif kind == "set_capacity":
            _, name, cap = op
            held_before = len(model.held[name])
            model.set_capacity(name, cap)
            assert index.set_capacity(name, cap) == held_before - len(model.held[name])
        index._check_invariants()
        stats = index.stats()
        for name in NAMES[:3]:
            assert stats["instances"][name]["blocks"] == len(model.held[name])
        assert stats["global"]["blocks"] == len(model.held[GLOBAL_TIER])
