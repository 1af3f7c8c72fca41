"""SMetric: differential scheduling on the session turn and the local KV hit, gated by the SLO.

* **Session turn.** A chat request is a first turn when it has no assistant or tool message. A
  raw prompt (``/generate``, completions) cannot say, so it counts as a follow-up when some
  instance holds at least ``FOLLOW_UP_HIT_FRACTION`` (half) of it beyond the prefix every
  instance holds; a session key header, when present, marks every request after the first with
  that key as a follow-up and remembers where the session lives.
* **Local hit.** Per instance, from the prefix index. A prefix that every instance holds (a shared
  system prompt) is no sign of a session, so the *session hit* is the best hit minus the hit all
  instances share.
* **First turn** -> the least loaded instance (``first_turn_balance``). Load is the request's
  *cost* there: its predicted TTFT on that instance (prefill queued ahead, its own uncached
  tokens, global-tier loading) times the requests the instance is serving plus one, since its
  prefill delays every one of them (the decode steps of running requests wait for its chunks).
  Predicted queueing delay alone ignores the decode batch it would slow down; request counts
  ignore how much work each request is. Both are kept as ablations (measured in the README).
* **Follow-up** -> the instance holding the most of it (or the session key's instance), if the SLO
  model predicts its TTFT and TPOT there within the SLOs (``stick``); otherwise migrate to the
  least loaded other instance, which loads the session's KV from the global tier instead of
  recomputing it (``migrate_slo``). If neither meets the SLO, whichever is predicted faster
  (``stick_over_slo`` / ``migrate_over_slo``). A follow-up with no session hit anywhere is
  balanced like a first turn (``follow_up_no_hit_balance``).
* The best-hit instance being unhealthy needs no rule: the snapshot holds eligible instances only,
  so the session's next-best holder, or the least loaded, is chosen among those.

Ties between equally loaded instances go to the one the balancing rule has picked least often
(so sessions that start one after another on an idle cluster still spread), then to the first in
the snapshot; ties between equal hits go to the first in the snapshot. Ablations:
``slo_gate=False`` always sticks, ``migration=False`` sticks even over the SLO,
``turn_detection=False`` treats every request as a follow-up (hit only), and
``load_metric="delay"`` balances by predicted queueing delay, ``load_metric="requests"`` by
request count.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter
from typing import cast

from smetric.cluster import ClusterView, Decision, WorkerView
from smetric.perf import DEFAULT_PROFILE, Profile, load_profile
from smetric.request import RequestView
from smetric.slo import SLOConfig, SLOModel

FOLLOW_UP_HIT_FRACTION = 0.5

_HIT = attrgetter("local_hit_blocks")
_URL = attrgetter("url")
_IN_FLIGHT = attrgetter("in_flight")
_QUEUED = attrgetter("queued_prefill_tokens")


@dataclass(frozen=True)
class SMetricConfig:
    profile: str = DEFAULT_PROFILE
    slo: SLOConfig = SLOConfig()
    slo_gate: bool = True
    migration: bool = True
    turn_detection: bool = True
    load_metric: str = "cost"
    """``cost`` (predicted TTFT x (requests served + 1)), ``delay`` (predicted queueing delay) or
    ``requests`` (in-flight count)."""
    max_sessions: int = 1_000_000


class SMetric:
    name = "smetric"

    def __init__(self, config: object = None, profile: Profile | None = None) -> None:
        cfg = getattr(config, "smetric", None) or SMetricConfig()
        assert isinstance(cfg, SMetricConfig)
        if cfg.load_metric not in ("cost", "delay", "requests"):
            raise ValueError("load_metric must be 'cost', 'delay' or 'requests'")
        self.config = cfg
        self.slo = SLOModel(profile or load_profile(cfg.profile), cfg.slo)
        self._sessions: OrderedDict[str, str] = OrderedDict()
        # Balancing picks per instance: among equally loaded instances (an idle cluster), the one
        # picked least often wins, so sessions that start one after another still spread.
        self._picks: dict[str, int] = {}

    # ---- load ----------------------------------------------------------------------------

    def _least_loaded(self, req: RequestView, cluster: ClusterView, exclude: int = -1) -> int:
        """The instance with the lowest load (``_loads``), ``exclude`` left out unless it is the
        only one; ties go to the lower tie-breaker, then to the one picked least often, then to
        the first."""
        ws = cluster.workers
        load, tie_breaker = self._loads(req, cluster)
        if exclude >= 0 and len(load) > 1:
            load[exclude] = math.inf
        # C loops where they do (this runs over every instance on every first turn): a lone
        # lowest is found by value; ties narrowed a key at a time.
        lowest = min(load)
        tied = load.count(lowest)
        if tied == 1:
            best = load.index(lowest)
        else:
            ties: range | list[int]
            workers: Sequence[WorkerView] | None
            if tied == len(load):  # an idle cluster ties them all
                ties, workers = range(tied), ws
                keys = list(map(_IN_FLIGHT, ws)) if tie_breaker is None else tie_breaker
            else:
                ties, workers = [i for i, x in enumerate(load) if x == lowest], None
                if tie_breaker is None:
                    keys = [ws[i].in_flight for i in ties]
                else:
                    keys = [tie_breaker[i] for i in ties]
            least = min(keys)
            if keys.count(least) != len(keys):
                ties, workers = [i for i, k in zip(ties, keys, strict=True) if k == least], None
            if workers is None:
                workers = [ws[i] for i in ties]
            picks = list(map(self._picks.get, map(_URL, workers), repeat(0)))
            best = ties[picks.index(min(picks))]
        url = ws[best].url
        self._picks[url] = self._picks.get(url, 0) + 1
        return best

    def _loads(
        self, req: RequestView, cluster: ClusterView
    ) -> tuple[list[float], list[int] | None]:
        """Numbers in the order of each instance's load under ``load_metric`` (equal where the
        loads are: request counts stand for loads they order alike), and the tie-breaker before
        picks (None: the request counts, for ``_least_loaded`` to read only if loads tie)."""
        ws = cluster.workers
        metric = self.config.load_metric
        if metric == "requests":
            return list(map(_IN_FLIGHT, ws)), list(map(_QUEUED, ws))
        if metric == "delay":
            delay = self.slo.queue_delay_s
            return [delay(w.url, w.queued_prefill_tokens) for w in ws], None
        # Hit-blind, as balancing should be: every instance is costed as if it held none of the
        # request and loaded what the global tier holds (``predict_ttft_s``, the request's part
        # worked out once, each amount queued once, and the corrections of the present), in
        # one pass over the views.
        prompt = req.prompt_tokens
        glob = min(int(cluster.global_hit_blocks * cluster.block_tokens), prompt)
        ttft = self.slo.hit_blind_ttfts_s(map(_QUEUED, ws), prompt, glob)
        corrections = self.slo.corrections()
        if corrections:
            get = corrections.get
            return [
                ttft[w.queued_prefill_tokens] * get(w.url, 1.0) * (w.in_flight + 1) for w in ws
            ], None
        if len(ttft) == 1:
            # One TTFT everywhere: the cost is that times requests served + 1, which never
            # falls as the count grows, and the tie-breaker is the count, so the counts choose
            # as the costs do, ties included.
            in_flight = list(map(_IN_FLIGHT, ws))
            return cast("list[float]", in_flight[:]), in_flight
        return [ttft[w.queued_prefill_tokens] * (w.in_flight + 1) for w in ws], None

    # ---- the decision --------------------------------------------------------------------

    def _remember(self, req: RequestView, url: str) -> None:
        if req.session_key is None:
            return
        self._sessions[req.session_key] = url
        self._sessions.move_to_end(req.session_key)
        while len(self._sessions) > self.config.max_sessions:
            self._sessions.popitem(last=False)

    def select(self, req: RequestView, cluster: ClusterView) -> Decision:
        d = self._select(req, cluster)
        url = cluster.workers[d.worker].url
        self._remember(req, url)
        self.slo.note_dispatch(url)
        return d

    def _select(self, req: RequestView, cluster: ClusterView) -> Decision:
        if req.is_first_turn and req.session_key is None and self.config.turn_detection:
            # Said to be a first turn, and no session key to say otherwise: the hits are moot.
            return self._balanced(req, cluster, "first_turn_balance")
        ws = cluster.workers
        hits = list(map(_HIT, ws))
        best = hits.index(max(hits))  # the first of the best (C loops: this runs per request)
        shared = min(hits)
        session_blocks = hits[best] - shared

        # The session key, when given, names where the session lives.
        home = None
        if req.session_key is not None:
            url = self._sessions.get(req.session_key)
            home = next((i for i, w in enumerate(ws) if w.url == url), None)
            if url is not None and home is None:
                home = best if session_blocks else None  # its instance is gone

        if not self.config.turn_detection or (
            req.session_key is not None and req.session_key in self._sessions
        ):
            first = False
        elif req.is_first_turn is not None:
            first = req.is_first_turn
        else:
            q = max(cluster.query_blocks, 1)
            first = session_blocks / q < FOLLOW_UP_HIT_FRACTION

        if first:
            return self._balanced(req, cluster, "first_turn_balance")
        cand = home if home is not None else best
        if home is None and session_blocks == 0:
            return self._balanced(req, cluster, "follow_up_no_hit_balance")
        if not self.config.slo_gate:
            return self._with_prediction(req, cluster, cand, "stick")

        ttft, tpot = self._predict_at(req, cluster, cand)
        ttft_slo, tpot_slo = self.slo.ttft_slo_s(req.prompt_tokens), self.slo.tpot_slo_s
        if ttft <= ttft_slo and tpot <= tpot_slo:
            return Decision(cand, "stick", ttft, tpot)
        if not self.config.migration or len(ws) == 1:
            return Decision(cand, "stick_over_slo", ttft, tpot)
        target = self._least_loaded(req, cluster, exclude=cand)
        t_ttft, t_tpot = self._predict_at(req, cluster, target)
        if t_ttft <= ttft_slo and t_tpot <= tpot_slo:
            return Decision(target, "migrate_slo", t_ttft, t_tpot)
        # Nobody meets the SLO: the faster of the two (TTFT first, then TPOT).
        if (t_ttft, t_tpot) < (ttft, tpot):
            return Decision(target, "migrate_over_slo", t_ttft, t_tpot)
        return Decision(cand, "stick_over_slo", ttft, tpot)

    def _predict_at(self, req: RequestView, cluster: ClusterView, i: int) -> tuple[float, float]:
        """Predicted (TTFT, TPOT) on instance ``i``: what it holds locally, the rest of what the
        global tier holds loaded from there."""
        w, prompt = cluster.workers[i], req.prompt_tokens
        local = cluster.local_hit_tokens(i, prompt)
        glob = max(int(cluster.global_hit_blocks * cluster.block_tokens) - local, 0)
        ttft = self.slo.predict_ttft_s(
            w.url, w.queued_prefill_tokens, prompt, local, glob, top_up=True
        )
        tpot = self.slo.predict_tpot_s(w.url, w.in_flight, w.running_decode_tokens, prompt)
        return ttft, tpot

    def _balanced(self, req: RequestView, cluster: ClusterView, reason: str) -> Decision:
        """The least loaded instance (``_least_loaded``), with its predictions."""
        return self._with_prediction(req, cluster, self._least_loaded(req, cluster), reason)

    def _with_prediction(
        self, req: RequestView, cluster: ClusterView, i: int, reason: str
    ) -> Decision:
        """A decision made without the SLO gate still carries its predictions, so every response
        can correct the model."""
        return Decision(i, reason, *self._predict_at(req, cluster, i))

    def observe(self, url: str, decision: Decision, ttft_s: float | None) -> None:
        """What the chosen worker did: corrects the SLO model's TTFT for that instance."""
        if ttft_s is not None and decision.predicted_ttft_s is not None:
            self.slo.observe_ttft(url, decision.predicted_ttft_s, ttft_s)

    def observe_tpot(self, url: str, decision: Decision, tpot_s: float) -> None:
        """The mean time between the chosen worker's streamed tokens: corrects its TPOT."""
        if decision.predicted_tpot_s is not None:
            self.slo.observe_tpot(url, decision.predicted_tpot_s, tpot_s)
