"""The evaluation's workloads match their sources: Mooncake sessions rebuilt from hash ids, Bailian
sessions from parent ids, and synthetic agent sessions fitted to real ones.

Fixtures (tests/fixtures/NOTICE.md): the first 600 lines of the Mooncake conversation trace, and a
hand-written dozen rows in the Bailian format.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections import Counter
from pathlib import Path

import pytest

from smetric.cli import main
from smetric.perf import PRESETS
from smetric.sim import SimRequest, least_loaded, simulate
from smetric.workload.agents import load_sessions
from smetric.workload.bailian import load_bailian
from smetric.workload.generator import AgentWorkloadSpec, LogNormal, fit_spec, generate
from smetric.workload.mooncake import load_mooncake, reconstruct_sessions
from smetric.workload.sessions import idle_service_time

FIXTURES = Path(__file__).parent / "fixtures"
MOONCAKE = FIXTURES / "mooncake_conversation_600.jsonl"
BAILIAN = FIXTURES / "bailian_12.jsonl"
PROFILE = PRESETS["qwen2.5-7b-h200"]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def by_rid(requests: list[SimRequest]) -> dict[str, SimRequest]:
    return {r.rid: r for r in requests}


def check_sessions(requests: list[SimRequest], block_tokens: int, root_names: bool = True) -> None:
    """Closed-loop requests: every follow-up extends its parent's keys (all but a partial last
    block), is longer, and shares its parent's session, named after its first turn's rid
    (``root_names``) and holding one first turn."""
    rid = by_rid(requests)
    firsts = Counter(r.session for r in requests if r.is_first_turn)
    assert set(firsts.values()) == {1} and len(firsts) == len({r.session for r in requests})
    for r in requests:
        if r.after is None:
            assert r.is_first_turn and r.arrival_s is not None
            assert r.session == r.rid or not root_names
            continue
        parent = rid[r.after]
        assert not r.is_first_turn and r.arrival_s is None and r.delay_s >= 0
        assert r.session == parent.session
        full = min(len(parent.keys), parent.prompt_tokens // block_tokens)
        assert r.keys.common_prefix(parent.keys) >= full
        assert r.prompt_tokens > parent.prompt_tokens


# ---- Mooncake: sessions from hash ids -----------------------------------------------------------


def reference_parents(raw: list[dict]) -> list[int | None]:
    """The rule of ``reconstruct_sessions`` by brute force over lists: the earlier, shorter
    request whose full blocks are the longest prefix of this one's ids, then the latest, unless
    the deepest shared block already belongs to two sessions."""
    parents: list[int | None] = []
    roots: list[int] = []
    sessions_through: dict[int, set[int]] = {}
    for i, row in enumerate(raw):
        ids = row["hash_ids"]
        best = None
        for p in range(i):
            prev = raw[p]
            full = prev["hash_ids"][: min(len(prev["hash_ids"]), prev["input_length"] // 512)]
            if not full or ids[: len(full)] != full:
                continue
            if prev["input_length"] >= row["input_length"] or prev["timestamp"] >= row["timestamp"]:
                continue
            if len(sessions_through[full[-1]]) > 1:
                continue
            if best is None or len(full) >= best[0]:
                best = (len(full), p)
        parent = None if best is None else best[1]
        parents.append(parent)
        roots.append(i if parent is None else roots[parent])
        for block in ids[: min(len(ids), row["input_length"] // 512)]:
            sessions_through.setdefault(block, set()).add(roots[i])
    return parents


def test_mooncake_slice_loads_every_row_with_its_tokens_and_arrival_times():
    raw = rows(MOONCAKE)
    reqs = load_mooncake(MOONCAKE)
    assert len(reqs) == len(raw) == 600
    assert sum(r.prompt_tokens for r in reqs) == sum(x["input_length"] for x in raw)
    assert sum(r.output_tokens for r in reqs) == sum(x["output_length"] for x in raw)
    for r, x in zip(reqs, raw, strict=True):
        assert r.arrival_s == x["timestamp"] / 1000 and len(r.keys) == len(x["hash_ids"])
    assert [r.rid for r in load_mooncake(MOONCAKE, limit=5)] == [f"mc{i}" for i in range(5)]


def test_mooncake_sessions_match_a_brute_force_reading_of_the_rule():
    raw = rows(MOONCAKE)
    parents = reconstruct_sessions(
        [x["hash_ids"] for x in raw],
        [x["input_length"] for x in raw],
        [x["timestamp"] for x in raw],
    )
    assert parents == reference_parents(raw)


def test_mooncake_slice_has_its_sessions_and_every_follow_up_extends_its_parent():
    reqs = load_mooncake(MOONCAKE, closed_loop=True)
    check_sessions(reqs, 512)
    turns = Counter(Counter(r.session for r in reqs).values())
    # About an eighth of this 4-minute slice continues an earlier request (a third over the
    # hour: most conversations' next turns come minutes later).
    assert sum(not r.is_first_turn for r in reqs) == 76
    assert turns == {1: 459, 2: 56, 3: 7, 4: 2}


def test_a_shared_system_prompt_alone_does_not_make_a_follow_up():
    b = 512
    ids = [
        [0, 1, 2, 3],  # a conversation: system prompt 0, then its own blocks
        [0, 4, 5],  # another: block 0 is now shared by two sessions
        [0, 6],  # full blocks = the system prompt only
        [0, 7, 8, 9],  # extends [0, 6]'s full blocks, but those are shared: a new session
        [0, 1, 2, 3, 10],  # extends the first conversation's full blocks [0, 1, 2]
    ]
    lengths = [len(x) * b - 100 for x in ids]
    assert reconstruct_sessions(ids, lengths, range(5)) == [None, None, None, None, 0]


def test_the_longest_then_latest_earlier_turn_is_the_parent():
    b = 512
    ids = [
        [0, 1, 2],  # turn 1
        [0, 9, 8],  # another session, so that block 0 is shared
        [0, 1, 2, 3, 4],  # turn 2 of the first
        [0, 1, 2, 3, 5],  # turn 2 again (regenerated): same full blocks, later
        [0, 1, 2, 3, 5, 6, 7],  # extends both turn 2s and turn 1: the latest, longest wins
    ]
    lengths = [len(x) * b - 10 for x in ids]
    assert reconstruct_sessions(ids, lengths, range(5)) == [None, None, 0, 0, 3]
    # a request no longer than its candidate, or not later, is not its next turn
    assert reconstruct_sessions(ids[:3], [2000, 1000, 1500], range(3)) == [None, None, None]
    assert reconstruct_sessions(ids[:3], lengths[:3], [0, 0, 0]) == [None, None, None]


def test_mooncake_closed_loop_turns_wait_for_the_previous_answer_plus_the_think_time():
    open_loop = by_rid(load_mooncake(MOONCAKE))
    closed = load_mooncake(MOONCAKE, closed_loop=True)
    estimate = idle_service_time(PROFILE)
    served = by_rid(load_mooncake(MOONCAKE, closed_loop=True, service_time_s=estimate))
    for r in closed:
        o = open_loop[r.rid]
        assert (r.session, r.is_first_turn) == (o.session, o.is_first_turn)
        if r.after is None:
            assert r.arrival_s == o.arrival_s
            continue
        parent = open_loop[r.after]
        gap = o.arrival_s - parent.arrival_s
        assert r.delay_s == pytest.approx(gap)
        assert served[r.rid].delay_s == pytest.approx(max(0.0, gap - estimate(parent)))
    assert 0 < estimate(open_loop["mc0"]) < 60


def test_bad_mooncake_rows_are_rejected_with_their_line(tmp_path):
    good = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
    for bad in (
        '{"timestamp": 0}',
        '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": ["x"]}',
        "not json",
    ):
        path = tmp_path / "t.jsonl"
        path.write_text(good + bad + "\n")
        with pytest.raises(ValueError, match=r"t.jsonl:2: not a Mooncake trace row"):
            load_mooncake(path)
    with pytest.raises(ValueError, match="same length"):
        reconstruct_sessions([[1]], [1, 2], [0])


# ---- Bailian: sessions from parent_chat_id ------------------------------------------------------


def test_bailian_fixture_loads_every_row_with_its_tokens_and_arrival_times():
    raw = rows(BAILIAN)
    reqs = load_bailian(BAILIAN)
    assert len(reqs) == len(raw) == 12
    assert sum(r.prompt_tokens for r in reqs) == sum(x["input_length"] for x in raw)
    assert sum(r.output_tokens for r in reqs) == sum(x["output_length"] for x in raw)
    rid = by_rid(reqs)
    for x in raw:
        r = rid[f"bl{x['chat_id']}"]
        assert r.arrival_s == x["timestamp"] and len(r.keys) == len(x["hash_ids"])
        assert r.block_tokens == 16
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s or 0.0 for r in reqs)


def test_bailian_sessions_follow_parent_chat_id():
    reqs = load_bailian(BAILIAN, closed_loop=True)
    check_sessions(reqs, 16)
    sessions: dict[str, list[str]] = {}
    for r in reqs:
        sessions.setdefault(r.session or "", []).append(r.rid)
    assert sessions == {
        "bl101": ["bl101", "bl103", "bl106", "bl110"],
        "bl102": ["bl102", "bl105", "bl112"],  # 102 has no parent_chat_id field
        "bl104": ["bl104", "bl108"],  # 104's parent (55) is outside the trace window
        "bl107": ["bl107", "bl109"],
        "bl111": ["bl111"],
    }
    turn = {f"bl{x['chat_id']}": x["turn"] for x in rows(BAILIAN)}
    rid = by_rid(reqs)
    for r in reqs:
        if r.after is not None:
            assert turn[r.rid] == turn[r.after] + 1
            # everything but the parent's padded last block carries over
            assert r.keys[: len(rid[r.after].keys) - 1] == rid[r.after].keys[:-1]
    assert rid["bl103"].delay_s == pytest.approx(9.87 - 0.512)


def test_bailian_timestamps_in_milliseconds_when_the_file_says_so(tmp_path):
    row = {
        "chat_id": 1,
        "parent_chat_id": -1,
        "input_length": 20,
        "output_length": 2,
        "turn": 1,
        "hash_ids": [7, 8],
    }
    path = tmp_path / "ms.jsonl"
    path.write_text(json.dumps({**row, "timestamp_ms": 1500}) + "\n")
    assert load_bailian(path)[0].arrival_s == 1.5
    path.write_text(json.dumps({**row, "timestamp": 1500}) + "\n")
    assert load_bailian(path, timestamp_unit="ms")[0].arrival_s == 1.5
    assert load_bailian(path)[0].arrival_s == 1500.0
    with pytest.raises(ValueError, match="timestamp_unit"):
        load_bailian(path, timestamp_unit="h")  # type: ignore[arg-type]


def test_bad_bailian_rows_are_rejected(tmp_path):
    def row(cid: int, parent: int, ts: float, **kw: object) -> str:
        r = {
            "chat_id": cid,
            "parent_chat_id": parent,
            "timestamp": ts,
            "input_length": 20,
            "output_length": 2,
            "turn": 1,
            "hash_ids": [1, 2],
            **kw,
        }
        return json.dumps(r) + "\n"

    cases = {
        "appears twice": row(1, -1, 0) + row(1, -1, 1),
        "arrives before its parent": row(1, 2, 0) + row(2, -1, 5),
        "itself as its parent": row(1, 1, 0),
        "list of ints": row(1, -1, 0, hash_ids=[1.5]),
        "input_length": row(1, -1, 0, input_length=0),
        "KeyError": '{"chat_id": 1}\n',
    }
    for message, text in cases.items():
        path = tmp_path / "b.jsonl"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_bailian(path)


# ---- Generated agent sessions -------------------------------------------------------------------


def test_default_spec_is_in_the_ballpark_of_the_bundled_real_sessions():
    fitted, default = fit_spec(load_sessions()), AgentWorkloadSpec()
    assert fitted.sessions == 24
    assert fitted.system_prompt_tokens == default.system_prompt_tokens  # same airline policy
    for name in ("turns", "first_user_tokens", "tool_output_tokens", "output_tokens"):
        f, d = getattr(fitted, name), getattr(default, name)
        assert 0.67 < f.median / d.median < 1.5, name
        assert 0.67 < f.p90 / d.p90 < 1.5, name
    assert fitted.tool_time_s == default.tool_time_s  # tau-bench records no times


def test_same_seed_same_workload_and_another_seed_another():
    spec = AgentWorkloadSpec(sessions=5)
    assert generate(spec, 7) == generate(spec, 7)
    a, b = generate(spec, 7), generate(spec, 8)
    assert [r.keys for r in a] != [r.keys for r in b]
    assert [r.prompt_tokens for r in a] != [r.prompt_tokens for r in b]


def test_generated_turns_extend_the_previous_prompt_and_share_only_the_system_prompt():
    spec = AgentWorkloadSpec(sessions=30)
    reqs = generate(spec, 1)
    rid = by_rid(reqs)
    assert len(rid) == len(reqs)
    check_sessions(reqs, spec.block_tokens, root_names=False)
    system_blocks = spec.system_prompt_tokens // spec.block_tokens
    firsts = [r for r in reqs if r.is_first_turn]
    assert len(firsts) == 30
    for a, b in itertools.pairwise(firsts):
        assert a.keys.common_prefix(b.keys) == system_blocks
        assert b.arrival_s is not None and a.arrival_s is not None and b.arrival_s >= a.arrival_s
    for r in reqs:
        assert len(r.keys) == r.prompt_tokens // spec.block_tokens  # whole blocks only
        if r.after is not None:
            parent = rid[r.after]
            assert r.keys.common_prefix(parent.keys) == len(parent.keys)
            assert r.prompt_tokens > parent.prompt_tokens + parent.output_tokens
            assert spec.tool_time_s.lo <= r.delay_s <= spec.tool_time_s.hi


def test_generated_workload_has_the_spec_statistics():
    spec = AgentWorkloadSpec(sessions=400)
    reqs = generate(spec, 3)
    turns = list(Counter(r.session for r in reqs).values())
    assert abs(statistics.median(turns) - spec.turns.median) <= 1
    assert min(turns) >= spec.turns.lo and max(turns) <= spec.turns.hi
    outputs = [r.output_tokens for r in reqs]
    assert 0.85 < statistics.median(outputs) / spec.output_tokens.median < 1.15
    delays = [r.delay_s for r in reqs if r.after is not None]
    assert 0.85 < statistics.median(delays) / spec.tool_time_s.median < 1.15
    starts = sorted(r.arrival_s for r in reqs if r.arrival_s is not None)
    mean_gap = (starts[-1] - starts[0]) / (len(starts) - 1)
    assert 0.8 < mean_gap / spec.session_gap_s < 1.2


def test_a_generated_workload_replays_with_follow_ups_hitting_the_cache():
    reqs = generate(AgentWorkloadSpec(sessions=6), 0)
    res = simulate(reqs, least_loaded, PROFILE, workers=2)
    assert len(res.requests) == len(reqs) and not [r for r in res.requests if r.error]
    follow = {r.rid for r in reqs if not r.is_first_turn}
    cached = sum(
        r.local_cached_tokens + r.global_cached_tokens for r in res.requests if r.rid in follow
    )
    assert cached > 0.5 * sum(r.prompt_tokens for r in res.requests if r.rid in follow)


def test_bad_specs_are_rejected():
    with pytest.raises(ValueError):
        AgentWorkloadSpec(sessions=0)
    with pytest.raises(ValueError):
        AgentWorkloadSpec(system_prompt_tokens=-1)
    with pytest.raises(ValueError):
        LogNormal(10, 5)
    with pytest.raises(ValueError):
        LogNormal.fit([])
    with pytest.raises(ValueError):
        fit_spec(load_sessions(limit=1))


# ---- CLI ----------------------------------------------------------------------------------------


def test_cli_sweeps_bailian_generated_and_closed_loop_mooncake(capsys):
    base = ["sweep", "--policies", "least_load", "--workers", "2"]
    assert main([*base, "--trace", "bailian", "--path", str(BAILIAN), "--closed-loop"]) == 0
    assert main([*base, "--trace", "generated", "--sessions", "3", "--seed", "1"]) == 0
    assert (
        main(
            [
                *base,
                "--trace",
                "mooncake",
                "--path",
                str(MOONCAKE),
                "--limit",
                "40",
                "--closed-loop",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "12 requests (bailian)" in out and "40 requests (mooncake)" in out
    for bad in (
        ["--trace", "bailian"],
        ["--trace", "agents", "--closed-loop"],
        ["--trace", "mooncake", "--path", str(MOONCAKE), "--sessions", "3"],
        ["--trace", "generated", "--limit", "3"],
        ["--trace", "bailian", "--path", str(MOONCAKE)],
    ):
        with pytest.raises(SystemExit) as e:
            main([*base, *bad])
        assert e.value.code == 2
