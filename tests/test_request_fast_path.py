"""The router's fast path (``view_body``, Rust, from the body bytes) against its reference
(``view_request`` over ``loads``): where the fast path answers, it answers exactly as the reference
does; wherever the reference rejects a body, the fast path leaves it to the reference, so the
client gets the reference's error."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from smetric.request import BadRequest, RequestView, loads, view_body, view_request

SPECIAL = '"\\/\n\r\t\b\f\x00\x01\x1f\x7f é€😀\u2028\ufeff<|>'
texts = st.text(alphabet=st.sampled_from(SPECIAL) | st.characters(codec="utf-8"), max_size=40)
short_texts = st.text(alphabet=st.sampled_from(SPECIAL) | st.characters(codec="utf-8"), max_size=6)
ints = st.integers(-(2**63), 2**64 - 1) | st.sampled_from([0, 1, 16, 2**64, -(2**70), 2**32])


def json_values(exact: bool) -> st.SearchStrategy[Any]:
    """JSON values; ``exact``: only what the fast path reproduces (no floats or big ints)."""
    # JSON has no infinities: a body carrying one (json.dumps writes "Infinity") is not JSON,
    # which the strategies below send on purpose where they mean to.
    finite_floats = st.floats(allow_nan=False, allow_infinity=False)
    numbers = st.integers(-(2**63), 2**64 - 1) if exact else ints | finite_floats
    scalars = st.none() | st.booleans() | numbers | short_texts
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(short_texts, inner, max_size=3),
        max_leaves=8,
    )


def parts(exact: bool) -> st.SearchStrategy[Any]:
    text_part = st.fixed_dictionaries({"type": st.just("text"), "text": texts})
    untyped = st.fixed_dictionaries({"text": texts})
    image = st.fixed_dictionaries(
        {
            "type": st.sampled_from(["image_url", "input_audio", None, 3]),
            "image_url": json_values(exact),
        }
    )
    odd = (
        st.none()
        | st.integers()
        | st.fixed_dictionaries({"type": st.just("text"), "text": st.integers()})
    )
    return text_part | untyped | image | texts | (st.nothing() if exact else odd)


def contents(exact: bool) -> st.SearchStrategy[Any]:
    return (
        texts
        | st.none()
        | st.lists(parts(exact), max_size=4)
        | st.dictionaries(short_texts, json_values(exact), max_size=2)
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
    )


ROLES = ["system", "user", "assistant", "tool", "developer", "Assistant", "tool "]


def messages(exact: bool) -> st.SearchStrategy[dict[str, Any]]:
    role = st.sampled_from(ROLES) | short_texts
    call_id = st.none() | texts if exact else st.none() | texts | json_values(False)
    message = st.fixed_dictionaries(
        {"role": role if exact else role | json_values(False)},
        optional={
            "content": contents(exact),
            "tool_calls": st.lists(json_values(exact), max_size=2) | json_values(exact),
            "tool_call_id": call_id,
            "name": short_texts,
        },
    )
    return message


def limits(exact: bool) -> st.SearchStrategy[Any]:
    if exact:
        return st.none() | st.integers(0, 2**64 - 1)
    return st.none() | ints | st.floats() | st.booleans() | short_texts


def streams(exact: bool) -> st.SearchStrategy[Any]:
    plain = (
        st.booleans()
        | st.none()
        | st.integers()
        | short_texts
        | st.lists(st.integers(), max_size=2)
    )
    return plain if exact else plain | st.floats() | json_values(False)


def chat_bodies(exact: bool) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"messages": st.lists(messages(exact), min_size=1, max_size=5)},
        optional={
            "model": short_texts,
            "tools": st.none() | st.lists(json_values(exact), max_size=3),
            "max_tokens": limits(exact),
            "max_completion_tokens": limits(exact),
            "stream": streams(exact),
            "temperature": st.floats(allow_nan=False, allow_infinity=False),
            "extra": json_values(False),
        },
    )


def token_lists(exact: bool) -> st.SearchStrategy[Any]:
    ids = st.integers(0, 2**32 - 1)
    if not exact:
        ids = ids | ints | st.booleans() | st.floats()
    flat = st.lists(ids, min_size=1, max_size=40)
    return flat | st.lists(flat, min_size=1, max_size=3)


finite = st.floats(allow_nan=False, allow_infinity=False)
SEEDED = settings(
    derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
"""Seeded runs, as every property test here: the same examples each time."""


def generate_bodies(exact: bool) -> st.SearchStrategy[dict[str, Any]]:
    prompt = st.one_of(
        st.fixed_dictionaries({"text": texts | st.lists(texts, min_size=1, max_size=3)}),
        st.fixed_dictionaries({"input_ids": token_lists(exact)}),
    )
    params = st.fixed_dictionaries(
        {}, optional={"max_new_tokens": limits(exact), "temperature": finite}
    )
    rest = st.fixed_dictionaries(
        {},
        optional={
            "sampling_params": params | st.none(),
            "stream": streams(exact),
            "rid": short_texts,
        },
    )
    return st.builds(lambda a, b: {**a, **b}, prompt, rest)


def completions_bodies(exact: bool) -> st.SearchStrategy[dict[str, Any]]:
    prompt = (
        texts
        | st.lists(texts, min_size=1, max_size=3)
        | token_lists(exact).filter(lambda x: not isinstance(x[0], list))
    )
    return st.fixed_dictionaries(
        {"prompt": prompt},
        optional={"max_tokens": limits(exact), "stream": streams(exact), "n": st.integers()},
    )


def any_body() -> st.SearchStrategy[tuple[str, Any]]:
    return st.one_of(
        st.tuples(st.just("chat"), chat_bodies(False)),
        st.tuples(st.just("generate"), generate_bodies(False)),
        st.tuples(st.just("completions"), completions_bodies(False)),
        st.tuples(st.sampled_from(["chat", "generate", "completions"]), json_values(False)),
    )


def exact_body() -> st.SearchStrategy[tuple[str, Any]]:
    return st.one_of(
        st.tuples(st.just("chat"), chat_bodies(True)),
        st.tuples(st.just("generate"), generate_bodies(True)),
        st.tuples(st.just("completions"), completions_bodies(True)),
    )


def encodings(body: Any) -> list[bytes]:
    """The same body as different clients write it: compact, spaced, ASCII-escaped, orjson."""
    out = [
        json.dumps(body).encode(),
        json.dumps(body, ensure_ascii=False, indent=1).encode(),
        json.dumps(body, separators=(",", ":"), ensure_ascii=True).encode(),
    ]
    with contextlib.suppress(TypeError):  # ints beyond 64 bits
        out.append(orjson.dumps(body))
    return out


def reference(api: str, raw: bytes, headers: dict[str, str] | None) -> RequestView | Exception:
    try:
        return view_request(api, loads(raw), headers)
    except (BadRequest, ValueError, UnicodeError, RecursionError) as e:
        return e


def assert_same(api: str, raw: bytes, headers: dict[str, str] | None = None) -> RequestView | None:
    fast = view_body(api, raw, headers)
    ref = reference(api, raw, headers)
    if isinstance(ref, Exception):
        assert fast is None, f"the reference rejects this body ({ref!r}); the fast path must not"
        return None
    if fast is not None:
        assert fast.key.keys.to_list() == ref.key.keys.to_list()
        assert fast.prompt_tokens == ref.prompt_tokens
        assert fast.key.block_tokens == ref.key.block_tokens
        assert fast.max_new_tokens == ref.max_new_tokens
        assert fast.stream is ref.stream
        assert fast.session_key == ref.session_key
        assert fast.is_first_turn is ref.is_first_turn
        assert fast == ref
    return fast


@settings(SEEDED, max_examples=400)
@given(any_body())
def test_fast_path_answers_as_the_reference_or_not_at_all(case):
    api, body = case
    for raw in encodings(body):
        assert_same(api, raw)


@settings(SEEDED, max_examples=300)
@given(exact_body())
def test_fast_path_handles_every_ordinary_body(case):
    """Bodies without floats or big ints where the key serializes JSON are the fast path's own."""
    api, body = case
    for raw in encodings(body):
        ref = reference(api, raw, None)
        fast = assert_same(api, raw)
        if not isinstance(ref, Exception):
            assert fast is not None


