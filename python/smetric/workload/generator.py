"""Synthetic agent sessions: a parametric workload shaped like real tool-calling agents.

A session opens with a system prompt shared by every session (policy + tool schemas) plus a first
user message; each next turn's prompt is the previous prompt plus the previous answer plus what
the tools returned, and it arrives a tool time after that answer (closed loop). Prompts are keyed
in 16-token blocks whose ids are drawn from the seed, so a turn's keys extend its previous turn's
and the system prompt's blocks are the same in every session.

The defaults are fitted (``fit_spec``) to the real sessions of the shared traces'
``agents/taubench_airline.jsonl`` (tau-bench gpt-4o airline, 200 sessions); see
``AgentWorkloadSpec``.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from smetric import BlockKeys
from smetric.request import chat_prompt_text, text_prompt_tokens
from smetric.sim import SimRequest
from smetric.workload.agents import Session, output_tokens

_Z90 = statistics.NormalDist().inv_cdf(0.9)


@dataclass(frozen=True)
class LogNormal:
    """A positive quantity, log-normal through its median and 90th percentile, clipped to
    ``[lo, hi]`` (fitted ones are clipped to the range observed, so samples never leave it)."""

    median: float
    p90: float
    lo: float = 0.0
    hi: float = math.inf

    def __post_init__(self) -> None:
        if not 0 < self.median <= self.p90 < math.inf:
            raise ValueError(f"need 0 < median <= p90 < inf, got {self.median}, {self.p90}")
        if not 0 <= self.lo <= self.hi:
            raise ValueError(f"need 0 <= lo <= hi, got {self.lo}, {self.hi}")

    @property
    def sigma(self) -> float:
        return math.log(self.p90 / self.median) / _Z90

    def sample(self, rng: random.Random) -> float:
        x = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        return min(max(x, self.lo), self.hi)

    @staticmethod
    def fit(values: Sequence[float]) -> LogNormal:
        if not values or min(values) <= 0:
            raise ValueError("fitting needs at least one value, all positive")
        median = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1] if len(values) > 1 else median
        return LogNormal(median, max(p90, median), min(values), max(values))


@dataclass(frozen=True)
class AgentWorkloadSpec:
    """A workload of agent sessions. Token counts are at 3.4 bytes a token (``smetric.request``).

    Defaults: ``fit_spec(load_sessions("agents/taubench_airline.jsonl"))`` on all 200 sessions
    of the shared traces, rounded. tau-bench records no times, so the tool time is the shared
    traces README's mini-swe-agent measurement (median 0.27 s, p90 1.14 s, max 64 s), and the
    session gap is the 2 s that ``smetric sweep --trace agents`` starts sessions at.
    """

    sessions: int = 200
    turns: LogNormal = LogNormal(11, 20, 2, 30)
    system_prompt_tokens: int = 4375
    """The opening every session shares (airline policy + tool schemas)."""
    first_user_tokens: LogNormal = LogNormal(24, 44, 10, 70)
    """The rest of the first prompt."""
    tool_output_tokens: LogNormal = LogNormal(63, 334.5, 11, 2460)
    """What a turn appends besides the previous answer (tool results, user replies)."""
    output_tokens: LogNormal = LogNormal(37, 132, 1, 369)
    tool_time_s: LogNormal = LogNormal(0.27, 1.14, 0.0, 64.0)
    """Between an answer and the next turn's request."""
    session_gap_s: float = 2.0
    """Mean gap between session starts (Poisson arrivals)."""
    block_tokens: int = 16

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.block_tokens < 1:
            raise ValueError("sessions and block_tokens must be >= 1")
        if self.system_prompt_tokens < 0 or self.session_gap_s < 0:
            raise ValueError("system_prompt_tokens and session_gap_s must be >= 0")


def _common_prefix_bytes(texts: Sequence[str]) -> int:
    # The lexicographically first and last texts differ earliest of any pair.
    a, b = min(texts).encode(), max(texts).encode()
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def fit_spec(
    sessions: Sequence[Session], base: AgentWorkloadSpec | None = None
) -> AgentWorkloadSpec:
    """The spec of recorded sessions: their count, turns, shared opening (the common prefix of
    the first prompts), first user message, growth per turn and answers; tool times where the
    sessions record them. What they do not record (session arrivals) comes from ``base``."""
    if len(sessions) < 2:
        raise ValueError("fitting needs at least two sessions (the shared prefix is across them)")
    base = base or AgentWorkloadSpec()
    texts = [[chat_prompt_text(t.messages, s.tools) for t in s.turns] for s in sessions]
    if not all(texts):
        raise ValueError("every session needs at least one turn")
    system = text_prompt_tokens(_common_prefix_bytes([t[0] for t in texts]))
    first_user, appended, outputs, tool_times = [], [], [], []
    for s, prompts in zip(sessions, texts, strict=True):
        tokens = [text_prompt_tokens(len(p.encode())) for p in prompts]
        first_user.append(max(1, tokens[0] - system))
        outs = [output_tokens(t) for t in s.turns]
        outputs += outs
        for k in range(1, len(tokens)):
            appended.append(max(1, tokens[k] - tokens[k - 1] - outs[k - 1]))
        tool_times += [t.tool_time_s for t in s.turns[1:] if t.tool_time_s]
    return replace(
        base,
        sessions=len(sessions),
        turns=LogNormal.fit([len(s.turns) for s in sessions]),
        system_prompt_tokens=system,
        first_user_tokens=LogNormal.fit(first_user),
        tool_output_tokens=LogNormal.fit(appended) if appended else base.tool_output_tokens,
        output_tokens=LogNormal.fit(outputs),
        tool_time_s=LogNormal.fit(tool_times) if len(tool_times) > 1 else base.tool_time_s,
    )


def generate(spec: AgentWorkloadSpec, seed: int) -> list[SimRequest]:
    """The workload's requests, rid ``g<session>#<turn>``, sessions starting at Poisson times
    from 0; each next turn ``after`` the previous one with a sampled tool time as ``delay_s``.

    Keys cover whole blocks only (the index's convention: a partial block's key could never
    match the next turn). Block ids are 64-bit draws from the seed: the system prompt's full
    blocks have the same ids in every session, every other block an id of its own, and a turn's
    ids are its previous turn's plus new ones. The same seed gives the same workload."""
    rng = random.Random(seed)
    bt = spec.block_tokens
    system_ids = [rng.getrandbits(64) for _ in range(spec.system_prompt_tokens // bt)]
    out: list[SimRequest] = []
    start_s = 0.0
    for s in range(spec.sessions):
        if s and spec.session_gap_s > 0:
            start_s += rng.expovariate(1.0 / spec.session_gap_s)
        session = f"g{s}"
        ids = list(system_ids)
        prompt = spec.system_prompt_tokens + max(1, round(spec.first_user_tokens.sample(rng)))
        prev = None
        for k in range(max(1, round(spec.turns.sample(rng)))):
            full = prompt // bt
            ids += [rng.getrandbits(64) for _ in range(full - len(ids))]
            answer = max(1, round(spec.output_tokens.sample(rng)))
            rid = f"{session}#{k}"
            out.append(
                SimRequest(
                    rid,
                    prompt,
                    answer,
                    BlockKeys.from_ids(ids[:full]),
                    float(bt),
                    arrival_s=start_s if prev is None else None,
                    after=prev,
                    delay_s=0.0 if prev is None else spec.tool_time_s.sample(rng),
                    session=session,
                    is_first_turn=prev is None,
                )
            )
            prompt += answer + max(1, round(spec.tool_output_tokens.sample(rng)))
            prev = rid
    return out
