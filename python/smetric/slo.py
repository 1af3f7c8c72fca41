"""The SLO model: predicted TTFT and TPOT of a request on an instance, from the same performance
profile the engine model uses, corrected online from what responses show.

SLOs (SPEC §4): a request's TTFT SLO is ``ttft_slo_scale`` (k, default 5) times the TTFT it would
have alone on an idle instance with nothing cached, or an absolute ``ttft_slo_ms``; the TPOT SLO is
``tpot_slo_ms`` (default 100 ms).

Predictions are closed-form (a few multiplications per instance) so a policy can afford them on
the hot path:

* TTFT = (FLOPs of the prefill queued ahead + FLOPs of this request's uncached tokens over its
  cached context) / (peak x mfu) + one iteration overhead per prefill chunk + the global-tier load
  time of the part loaded instead of recomputed. Queued prefill is compute-bound, so the decode
  steps sharing those iterations are left out.
* TPOT = one decode step of the instance's batch with this request added (batch and context).

Each instance has a TTFT and a TPOT correction factor: the ratio of observed to predicted,
bounded to [0.5, 2], and decaying back to 1 with a 60 s half-life when nothing new is observed
(the TTFT factors are decayed to the present every ``CORRECTION_REFRESH_S``, 0.1 s, at most).
The TPOT factor is an average (EWMA, weight 0.2). The TTFT factor is the *median* of the last
``TTFT_WINDOW`` ratios (each decaying the same way), because a TTFT's error is bimodal: chunked
prefill fills a request's last iteration up to a whole chunk with prefill that arrives after it,
so its TTFT is either as predicted or up to one chunk's compute time longer. An average chases
the rarer mode and puts every other prediction off by part of a chunk. And an observation that
such a top-up explains (another request was sent to the instance while this one waited, and
this one came no more than a chunk's compute time late) teaches nothing, so it is not counted;
one later than that is measured against the prediction plus that chunk. Whether a top-up comes
depends on arrivals the router cannot see yet and on where the engine's iteration boundaries
fall. Without those boundaries, predictions leave top-ups out (guessing the likelier outcome
from the recent arrival rate alone took the simulator's median error from 5.5% to 9.8%). Once an
instance has streamed a first token, which marks a boundary, SMetric's predictions for it follow
its iterations from there and count the likelier top-up (``predict_ttft_s(top_up=True)``).
Whether another request came meanwhile is judged on this model's clock, the TTFT being in the
worker's time: for an emulated worker faster than real time the look-back is too long, and more
observations count as possibly topped up. The router observes TTFT at a response's first chunk
and TPOT from a stream's events (the time from the first event to the last over the events
between; one event per token, as SGLang streams by default).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from smetric.perf import Profile

CORRECTION_WEIGHT = 0.2
CORRECTION_BOUNDS = (0.5, 2.0)
CORRECTION_HALF_LIFE_S = 60.0
RATE_WINDOW = 16
"""Dispatches per instance its arrival rate is measured over."""
TTFT_WINDOW = 15
"""Ratios (observed / predicted) the TTFT correction takes the median of."""
CORRECTION_REFRESH_S = 0.1
"""How often the TTFT corrections are decayed to the present. Balancing reads every instance's
on every decision, and decaying 64 of them took 16 us; between refreshes each stays as of the
last refresh or of when it was set (0.1 s of decay moves a factor by at most 0.12% of its
distance from 1)."""


@dataclass(frozen=True)
class SLOConfig:
    ttft_slo_scale: float = 5.0
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float = 100.0
    chunk_tokens: int = 8192
    global_tier: bool = True
    global_load_bytes_per_s: float = 25e9
    global_load_latency_s: float = 0.002


class _Correction:
    __slots__ = ("at", "factor", "ratios")

    def __init__(self) -> None:
        self.factor = 1.0
        self.at = 0.0
        self.ratios: list[float] = []
        """The median's window (TTFT only), decayed to ``at``."""


def _decayed(c: _Correction, now: float) -> float:
    """A correction factor as of ``now``: back towards 1 by half each half-life since it was
    last set."""
    decay: float = 0.5 ** ((now - c.at) / CORRECTION_HALF_LIFE_S)
    return 1.0 + (c.factor - 1.0) * decay


