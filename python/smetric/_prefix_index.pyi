"""Type stubs and contract of ``smetric._prefix_index``, the Rust prefix index.

Keys
----
A prompt is cut into fixed-size blocks (text bytes, or token ids) and block ``i`` gets a 64-bit
key: xxh3 of the block's bytes, seeded with the key of block ``i - 1`` (block 0 is seeded with a
constant that depends on the kind of input and the block size). So two prompts share key ``i``
exactly when they share blocks ``0..i`` whole, and one key names a whole prefix.

A trailing partial block gets **no key**: a KV cache reuses whole pages only, and a partial
block's key would change as the prompt grows, so it could never match the next turn. A prompt
shorter than one block has no keys and matches nothing.

Other key sources, for the same index:

* pre-hashed ids that already name whole prefixes (Mooncake trace ``hash_ids``, SGLang KV-event
  ``block_hashes``): ``BlockKeys.from_ids(ids, chained=True)`` takes them as keys;
* per-block ids that name one block's content only: ``BlockKeys.from_ids(ids)`` chains them;
* SGLang's own page hashes of token ids: ``hash_tokens_sglang(ids, page_size)`` gives the same
  int64 values (as unsigned bit patterns) that SGLang's KV events publish, so a router that keys
  token prompts this way can apply ``BlockStored`` / ``BlockRemoved`` events to its predictions.

Keys from different sources or block sizes never match one another; use one scheme per index.

Index
-----
One radix tree shared by all instances; each instance has a capacity in blocks and its own LRU.
What an instance holds is always a set of whole prefixes: inserting past capacity evicts its least
recently used blocks from the leaves inward. ``GLOBAL_TIER`` is a reserved instance that models
the shared global KV store (Mooncake-style): it has its own capacity and LRU, is not listed by
``instances()``, and is reported as ``Match.global_blocks``.

Every call that hashes or walks releases the GIL; one index may be shared between threads.
Errors: unknown instance -> ``KeyError``; duplicate or reserved misuse, negative capacity,
unchained keys that clash with indexed ones -> ``ValueError``; wrong argument types ->
``TypeError``. A call that raises leaves the index unchanged.
"""

from collections.abc import Iterable, Iterator
from typing import Any, SupportsIndex, final, overload

__version__: str

GLOBAL_TIER: str
"""Name of the reserved global-tier instance (``"@global"``)."""

@final
class BlockKeys:
    """Chained 64-bit block keys of one prompt. Immutable, hashable, picklable."""

    @staticmethod
    def from_ids(ids: Iterable[int], chained: bool = False) -> BlockKeys:
        """Keys from per-block ids (ints in ``-2**63 .. 2**64``; negatives keep their bit pattern).

        ``chained=False`` chains the ids (each id names one block's content). ``chained=True``
        uses them as keys as they are (each id already names a whole prefix); they must then be
        distinct, else ``ValueError``.
        """
    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, index: SupportsIndex) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> BlockKeys:
        """A slice (step 1) is the keys of a prefix (or of a run inside the chain)."""
    def __iter__(self) -> Iterator[int]: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def to_list(self) -> list[int]:
        """The keys as unsigned 64-bit ints."""
    def common_prefix(self, other: BlockKeys) -> int:
        """Number of leading blocks the two chains share."""
    def __reduce__(self) -> tuple[Any, tuple[list[int], bool]]: ...

def hash_text(text: str | bytes, block_bytes: int = 64) -> BlockKeys:
    """Keys of a text prompt: one per full block of ``block_bytes`` UTF-8 bytes.

    Raises ``ValueError`` if ``block_bytes <= 0``, ``TypeError`` if ``text`` is not str/bytes.
    """

def hash_tokens(token_ids: Iterable[int], block_tokens: int = 16) -> BlockKeys:
    """Keys of token ids (a list of ints, or any buffer of integers such as ``array('I')`` or a
    numpy array): one per full block of ``block_tokens`` ids, each id hashed as 4 little-endian
    bytes.

    Raises ``ValueError`` for ids outside ``0 .. 2**32`` or ``block_tokens <= 0``, ``TypeError``
    for str/bytes or non-int items.
    """

