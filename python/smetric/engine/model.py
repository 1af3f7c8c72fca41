"""The engine model: one SGLang-like worker, pure Python, no I/O, no clock of its own.

A driver (the real-time emulator or the virtual-time simulator) asks the engine for its next
iteration, waits the iteration's duration on its own clock, then tells the engine the iteration
ended; the engine reports which requests got their first token, which got a token, which
finished. Same code, two clocks.

Scheduling, as SGLang does it in outline:
* a FIFO waiting queue; a request is admitted when the running cap and the KV pool allow;
* each iteration runs up to ``chunk_tokens`` of prefill (requests continue in chunks across
  iterations) together with one decode step of every running request;
* a request's first token comes at the end of the iteration that finishes its prefill.

KV: the pool holds ``Profile.kv_pool_tokens`` tokens. Each admitted request reserves the part of
its prompt it does not find in the local cache plus its maximum output, and locks the cached
prefix it uses; a request is admitted only when its reservation and lock fit beside everyone
else's. The local prefix cache (an instance of the cluster's ``PrefixIndex``, holding the locked
prefixes too) may use what is not reserved, and is evicted (LRU) as requests need room.

A prompt's blocks are found locally, else loaded from the global tier (paying the load time),
else computed. When the request ends (its KV is locked while it runs, as in SGLang's radix
cache), the prompt's blocks enter the local cache and are written through to the global tier.
Generated tokens are not added to the cache: a replayed next turn carries the recorded answer,
not the emulator's filler text, so they could never match.

PD: a prefill worker hands a finished prefill to a decode worker after a KV transfer time; the
decode worker admits it when its pool and running cap allow, and its first token comes out with
its first decode step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from smetric import GLOBAL_TIER, BlockKeys, PrefixIndex
from smetric.perf import Profile


@dataclass(frozen=True)
class GlobalTierConfig:
    """A Mooncake-style global KV store shared by all workers."""

    capacity_tokens: int = 64_000_000
    load_bytes_per_s: float = 25e9
    """Bandwidth a worker loads KV from the tier at (RDMA NIC class)."""
    load_latency_s: float = 0.002
    """Fixed cost of one load (lookup, transfer setup)."""


@dataclass(frozen=True)
class EngineConfig:
    chunk_tokens: int = 8192
    max_running_requests: int = 256
    kv_pool_tokens: int | None = None
    """Overrides the profile's KV pool size (tests use small pools)."""
    pd_transfer_bytes_per_s: float = 25e9
    pd_transfer_latency_s: float = 0.001


class Phase(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    TRANSFER = "transfer"  # PD: prefill done, KV moving to a decode worker
    DONE = "done"


@dataclass(eq=False)
class EngineRequest:
    """One request as the engine sees it. Times are on the driver's clock, in seconds."""

    rid: str
    prompt_tokens: int
    max_new_tokens: int
    keys: BlockKeys
    block_tokens: float
    """Prompt tokens per key block (text keys cover bytes: an estimate; token keys: exact)."""
    arrival_s: float = 0.0

    phase: Phase = Phase.WAITING
    local_cached_tokens: int = 0
    global_cached_tokens: int = 0
    prefilled_tokens: int = 0
    """Prompt tokens in KV so far (cached ones included)."""
    generated_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    worker: str = ""
    reserved_tokens: int = 0
    locked_tokens: int = 0
    queued_tokens: int = 0
    """While it waits: the prompt tokens it will compute, judged when it arrived from what the
    local cache and the global tier held then (``load()``'s queued prefill counts this)."""
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        return self.local_cached_tokens + self.global_cached_tokens

    @property
    def context_tokens(self) -> int:
        return self.prefilled_tokens + self.generated_tokens

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finish_s is None or self.first_token_s is None or self.generated_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.generated_tokens - 1)


class RequestTooLarge(ValueError):
    """The request can never fit the worker's KV pool."""


@dataclass
class Batch:
    """One iteration: what runs, and for how long."""

    start_s: float
    duration_s: float
    prefill: list[tuple[EngineRequest, int]]
    """(request, prompt tokens computed in this iteration)."""
    decode: list[EngineRequest]
    global_load_s: float = 0.0