class SLOModel:
    def __init__(
        self,
        profile: Profile,
        config: SLOConfig = SLOConfig(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.profile = profile
        self.config = config
        self.clock = clock
        m, g = profile.model, profile.gpu
        self._flops_per_s = g.bf16_flops * profile.mfu
        self._linear = 2.0 * m.active_params  # FLOPs per token
        self._attention = 4.0 * m.layers * m.q_heads * m.head_dim  # FLOPs per token pair
        self._kv_bytes = profile.kv_bytes_per_token
        self._ttft: dict[str, _Correction] = {}
        self._ttft_now: dict[str, float] = {}
        """Every TTFT correction's factor as of ``_ttft_now_at``, or as of when it was set."""
        self._ttft_now_at = -math.inf
        self._dispatches: dict[str, deque[float]] = {}
        self._first_token_at: dict[str, float] = {}
        self._chunk_s = profile.prefill_time_s(config.chunk_tokens)
        self._tpot: dict[str, _Correction] = {}

    # ---- SLOs ----------------------------------------------------------------------------

    def idle_ttft_s(self, prompt_tokens: int) -> float:
        return self._prefill_s(0, prompt_tokens, 0)

    def ttft_slo_s(self, prompt_tokens: int) -> float:
        if self.config.ttft_slo_ms is not None:
            return self.config.ttft_slo_ms / 1000.0
        return self.config.ttft_slo_scale * self.idle_ttft_s(prompt_tokens)

    @property
    def tpot_slo_s(self) -> float:
        return self.config.tpot_slo_ms / 1000.0

    # ---- predictions ---------------------------------------------------------------------

    def _compute_s(self, queued: int, uncached: int, cached: int) -> float:
        """The compute of ``queued`` tokens of prefill ahead and of this request's ``uncached``
        tokens over its ``cached`` context, without the iterations' overhead."""
        flops = self._linear * (queued + uncached)
        flops += self._attention * (uncached * cached + uncached * (uncached + 1) / 2.0)
        return flops / self._flops_per_s

    def _prefill_s(self, queued: int, uncached: int, cached: int) -> float:
        chunks = math.ceil((queued + uncached) / self.config.chunk_tokens)
        return self._compute_s(queued, uncached, cached) + chunks * self.profile.overhead_s

    def global_load_s(self, tokens: int) -> float:
        if tokens <= 0 or not self.config.global_tier:
            return 0.0
        c = self.config
        return tokens * self._kv_bytes / c.global_load_bytes_per_s + c.global_load_latency_s

    def queue_delay_s(self, url: str, queued_prefill_tokens: int) -> float:
        """How long prefill already queued on an instance keeps a new request waiting."""
        if queued_prefill_tokens <= 0:
            return 0.0
        return self._prefill_s(queued_prefill_tokens, 0, 0) * self.correction(url)

    def predict_ttft_s(
        self,
        url: str,
        queued_prefill_tokens: int,
        prompt_tokens: int,
        local_tokens: int,
        global_tokens: int = 0,
        top_up: bool = False,
    ) -> float:
        """TTFT of a request with ``local_tokens`` cached on the instance and ``global_tokens``
        more loadable from the global tier (ignored without one). With ``top_up``, and a first
        token from the instance seen (``observe_ttft``), on the engine's iteration boundaries
        and with chunked prefill's likelier top-up (``_aligned_s``)."""
        loaded = global_tokens if self.config.global_tier else 0
        cached = min(local_tokens + loaded, max(prompt_tokens - 1, 0))
        uncached = prompt_tokens - cached
        if top_up and queued_prefill_tokens > 0 and url in self._first_token_at:
            t = self._aligned_s(url, queued_prefill_tokens, uncached, cached)
        else:
            t = self._prefill_s(queued_prefill_tokens, uncached, cached)
        return (t + self.global_load_s(cached - local_tokens)) * self.correction(url)

    def hit_blind_ttfts_s(
        self, queued_prefill_tokens: Iterable[int], prompt_tokens: int, global_tokens: int
    ) -> dict[int, float]:
        """``predict_ttft_s`` of a request holding nothing on an instance, for each of these
        amounts of prefill queued ahead (a dict by amount), without corrections (``correction``
        times it is the prediction) and without a top-up. The request's own part is worked out
        once, then each distinct amount's with the same arithmetic as ``_prefill_s`` (a test pins
        them equal): a policy costs every instance with it on every first turn, and instances
        with nothing queued, or as much, are common."""
        loaded = global_tokens if self.config.global_tier else 0
        cached = min(loaded, max(prompt_tokens - 1, 0))
        uncached = prompt_tokens - cached
        attention = self._attention * (uncached * cached + uncached * (uncached + 1) / 2.0)
        linear, flops_per_s = self._linear, self._flops_per_s
        chunk, overhead = self.config.chunk_tokens, self.profile.overhead_s
        load_s = self.global_load_s(cached)
        return {
            q: (linear * (q + uncached) + attention) / flops_per_s
            + math.ceil((q + uncached) / chunk) * overhead
            + load_s
            for q in set(queued_prefill_tokens)
        }

    def _aligned_s(self, url: str, queued: int, uncached: int, cached: int) -> float:
        """Prefill time of a request behind ``queued`` tokens on the engine's own iteration
        boundaries, with its last iteration topped up in the likelier case.

        The last first token from the instance marks an iteration boundary. The router's queued
        count is what is left after it got through the profile's chunk rate since then, so the
        queue at that boundary is ``queued`` plus that; from there the engine runs back-to-back
        iterations of a chunk each, so the one now running ends at the next multiple of a
        chunk's time, and this request starts after it. Its last iteration is filled up to a
        chunk by whatever arrives before it begins: likelier than not (Poisson at the instance's
        recent arrival rate) -> counted as a whole chunk, else as its own tail. Times since the
        first token are on this model's clock and the chunk's time is the worker's: an emulated
        worker running faster than real time puts the boundaries off (the router's tests)."""
        c, chunk_s = self.config.chunk_tokens, self._chunk_s
        now = self.clock()
        since = max(now - self._first_token_at[url], 0.0)
        at_boundary = queued + since * c / chunk_s
        k = math.floor(since / chunk_s)
        if at_boundary > (k + 1) * c:  # the iteration now running is a whole chunk
            ahead = int(at_boundary - (k + 1) * c)
            rest = (k + 1) * chunk_s - since
        else:  # the one now running is the queue's last, partial, one
            ahead = 0
            rest = max(k * chunk_s + self._prefill_s(int(at_boundary) - k * c, 0, 0) - since, 0.0)
        t = rest + self._prefill_s(ahead, uncached, cached)
        total = ahead + uncached
        tail = total % c or c
        if tail < c:
            wait = rest + (self._prefill_s(total - tail, 0, 0) if total > tail else 0.0)
            if self.arrival_rate(url) * wait > math.log(2.0):
                t += self._compute_s(0, c - tail, 0)  # the top-up rides in the same iteration
        return t

    def predict_tpot_s(
        self, url: str, decode_batch: int, decode_context_tokens: int, prompt_tokens: int
    ) -> float:
        """One decode step once this request joins the batch."""
        step = self.profile.decode_step_s(decode_batch + 1, decode_context_tokens + prompt_tokens)
        return step * self.tpot_correction(url)

    # ---- online correction ---------------------------------------------------------------

    def note_dispatch(self, url: str) -> None:
        """A request was sent to the instance (for its arrival rate, and for the TTFT
        correction, which asks whether another came while one waited)."""
        times = self._dispatches.get(url)
        if times is None:
            times = self._dispatches[url] = deque(maxlen=RATE_WINDOW)
        times.append(self.clock())

    def arrival_rate(self, url: str) -> float:
        """Requests per second sent to the instance lately: the last ``RATE_WINDOW`` dispatches
        over the time from the first of them to now (so a pause lowers it)."""
        times = self._dispatches.get(url)
        if not times or len(times) < 2:
            return 0.0
        span = self.clock() - times[0]
        return (len(times) - 1) / span if span > 0 else 0.0

    def observe_ttft(self, url: str, predicted: float, observed: float) -> None:
        """Updates an instance's TTFT correction from one response: the median of its recent
        ratios (see the module's docstring)."""
        if predicted <= 0 or observed <= 0:
            return
        c = self._ttft.setdefault(url, _Correction())
        now = self.clock()
        current = self.correction(url)
        self._first_token_at[url] = now
        times = self._dispatches.get(url)
        if times and times[-1] > now - observed:
            # Another request reached the instance while this one waited, so its last prefill
            # iteration may have been topped up with up to a chunk: an observation up to that
            # much above the prediction agrees with the model and teaches nothing.
            band = self._compute_s(self.config.chunk_tokens, 0, 0) * current
            if predicted <= observed <= predicted + band:
                return
            if observed > predicted:
                predicted += band  # later still: measured against the topped-up prediction
        # Every ratio decays towards 1 at the same pace, so decaying them all to now keeps their
        # order, and the median of the decayed window is the decayed median.
        decay: float = 0.5 ** ((now - c.at) / CORRECTION_HALF_LIFE_S)
        ratios = [1.0 + (r - 1.0) * decay for r in c.ratios[-(TTFT_WINDOW - 1) :]]
        ratios.append(current * observed / predicted)
        c.ratios = ratios
        lo, hi = CORRECTION_BOUNDS
        c.factor = min(max(statistics.median(ratios), lo), hi)
        c.at = now
        self._ttft_now[url] = c.factor

    def observe_tpot(self, url: str, predicted: float, observed: float) -> None:
        """Updates an instance's TPOT correction from one streamed response (an average)."""
        if predicted <= 0 or observed <= 0:
            return
        current = self.tpot_correction(url)
        c = self._tpot.setdefault(url, _Correction())
        raw = current * observed / predicted  # predicted already carried the current factor
        lo, hi = CORRECTION_BOUNDS
        c.factor = min(max(current + CORRECTION_WEIGHT * (raw - current), lo), hi)
        c.at = self.clock()

    def corrections(self) -> Mapping[str, float]:
        """Every instance's current TTFT correction that has one, decayed to the present at most
        ``CORRECTION_REFRESH_S`` ago (``correction`` of each): for a policy that costs every
        instance. Read-only: it is the model's own table."""
        now = self.clock()
        if not 0.0 <= now - self._ttft_now_at < CORRECTION_REFRESH_S:
            self._ttft_now = {url: _decayed(c, now) for url, c in self._ttft.items()}
            self._ttft_now_at = now
        return self._ttft_now

    def correction(self, url: str) -> float:
        """Current TTFT correction factor of an instance (see ``corrections``)."""
        return self.corrections().get(url, 1.0)

    def tpot_correction(self, url: str) -> float:
        """Current TPOT correction factor of an instance."""
        c = self._tpot.get(url)
        return 1.0 if c is None else _decayed(c, self.clock())
