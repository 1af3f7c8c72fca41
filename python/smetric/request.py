"""What the prefix index keys for a request.

Chat requests are keyed on a deterministic serialization of their tools and messages, built so
that a follow-up turn (the same messages plus the answer plus new messages) serializes to an
extension of the previous turn's text, and so shares all of its full blocks:

    tools:    "<|tools|>" + JSON of the tool list (sorted keys, compact) + "\\n"  (if any)
    message:  "<|" + role + "|>" + content text
              + ("<|calls|>" + JSON of tool_calls, if any)
              + ("<|id|>" + tool_call_id, if any) + "\\n"

Content given as a list of parts contributes its text parts in order. The serialization is only
a key: the body the worker receives is never rewritten.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import orjson

from smetric import BlockKeys, hash_text, hash_tokens
from smetric._prefix_index import key_request_body


def _compact_json(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:  # what orjson cannot encode (e.g. ints beyond 64 bits)
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def loads(raw: bytes) -> Any:
    """Parses a request body (orjson, falling back to the standard library for the JSON that
    orjson refuses but Python accepts, such as integers beyond 64 bits)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping):
                if part.get("type", "text") != "text":
                    continue  # images, audio: not keyed
                text = part.get("text")
            else:
                text = part
            if not isinstance(text, str):
                raise BadRequest("a text content part needs a string 'text'")
            texts.append(text)
        return "".join(texts)
    return _compact_json(content)


def chat_prompt_text(messages: Iterable[Mapping[str, Any]], tools: list[Any] | None = None) -> str:
    """The text the index keys for a chat request (see the module docstring)."""
    parts = []
    if tools:
        parts.append("<|tools|>" + _compact_json(tools) + "\n")
    for m in messages:
        text = "<|" + str(m.get("role", "")) + "|>" + _content_text(m.get("content"))
        if m.get("tool_calls"):
            text += "<|calls|>" + _compact_json(m["tool_calls"])
        if m.get("tool_call_id"):
            text += "<|id|>" + str(m["tool_call_id"])
        parts.append(text + "\n")
    return "".join(parts)


TEXT_BLOCK_BYTES = 64
"""Text prompts are keyed in blocks of 64 UTF-8 bytes."""
TOKEN_BLOCK_TOKENS = 16
"""Token prompts are keyed in blocks of 16 ids (SGLang's common page size)."""
BYTES_PER_TOKEN = 3.4
"""Without a tokenizer, a prompt has about 3.4 UTF-8 bytes a token (measured on agent sessions'
prompts, which are JSON-heavy; shared traces README)."""
_TEXT_BLOCK_TOKENS = TEXT_BLOCK_BYTES / BYTES_PER_TOKEN
"""Tokens per text key block (an estimate)."""


class PromptKey(NamedTuple):
    """A prompt as the index and the engine see it (a named tuple: built for every request)."""

    keys: BlockKeys
    prompt_tokens: int
    block_tokens: float
    """Prompt tokens per key block (an estimate for text)."""


def text_prompt_tokens(text_bytes: int) -> int:
    return max(1, math.ceil(text_bytes / BYTES_PER_TOKEN))


def key_text(text: str | bytes) -> PromptKey:
    raw = text.encode() if isinstance(text, str) else text
    return PromptKey(
        hash_text(raw, TEXT_BLOCK_BYTES),
        text_prompt_tokens(len(raw)),
        _TEXT_BLOCK_TOKENS,
    )


def key_tokens(token_ids: Sequence[int]) -> PromptKey:
    return PromptKey(
        hash_tokens(token_ids, TOKEN_BLOCK_TOKENS), len(token_ids), float(TOKEN_BLOCK_TOKENS)
    )


class BadRequest(ValueError):
    """The request cannot be routed; the message says why (it goes back as a 400)."""


SESSION_HEADERS = ("x-smg-routing-key", "x-session-id")
"""Headers that name a session (a hint to policies, never required)."""
DEFAULT_MAX_NEW_TOKENS = 128


class RequestView(NamedTuple):
    """What policies see of a request: its keyed prompt and a few facts about it (a named
    tuple: built for every request)."""

    api: str
    """``generate``, ``chat`` or ``completions``."""
    key: PromptKey
    max_new_tokens: int
    stream: bool
    session_key: str | None = None
    is_first_turn: bool | None = None
    """Chat: no assistant or tool message yet. None where the API cannot tell (raw prompts)."""

    @property
    def prompt_tokens(self) -> int:
        return self.key.prompt_tokens