@dataclass
class IterationEvents:
    first_token: list[EngineRequest] = field(default_factory=list)
    """Requests whose first token came out at the end of this iteration."""
    decoded: list[EngineRequest] = field(default_factory=list)
    """Requests that got one more token (after the first)."""
    finished: list[EngineRequest] = field(default_factory=list)
    handoff: list[EngineRequest] = field(default_factory=list)
    """PD: prefilled requests to move to a decode worker."""


@dataclass(frozen=True)
class WorkerLoad:
    """What the worker reports (SGLang's /v1/loads, in spirit)."""

    running: int
    waiting: int
    used_tokens: int
    pool_tokens: int
    queued_prefill_tokens: int
    decode_context_tokens: int


class Cluster:
    """What workers share: the prefix index (a local cache per worker, plus the global tier)."""

    def __init__(self, global_tier: GlobalTierConfig | None = GlobalTierConfig()) -> None:
        self.global_tier = global_tier
        self.index = PrefixIndex()
        self._global_block_tokens: float | None = None
        if global_tier is not None:
            self.index.add_instance(GLOBAL_TIER, 0)

    def set_global_block_tokens(self, block_tokens: float) -> None:
        """The global tier's capacity is in tokens; the index counts blocks of this many."""
        if self.global_tier is None or self._global_block_tokens == block_tokens:
            return
        self._global_block_tokens = block_tokens
        self.index.set_capacity(
            GLOBAL_TIER, int(self.global_tier.capacity_tokens / max(block_tokens, 1e-9))
        )