@settings(SEEDED, max_examples=300)
@given(any_body(), st.data())
def test_damaged_bodies_get_the_reference_answer(case, data):
    api, body = case
    raw = bytearray(json.dumps(body, ensure_ascii=data.draw(st.booleans())).encode())
    for _ in range(data.draw(st.integers(1, 3))):
        kind = data.draw(st.sampled_from(["cut", "byte", "insert"]))
        at = data.draw(st.integers(0, len(raw)))
        if kind == "cut":
            del raw[at:]
        elif kind == "byte" and at < len(raw):
            raw[at] = data.draw(st.integers(0, 255))
        else:
            raw[at:at] = data.draw(
                st.sampled_from([b"\\", b'"', b"\\u", b"\\ud800", b",", b"\xff", b"\t"])
            )
    assert_same(api, bytes(raw))


@settings(SEEDED, max_examples=200)
@given(
    chat_bodies(True),
    st.sampled_from(["max_tokens", "stream", "messages", "tools"]),
    json_values(True) | st.lists(messages(True), min_size=1, max_size=2),
)
def test_a_repeated_member_counts_once_with_its_last_value(body, name, first_value):
    raw = json.dumps(body).encode()
    member = json.dumps({name: first_value})[1:-1].encode()
    assume(body)
    raw = b"{" + member + b"," + raw[1:]
    assert_same("chat", raw)


