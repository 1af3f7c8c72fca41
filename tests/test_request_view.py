"""What the router keys and tells policies about a request."""

from __future__ import annotations

import pytest

from smetric.request import BadRequest, key_text, key_tokens, view_request

MSGS = [{"role": "system", "content": "policy"}, {"role": "user", "content": "hi"}]


def test_chat_first_turn_has_no_assistant_or_tool_message():
    assert view_request("chat", {"messages": MSGS}).is_first_turn is True
    follow = [*MSGS, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}]
    assert view_request("chat", {"messages": follow}).is_first_turn is False
    tool = [*MSGS, {"role": "tool", "content": "{}", "tool_call_id": "1"}]
    assert view_request("chat", {"messages": tool}).is_first_turn is False


def test_raw_prompts_cannot_tell_their_turn():
    assert view_request("generate", {"text": "a"}).is_first_turn is None
    assert view_request("completions", {"prompt": "a"}).is_first_turn is None


def test_a_follow_up_chat_turn_keys_as_an_extension_of_the_first():
    first = view_request("chat", {"messages": MSGS * 40, "tools": [{"type": "function"}]})
    follow = view_request(
        "chat",
        {
            "messages": [*MSGS * 40, {"role": "assistant", "content": "ok"}],
            "tools": [{"type": "function"}],
        },
    )
    assert follow.key.keys.common_prefix(first.key.keys) == len(first.key.keys)


def test_session_key_headers_are_a_hint_in_order_of_preference():
    h = {"x-smg-routing-key": "a", "x-session-id": "b"}
    assert view_request("chat", {"messages": MSGS}, h).session_key == "a"
    assert view_request("chat", {"messages": MSGS}, {"x-session-id": "b"}).session_key == "b"
    assert view_request("chat", {"messages": MSGS}, {}).session_key is None


def test_max_tokens_stream_and_prompt_tokens_come_from_each_api():
    v = view_request(
        "generate",
        {"input_ids": list(range(40)), "stream": True, "sampling_params": {"max_new_tokens": 9}},
    )
    assert (v.prompt_tokens, v.max_new_tokens, v.stream) == (40, 9, True)
    assert v.key == key_tokens(list(range(40)))
    v = view_request("chat", {"messages": MSGS, "max_completion_tokens": 5, "max_tokens": 7})
    assert v.max_new_tokens == 5
    v = view_request("completions", {"prompt": "x" * 340})
    assert (v.prompt_tokens, v.max_new_tokens) == (100, 128)  # 3.4 bytes a token; default 128
    assert view_request("generate", {"text": ["first", "second"]}).key == key_text("first")


@pytest.mark.parametrize(
    ("api", "body"),
    [
        ("generate", [1]),
        ("generate", {}),
        ("generate", {"text": "a", "input_ids": [1]}),
        ("generate", {"text": 3}),
        ("generate", {"input_ids": [1.5]}),
        ("generate", {"text": "a", "sampling_params": {"max_new_tokens": True}}),
        ("chat", {"messages": []}),
        ("chat", {"messages": [{"content": "no role"}]}),
        ("chat", {"messages": MSGS, "tools": "x"}),
        ("chat", {"messages": MSGS, "max_tokens": -1}),
        ("completions", {"prompt": None}),
        ("completions", {"prompt": [1, -2]}),
    ],
)
def test_malformed_requests_are_rejected(api, body):
    with pytest.raises(BadRequest):
        view_request(api, body)