class Engine:
    """One worker. ``role`` is ``"mixed"`` (colocated), ``"prefill"`` or ``"decode"`` (PD)."""

    def __init__(
        self,
        name: str,
        profile: Profile,
        cluster: Cluster,
        config: EngineConfig = EngineConfig(),
        role: str = "mixed",
    ) -> None:
        if role not in ("mixed", "prefill", "decode"):
            raise ValueError(f"unknown role {role!r}")
        self.name = name
        self.profile = profile
        self.cluster = cluster
        self.config = config
        self.role = role
        self.pool_tokens = (
            config.kv_pool_tokens if config.kv_pool_tokens is not None else profile.kv_pool_tokens
        )
        self.slowdown = 1.0
        """Fault injection: iteration times are multiplied by this."""
        self.waiting: deque[EngineRequest] = deque()
        self.prefilling: list[EngineRequest] = []
        self.running: list[EngineRequest] = []
        self.reserved_tokens = 0
        """Pool tokens admitted requests take beyond their cached prefix (new prompt, output)."""
        self.locked_tokens = 0
        """Cached prefix tokens admitted requests use: the cache must keep them."""
        self._block_tokens: float | None = None
        self.busy_until_s: float | None = None
        # Counters for /metrics and /v1/loads.
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_total = 0
        cluster.index.add_instance(name, 0)

    # ---- intake --------------------------------------------------------------------------

    def check(self, req: EngineRequest) -> None:
        """Raises ``RequestTooLarge`` if the request could never be admitted here."""
        need = req.prompt_tokens + req.max_new_tokens
        if need > self.pool_tokens:
            raise RequestTooLarge(
                f"prompt ({req.prompt_tokens}) + max new tokens ({req.max_new_tokens}) "
                f"exceeds the KV pool ({self.pool_tokens} tokens)"
            )

    def add_request(self, req: EngineRequest) -> None:
        self.check(req)
        req.worker = self.name
        req.phase = Phase.WAITING
        req.queued_tokens = req.prompt_tokens - sum(self._cached_split(req, touch=False))
        self.waiting.append(req)
        self.requests_total += 1

    def add_decode(self, req: EngineRequest) -> None:
        """PD: a prefilled request arrives with its KV. It waits for room in the pool and the
        running cap like any request; its first token comes out with its first decode step."""
        self.check(req)
        req.phase = Phase.TRANSFER
        req.generated_tokens = 0
        req.queued_tokens = req.prompt_tokens  # what the decode-side least-loaded rule weighs
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def load(self) -> WorkerLoad:
        """``queued_prefill_tokens``: the prompt tokens still to compute, of the requests in
        prefill and of those waiting (not their cached prefix: the router counts a request's
        uncached tokens, and so must what a policy sees in the simulator)."""
        queued = sum(r.prompt_tokens - r.prefilled_tokens for r in self.prefilling)
        queued += sum(r.queued_tokens for r in self.waiting)
        return WorkerLoad(
            running=len(self.running) + len(self.prefilling),
            waiting=len(self.waiting),
            used_tokens=self.used_tokens,
            pool_tokens=self.pool_tokens,
            queued_prefill_tokens=queued,
            decode_context_tokens=sum(r.context_tokens for r in self.running),
        )

    # ---- KV accounting -------------------------------------------------------------------

    @property
    def used_tokens(self) -> int:
        return self.reserved_tokens + self.locked_tokens

    def _set_cache_capacity(self, block_tokens: float) -> None:
        # The cache is counted in blocks of the first requests' size: mixing text and token
        # prompts (blocks of ~18.8 and 16 tokens) would otherwise resize it on every request.
        if self._block_tokens is None:
            self._block_tokens = block_tokens
        free = max(self.pool_tokens - self.reserved_tokens, 0)
        self.cluster.index.set_capacity(self.name, int(free / max(self._block_tokens, 1e-9)))

    def _reserve(self, req: EngineRequest, tokens: int, locked: int = 0) -> None:
        req.reserved_tokens, req.locked_tokens = tokens, locked
        self.reserved_tokens += tokens
        self.locked_tokens += locked
        self._set_cache_capacity(req.block_tokens)

    def _release(self, req: EngineRequest) -> None:
        self.reserved_tokens -= req.reserved_tokens
        self.locked_tokens -= req.locked_tokens
        req.reserved_tokens = req.locked_tokens = 0
        self._set_cache_capacity(req.block_tokens)

    def flush_cache(self) -> int:
        return self.cluster.index.clear(self.name)

    # ---- scheduling ----------------------------------------------------------------------

    def _local_tokens(self, req: EngineRequest, touch: bool) -> int:
        blocks = self.cluster.index.match_instance(self.name, req.keys, touch=touch)
        # SGLang always computes the last prompt token, to sample the first output token.
        return min(int(blocks * req.block_tokens), req.prompt_tokens - 1)

    def _cached_split(self, req: EngineRequest, touch: bool) -> tuple[int, int]:
        """The prompt tokens the request would not compute if admitted now: its local hit, and
        what the global tier holds beyond it (together at most all but the last token)."""
        local = self._local_tokens(req, touch)
        global_blocks = 0
        if self.cluster.global_tier is not None:
            global_blocks = self.cluster.index.match(req.keys, touch=False).global_blocks
        loaded = int(global_blocks * req.block_tokens) - local
        return local, max(min(loaded, req.prompt_tokens - 1 - local), 0)

    def _kv_need(self, req: EngineRequest, local_tokens: int) -> int:
        """Pool tokens a request takes beyond the cached prefix it shares."""
        return req.prompt_tokens - local_tokens + req.max_new_tokens

    def _admit(self, req: EngineRequest) -> float:
        """Starts a request's prefill: finds its cached prefix; returns the global load time."""
        self.cluster.set_global_block_tokens(req.block_tokens)
        # The cache is used: its path is refreshed.
        local, req.global_cached_tokens = self._cached_split(req, touch=True)
        req.local_cached_tokens = local
        req.prefilled_tokens = req.cached_tokens
        req.phase = Phase.PREFILL
        self._reserve(req, self._kv_need(req, local), locked=local)
        self.prompt_tokens_total += req.prompt_tokens
        self.cached_tokens_total += req.cached_tokens
        tier = self.cluster.global_tier
        if tier is None or req.global_cached_tokens == 0:
            return 0.0
        return self.profile.kv_move_time_s(
            req.global_cached_tokens, tier.load_bytes_per_s, tier.load_latency_s
        )

    def next_batch(self, now_s: float) -> Batch | None:
        """Plans the next iteration starting at ``now_s``; None when there is nothing to run.
        Requests that arrive after ``now_s`` wait for a later iteration."""
        budget = self.config.chunk_tokens
        prefill: list[tuple[EngineRequest, int]] = []
        load_s = 0.0
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.prompt_tokens - req.prefilled_tokens, budget)
            prefill.append((req, n))
            budget -= n
        while self.waiting and self.waiting[0].arrival_s <= now_s:
            req = self.waiting[0]
            if len(self.running) + len(self.prefilling) >= self.config.max_running_requests:
                break
            if self.role == "decode":
                if self.used_tokens + req.prompt_tokens + req.max_new_tokens > self.pool_tokens:
                    break
                self.waiting.popleft()
                self._reserve(req, req.prompt_tokens + req.max_new_tokens)
                req.phase = Phase.DECODE
                self.running.append(req)
                continue
            if budget <= 0:
                break
            local = self._local_tokens(req, touch=False)
            if self.used_tokens + self._kv_need(req, local) + local > self.pool_tokens:
                break  # waits for KV to free up, in FIFO order
            self.waiting.popleft()
            load_s += self._admit(req)
            self.prefilling.append(req)
            n = min(req.prompt_tokens - req.prefilled_tokens, budget)
            prefill.append((req, n))
            budget -= n
        decode = list(self.running)
        if not prefill and not decode:
            return None
        context = sum(r.context_tokens for r in decode)
        compute_s = self.profile.iteration_time_s(
            [(n, r.prefilled_tokens) for r, n in prefill], len(decode), context
        )
        duration = (compute_s + load_s) * self.slowdown
        self.busy_until_s = now_s + duration
        return Batch(now_s, duration, prefill, decode, load_s)

    def finish_batch(self, batch: Batch, now_s: float) -> IterationEvents:
        """Applies an iteration that ended at ``now_s``."""
        events = IterationEvents()
        self.busy_until_s = None
        for req in batch.decode:
            if req.phase is not Phase.DECODE:
                continue  # aborted meanwhile
            req.generated_tokens += 1
            self.generation_tokens_total += 1
            if req.generated_tokens == 1:  # PD: a decode worker's first step
                req.first_token_s = now_s
                events.first_token.append(req)
            else:
                events.decoded.append(req)
            if req.generated_tokens >= req.max_new_tokens:
                self.running.remove(req)
                self._finish(req, now_s)
                events.finished.append(req)
        for req, n in batch.prefill:
            if req.phase is not Phase.PREFILL:
                continue
            req.prefilled_tokens += n
            if req.prefilled_tokens < req.prompt_tokens:
                continue
            self.prefilling.remove(req)
            if self.role == "prefill":
                req.phase = Phase.TRANSFER
                self._release(req)
                self._cache_prompt(req)
                events.handoff.append(req)
                continue
            req.phase = Phase.DECODE
            req.first_token_s = now_s
            req.generated_tokens = 1
            self.generation_tokens_total += 1
            events.first_token.append(req)
            if req.max_new_tokens <= 1:
                self._finish(req, now_s)
                events.finished.append(req)
            else:
                self.running.append(req)
        return events

    def _cache_prompt(self, req: EngineRequest) -> None:
        index = self.cluster.index
        index.insert(self.name, req.keys)
        if self.cluster.global_tier is not None:
            index.insert(GLOBAL_TIER, req.keys)  # write-through

    def _finish(self, req: EngineRequest, now_s: float) -> None:
        req.phase = Phase.DONE
        req.finish_s = now_s
        self._release(req)
        if self.role != "decode":
            self._cache_prompt(req)

    def abort(self, req: EngineRequest) -> bool:
        """Drops a request (client gone); True if it was here."""
        for queue in (self.waiting, self.prefilling, self.running):
            if req in queue:
                queue.remove(req)
                if req.reserved_tokens or req.locked_tokens:
                    self._release(req)
                req.phase = Phase.DONE
                return True
        return False

    def transfer_time_s(self, req: EngineRequest) -> float:
        """PD: moving a prefilled request's KV to a decode worker."""
        return self.profile.kv_move_time_s(
            req.prompt_tokens,
            self.config.pd_transfer_bytes_per_s,
            self.config.pd_transfer_latency_s,
        )