def hash_tokens_sglang(token_ids: Iterable[int], page_size: int) -> BlockKeys:
    """SGLang's page hashes of token ids (sglang >= 0.5.10, no LoRA or cache salt): page ``i``'s
    digest is SHA-256 of page ``i - 1``'s digest followed by the page's ids as little-endian u32;
    the key is the digest's first 8 bytes, big-endian, which is the int64 that SGLang's KV events
    carry (``BlockKeys.from_ids(event.block_hashes, chained=True)`` gives equal keys).
    """

def inject_members(body: bytes, members: bytes) -> bytes | None:
    """``body`` with ``members`` (JSON object members, without braces) added last, so that they
    override any the body has (JSON parsers keep a key's last value), the rest byte for byte;
    None if ``body`` is not a JSON object (PD's bootstrap fields)."""

def key_request_body(
    api: str, body: bytes, text_block_bytes: int, token_block_tokens: int
) -> tuple[BlockKeys, int, bool, int | None, bool, bool | None] | None:
    """The router's fast path: a ``generate``, ``chat`` or ``completions`` body keyed straight
    from its bytes, as ``smetric.request.view_request`` keys the parsed body (text in blocks of
    ``text_block_bytes``, token ids in blocks of ``token_block_tokens``).

    Returns ``(keys, prompt_length, is_tokens, max_new_tokens, stream, is_first_turn)``, where
    ``prompt_length`` counts the key text's UTF-8 bytes or the token ids and ``max_new_tokens``
    is None when the body names no limit; or None where ``view_request`` must decide: every body
    it rejects, and a few rare shapes (floats or integers beyond 64 bits where the key serializes
    JSON, lone surrogates, deep nesting). Raises ``ValueError`` for an unknown ``api``.
    """

@final
class Match:
    """Result of ``PrefixIndex.match``."""

    @property
    def blocks(self) -> list[int]:
        """Leading blocks of the query each instance holds, in ``PrefixIndex.instances()`` order."""
    @property
    def global_blocks(self) -> int:
        """Leading blocks the global tier holds (0 without a global tier)."""
    @property
    def query_blocks(self) -> int:
        """Number of blocks in the query."""
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> int: ...
    def best(self) -> tuple[int, int] | None:
        """``(position, blocks)`` of the instance holding the most (the first on ties), or
        ``None`` when the index has no instances."""

@final
class PrefixIndex:
    """Which leading blocks of a prompt each instance (and the global tier) holds."""

    def __init__(self, global_capacity_blocks: int | None = None) -> None:
        """``global_capacity_blocks`` adds the global tier (``GLOBAL_TIER``) with that capacity."""
    def add_instance(self, name: str, capacity_blocks: int) -> None:
        """Adds an instance (or, with ``GLOBAL_TIER``, the global tier). Duplicate or empty name,
        negative capacity -> ``ValueError``."""
    def remove_instance(self, name: str) -> int:
        """Removes an instance and all it holds; returns the blocks it held."""
    def set_capacity(self, name: str, capacity_blocks: int) -> int:
        """Sets a capacity, evicting at once when it shrinks; returns the blocks evicted."""
    def instances(self) -> list[str]:
        """Instance names in add order (the order of ``Match.blocks``); the global tier apart."""
    def __contains__(self, name: str) -> bool: ...
    @property
    def has_global_tier(self) -> bool: ...
    def insert(self, instance: str, keys: BlockKeys, step: int | None = None) -> int:
        """Records that ``instance`` holds the whole prompt (as a cache does once it has served
        it): every block of it becomes the most recently used, then the instance is evicted down
        to capacity (least recently used leaves first; a prompt longer than the capacity keeps
        its leading blocks). Returns the blocks newly held, counted before eviction.

        With ``step``, the prompt goes in steps (the first takes in the blocks already in the
        index and ``step`` new ones, each later one ``step`` more) and the index's lock passes,
        between steps, to any call waiting for it: a match then waits for one step, not for the
        whole of a long prompt. The end state is the same (evictions too: only the last step, or
        a failing one, evicts), but the call is not atomic: between steps, a call that gets the
        lock sees the instance holding what the steps so far brought in, beyond its capacity if
        so; and an error leaves the steps before it in place, evicted down to capacity."""
    def remove(self, instance: str, keys: BlockKeys) -> int:
        """Drops each named block from ``instance``, with everything it holds below that block (a
        page whose parent is gone cannot be reused). Keys may come in any order and need not be a
        chain (a KV event's ``block_hashes``); unknown keys are skipped. Returns blocks dropped."""
    def clear(self, instance: str) -> int:
        """Drops everything ``instance`` holds; returns the blocks dropped."""
    def match(self, keys: BlockKeys, touch: bool = True) -> Match:
        """Leading blocks of ``keys`` held by every instance and the global tier, in one call.

        With ``touch`` (the default) the matched blocks of each instance become its most
        recently used, as a cache lookup does. A router that only *predicts* where a request
        goes can pass ``touch=False`` and let ``insert`` on the chosen instance do the touch.
        """
    def match_instance(self, instance: str, keys: BlockKeys, touch: bool = True) -> int:
        """Leading blocks of ``keys`` held by one instance (touching them by default)."""
    def stats(self) -> dict[str, Any]:
        """``{"instances": {name: {"blocks", "capacity_blocks", "nodes", "evicted_blocks"}},
        "global": {...} | None, "nodes", "unique_blocks", "bytes_used"}``; ``bytes_used`` is
        the heap memory of the index's structures, estimated from their capacities."""
    def _check_invariants(self) -> None:
        """Panics (``pyo3_runtime.PanicException``) if the tree is inconsistent; for tests."""

