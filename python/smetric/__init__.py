"""smetric: a session-aware router for LLM serving clusters that serve agents.

The public API of the prefix index (a Rust extension) is re-exported here; see
``smetric/_prefix_index.pyi`` for its full contract.
"""

from smetric._prefix_index import (
    GLOBAL_TIER,
    BlockKeys,
    DataPlane,
    Match,
    PrefixIndex,
    __version__,
    hash_text,
    hash_tokens,
    hash_tokens_sglang,
)

__all__ = [
    "GLOBAL_TIER",
    "BlockKeys",
    "DataPlane",
    "Match",
    "PrefixIndex",
    "__version__",
    "hash_text",
    "hash_tokens",
    "hash_tokens_sglang",
]