def _max_tokens(value: Any, name: str) -> int:
    if value is None:
        return DEFAULT_MAX_NEW_TOKENS
    if type(value) is not int or value < 0:
        raise BadRequest(f"{name} must be a non-negative integer")
    return value


def _token_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{name} must be a non-empty list of token ids")
    if not all(type(t) is int and 0 <= t < 2**32 for t in value):
        raise BadRequest(f"{name} must hold token ids (ints in 0..2**32)")
    return value


def _session_key(headers: Mapping[str, str] | None) -> str | None:
    if headers is not None:
        for h in SESSION_HEADERS:
            if headers.get(h):
                return headers[h]
    return None


def view_unkeyed(api: str, body_bytes: int, stream: bool = False) -> RequestView:
    """A request with no prompt to key (embeddings, rerank, classification, the Responses API):
    no blocks and no session key (its session headers are not its to claim), so every policy
    balances it; its size estimated from its body's."""
    tokens = text_prompt_tokens(body_bytes)
    key = PromptKey(hash_text(b"", TEXT_BLOCK_BYTES), tokens, _TEXT_BLOCK_TOKENS)
    return RequestView(api, key, 0, stream, None, None)


def view_body(api: str, raw: bytes, headers: Mapping[str, str] | None = None) -> RequestView | None:
    """The router's fast path: ``view_request(api, loads(raw), headers)`` computed in Rust from the
    body bytes, without the GIL and without building the body's Python objects.

    None where the Rust side leaves the request to the reference (``view_request``): every body
    that the reference rejects, and a few rare shapes (floats inside tools, big integers, ...).
    """
    fast = key_request_body(api, raw, TEXT_BLOCK_BYTES, TOKEN_BLOCK_TOKENS)
    return None if fast is None else view_keyed(api, fast, headers)


KeyedBody = tuple[BlockKeys, int, bool, "int | None", bool, "bool | None"]
"""What ``key_request_body`` returns for a body it keys (the Rust data plane keys bodies the
same way, with ``TEXT_BLOCK_BYTES`` and ``TOKEN_BLOCK_TOKENS``, and hands the router this)."""


def view_keyed(api: str, fast: KeyedBody, headers: Mapping[str, str] | None = None) -> RequestView:
    """The view of a body ``key_request_body`` keyed (``view_body``'s second half)."""
    keys, length, is_tokens, max_new, stream, first = fast
    if is_tokens:
        key = PromptKey(keys, length, float(TOKEN_BLOCK_TOKENS))
    else:
        key = PromptKey(keys, text_prompt_tokens(length), _TEXT_BLOCK_TOKENS)
    if max_new is None:
        max_new = DEFAULT_MAX_NEW_TOKENS
    return RequestView(api, key, max_new, stream, _session_key(headers), first)


def view_request(api: str, body: Any, headers: Mapping[str, str] | None = None) -> RequestView:
    """Parses a request body of one of SGLang's generation APIs into a view.

    Raises ``BadRequest`` for anything a worker would reject as malformed. Batched inputs (a list
    of prompts) are keyed on their first prompt.
    """
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    session = _session_key(headers)
    stream = bool(body.get("stream", False))
    first: bool | None = None
    if api == "generate":
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("Either text or input_ids should be provided.")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadRequest("sampling_params must be an object")
        max_new = _max_tokens(params.get("max_new_tokens"), "max_new_tokens")
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            text = text[0]
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            ids = ids[0]
        if text is not None:
            if not isinstance(text, str):
                raise BadRequest("text must be a string or a list of strings")
            key = key_text(text)
        else:
            key = key_tokens(_token_list(ids, "input_ids"))
    elif api == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise BadRequest("each message must be an object with a string role")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("tools must be a list")
        key = key_text(chat_prompt_text(messages, tools))
        first = not any(m["role"] in ("assistant", "tool") for m in messages)
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        max_new = _max_tokens(limit, "max_tokens")
    elif api == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            key = key_text(prompt)
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            key = key_tokens(_token_list(prompt, "prompt"))
        else:
            raise BadRequest("prompt must be a string or a list of token ids")
        max_new = _max_tokens(body.get("max_tokens"), "max_tokens")
    else:
        raise ValueError(f"unknown api {api!r}")
    return RequestView(api, key, max_new, stream, session, first)