class DataPlane:
    """The router's data plane (Rust: tokio and hyper): an HTTP/1.1 server for clients and a
    pooled client for workers. Generation requests are read here and handed to
    ``router.dp_begin(path, keyed, body, headers, read_s)``, which returns an exchange (see
    ``smetric.router.app.Exchange``) with its first attempt and whether the client streams
    (``(exchange, attempt or None, stream)``; in PD mode with a fourth item, the prefill's leg,
    ``smetric.router.app.PrefillLeg``, sent beside the decode's attempt with the same body, its
    ``fragment`` added last), or an error ``(status, json_body)``. Every other route is passed
    to the Python application at ``internal_url``. Given ``keying=(text_block_bytes,
    token_block_tokens)``, the data plane keys each body itself, as ``key_request_body`` does,
    outside the GIL: ``keyed`` is then what that returns and ``body``
    None, except where the fast path leaves the body to the reference (``keyed`` None, ``body``
    the bytes, as always without ``keying``). The answers are booked in a queue the router takes
    with ``booked()`` (``Router.settle``): before its decisions, when it reports, and when the
    data plane calls ``router.settle()`` a few milliseconds after a step was queued."""

    def __init__(
        self,
        router: object,
        internal_url: str,
        max_payload_size: int,
        read_timeout_s: float,
        connect_timeout_s: float,
        threads: int = 1,
        keying: tuple[int, int] | None = None,
    ) -> None: ...
    def start(self, host: str, port: int) -> int:
        """Listens on ``host:port`` (0: a free port) and returns the port; OSError if it cannot."""
    def stop(self, grace_s: float = 0.0) -> int:
        """Stops listening, lets the requests in progress finish for up to ``grace_s`` seconds
        (each connection closes once its answer, a stream too, has gone out), then ends every
        exchange still open: an answered one's end is queued for the router's next
        ``settle()``, which releases its accounting; one not yet answered is ended at once.
        Returns the client connections still open at the end."""
    def booked(self) -> list[tuple[Any, str, Any, Any, Any, float]] | None:
        """The booking steps queued since the last call, in order:
        ``(exchange, "whole" | "streaming", status, record, None, at)`` or
        ``(exchange, "end", outcome, events, span_s, at)``, ``at`` on ``time.perf_counter``'s
        clock; None when there are none."""
    @property
    def turns(self) -> tuple[int, int]:
        """``(turns, requests)``: the turns in which the router took requests (``dp_begin``), and
        the requests taken in them, routed or refused (requests that arrive together share a
        turn)."""
    @property
    def port(self) -> int | None: ...
