"""What the router keeps between requests to decide fast: each worker's last view, and the set of
workers in rotation. Kept state must never be stale: these tests change what it was built from
and ask again."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest

from smetric import DataPlane, launch_router
from smetric.cluster import WorkerView
from smetric.request import view_request
from smetric.router import Router, RouterConfig
from smetric.router import app as app_module
from smetric.router.workers import Worker

URLS = [f"http://10.0.0.{i}:30000" for i in range(4)]


def fresh_view(w: Worker, hit: int) -> WorkerView:
    return WorkerView(
        w.url,
        max(w.in_flight, w.polled_running + w.polled_waiting),
        w.queued_prefill_tokens,
        w.running_decode_tokens,
        w.polled_running,
        w.polled_waiting,
        w.token_usage,
        hit,
    )


def router(**config: Any) -> Router:
    r = Router(RouterConfig(**config))
    for url in URLS:
        r._admit(Worker(url))
    return r


@pytest.mark.parametrize(
    "field,value",
    [
        ("in_flight", 3),
        ("queued_prefill_tokens", 100),
        ("running_decode_tokens", 200),
        ("polled_running", 5),
        ("polled_waiting", 7),
        ("token_usage", 0.5),
    ],
)
def test_a_worker_view_follows_every_change_of_load(field, value):
    w = Worker(URLS[0])
    assert w.view(4) == fresh_view(w, 4)
    setattr(w, field, value)
    assert w.view(4) == fresh_view(w, 4)
    assert w.view(9) == fresh_view(w, 9)


def test_an_unchanged_worker_hands_out_the_same_view():
    w = Worker(URLS[0])
    w.in_flight += 1
    assert w.view(4) is w.view(4)
    assert w.view(5).local_hit_blocks == 5 and w.view(5).in_flight == 1


def test_rotation_drops_an_unhealthy_removed_or_tripped_worker_at_once():
    r = router()
    assert [w.url for w in r._eligible("regular", set())] == URLS
    r.workers[URLS[1]].healthy = False
    assert [w.url for w in r._eligible("regular", set())] == [URLS[0], *URLS[2:]]
    r.workers[URLS[1]].healthy = True
    r.workers[URLS[2]].opened_at = app_module.time.monotonic()
    assert [w.url for w in r._eligible("regular", set())] == [*URLS[:2], URLS[3]]
    r.unregister(URLS[0])
    assert [w.url for w in r._eligible("regular", set())] == [URLS[1], URLS[3]]
    assert [w.url for w in r._eligible("regular", {URLS[1]})] == [URLS[3]]


def test_an_open_circuit_half_opens_when_its_timeout_passes(monkeypatch):
    r = router(cb_timeout_duration_secs=30.0)
    now = [1000.0]
    monkeypatch.setattr(app_module.time, "monotonic", lambda: now[0])
    r.workers[URLS[0]].opened_at = 1000.0
    assert URLS[0] not in [w.url for w in r._eligible("regular", set())]
    now[0] = 1029.0
    assert URLS[0] not in [w.url for w in r._eligible("regular", set())]
    now[0] = 1030.0  # nothing changed but the clock
    assert URLS[0] in [w.url for w in r._eligible("regular", set())]


def test_snapshot_pairs_each_worker_with_its_own_hit_as_workers_come_and_go():
    r = router()
    keys = view_request("generate", {"text": "x" * 640}).key.keys
    r.index.insert(URLS[2], keys[:7])
    r.index.insert(URLS[3], keys[:3])
    r.unregister(URLS[0])
    r._admit(Worker(URLS[0]))
    r.index.insert(URLS[0], keys[:1])
    view = view_request("generate", {"text": "x" * 640})
    cluster = r._snapshot(view, r._eligible("regular", set()))
    assert {w.url: w.local_hit_blocks for w in cluster.workers} == {
        URLS[0]: 1,
        URLS[1]: 0,
        URLS[2]: 7,
        URLS[3]: 3,
    }


# ---- the Rust data plane's own guards ----------------------------------------------------------


def test_the_data_plane_refuses_bad_settings_and_a_taken_port(capsys):
    with pytest.raises(ValueError, match="threads"):
        DataPlane(object(), "http://127.0.0.1:1", 1024, 1.0, 1.0, 0)
    with pytest.raises(ValueError, match="read_timeout_s"):
        DataPlane(object(), "http://127.0.0.1:1", 1024, 0.0, 1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        plane = DataPlane(object(), "http://127.0.0.1:1", 1024, 1.0, 1.0)
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            plane.start("127.0.0.1", port)
        assert plane.port is None
        # The command line says so in one line, and exits 1.
        argv = ["--worker-urls", "http://127.0.0.1:1", "--port", str(port)]
        argv += ["--disable-health-check", "--worker-startup-timeout-secs", "0"]
        assert launch_router.main(argv) == 1
        assert f"cannot serve on 127.0.0.1:{port}" in capsys.readouterr().err


def test_the_data_plane_answers_a_router_failure_with_a_500_in_valid_json(capsys):
    class Failing:
        def dp_begin(self, *args: Any) -> None:
            raise RuntimeError('a "quoted" word,\na newline, an \x1b escape and a \\ backslash')

    plane = DataPlane(Failing(), "http://127.0.0.1:1", 1024, 5.0, 1.0)
    port = plane.start("127.0.0.1", 0)
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/generate", data=b'{"text": "hi"}', method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=5)
        body = json.loads(e.value.read())
    finally:
        plane.stop()
    assert e.value.code == 500 and body["error"]["code"] == 500
    assert body["error"]["message"] == (
        'router error: RuntimeError: a "quoted" word,\na newline, an \x1b escape and a \\ backslash'
    )
    assert "RuntimeError" in capsys.readouterr().err  # the traceback, for the operator
