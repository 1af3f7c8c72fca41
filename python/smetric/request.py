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
from dataclasses import dataclass
from typing import Any

from smetric import BlockKeys, hash_text, hash_tokens


def _compact_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "") if isinstance(part, Mapping) else str(part) for part in content
        )
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


@dataclass(frozen=True)
class PromptKey:
    """A prompt as the index and the engine see it."""

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
        TEXT_BLOCK_BYTES / BYTES_PER_TOKEN,
    )


def key_tokens(token_ids: Sequence[int]) -> PromptKey:
    return PromptKey(
        hash_tokens(token_ids, TOKEN_BLOCK_TOKENS), len(token_ids), float(TOKEN_BLOCK_TOKENS)
    )