def test_session_headers_and_defaults_come_out_as_the_reference_s():
    raw = b'{"messages":[{"role":"user","content":"hi"}]}'
    headers = {"x-session-id": "s1"}
    fast = assert_same("chat", raw, headers)
    assert fast is not None
    assert (fast.session_key, fast.max_new_tokens, fast.is_first_turn) == ("s1", 128, True)


@pytest.mark.parametrize(
    "api,raw",
    [
        ("chat", b"not json"),
        ("chat", b'{"messages": []}'),
        ("chat", b'{"messages": [{"content": "x"}]}'),
        ("chat", b'{"messages": [{"role": "user"}], "tools": {}}'),
        ("chat", b'{"messages": [{"role": "user"}], "max_tokens": -1}'),
        ("chat", b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}'),
        ("generate", b'{"text": "a", "input_ids": [1]}'),
        ("generate", b'{"input_ids": [1, 2, 4294967296]}'),
        ("generate", b'{"text": "a", "sampling_params": 3}'),
        ("completions", b'{"prompt": 3}'),
        ("completions", b'{"prompt": "a", "max_tokens": 1.5}'),
        ("completions", b"[]"),
        ("completions", b'{"prompt": "\\ud800"}'),
        ("completions", b'{"prompt": "a", "max_tokens": NaN}'),
    ],
)
def test_bad_bodies_are_left_to_the_reference(api, raw):
    assert view_body(api, raw) is None
    assert isinstance(reference(api, raw, None), Exception)


def test_a_128kb_agent_turn_takes_the_fast_path():
    history = "".join(f"tool output line {i}: ok\n" for i in range(3800))
    body = {
        "messages": [
            {"role": "system", "content": "You are a coding agent. " * 200},
            {"role": "user", "content": history},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
            {"role": "tool", "content": "é😀", "tool_call_id": "1"},
        ],
        "tools": [
            {"type": "function", "function": {"name": f"t{i}", "parameters": {}}} for i in range(10)
        ],
        "max_tokens": 256,
        "stream": True,
    }
    for raw in encodings(body):
        fast = assert_same("chat", raw)
        assert fast is not None and fast.stream and fast.is_first_turn is False
        assert fast.prompt_tokens > 30_000
