"""The servers users run, as processes: ``smetric emulate`` and the router stop in order on SIGINT
or SIGTERM, also when started with SIGINT ignored (as a shell's background job is); the router
raises a low open-files limit."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ready(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def start(*args: str, open_files: int | None = None) -> subprocess.Popen[bytes]:
    """``python -m args`` with SIGINT ignored from the start (set, then kept across exec), and
    with ``open_files`` as its soft limit on open files, if given."""
    ignore_then_exec = (
        "import os, resource, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        + (
            ""
            if open_files is None
            else f"resource.setrlimit(resource.RLIMIT_NOFILE, "
            f"({open_files}, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
        )
        + "os.execv(sys.executable, [sys.executable, '-m', *sys.argv[1:]])"
    )
    return subprocess.Popen(
        [sys.executable, "-c", ignore_then_exec, *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stops(proc: subprocess.Popen[bytes], sig: signal.Signals) -> int | None:
    """The exit status within 10 s of ``sig``, or None (then killed)."""
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


@contextlib.contextmanager
def emulator_and_router(
    open_files: int | None = None,
) -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], str]]:
    """``smetric emulate`` (one worker, real time) and a router in front of it, both started with
    SIGINT ignored (the router with ``open_files`` as its limit, if given); whatever is still
    running at the end is killed."""
    worker_port, router_port = free_port(), free_port()
    emulator = start("smetric", "emulate", "--workers", "1", "--base-port", str(worker_port))
    worker = f"http://127.0.0.1:{worker_port}"
    router = None
    try:
        ready(worker)
        router = start(
            "smetric.launch_router",
            "--worker-urls",
            worker,
            "--port",
            str(router_port),
            open_files=open_files,
        )
        base = f"http://127.0.0.1:{router_port}"
        ready(base)
        yield emulator, router, base
    finally:
        for p in (router, emulator):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_the_router_and_the_emulator_stop_on_sigterm_and_sigint():
    with emulator_and_router() as (emulator, router, _):
        router_status = stops(router, signal.SIGTERM)
        emulator_status = stops(emulator, signal.SIGINT)  # ignored at start: still heard
    assert (router_status, emulator_status) == (0, 0)


def test_on_sigterm_the_router_lets_a_stream_in_progress_finish_and_refuses_new_ones():
    # 400 tokens out take the emulated worker (real time) about 2.4 s.
    body = b'{"text": "hello", "stream": true, "sampling_params": {"max_new_tokens": 400}}'
    with emulator_and_router() as (_, router, base):
        request = urllib.request.Request(
            base + "/generate", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as stream:
            first = stream.readline()
            router.send_signal(signal.SIGTERM)  # mid-stream
            time.sleep(0.3)
            try:  # the router no longer accepts
                urllib.request.urlopen(base + "/health", timeout=2)
                refused = False
            except OSError:
                refused = True
            rest = [line.strip() for line in stream if line.strip()]
        status = router.wait(timeout=30)
    assert first.startswith(b"data: {")
    assert rest[-1:] == [b"data: [DONE]"] and len(rest) >= 399  # every token, then the end
    assert refused and status == 0


def test_the_shutdown_grace_is_a_flag(capsys):
    from smetric.router import parse_config

    assert parse_config(["--worker-urls", "http://w:1"]).shutdown_grace_secs == 25.0
    assert parse_config(["--shutdown-grace-secs", "3"]).shutdown_grace_secs == 3.0
    with pytest.raises(SystemExit):
        parse_config(["--shutdown-grace-secs", "-1"])
    assert "--shutdown-grace-secs" in capsys.readouterr().err


def soft_open_files(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-files line in /proc/PID/limits")


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc/PID/limits")
def test_the_router_raises_a_low_open_files_limit():
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
    if want <= 256:
        pytest.skip("the hard limit leaves nothing to raise")
    with emulator_and_router(open_files=256) as (_, router, _base):
        assert soft_open_files(router.pid) == want


def test_the_open_files_limit_is_raised_within_the_hard_limit_and_never_lowered():
    # In a process of its own: limits are the whole process's.
    code = """
import resource
from smetric.router.app import raise_open_files_limit
resource.setrlimit(resource.RLIMIT_NOFILE, (200, 300))
print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))
print(raise_open_files_limit(250))
resource.setrlimit(resource.RLIMIT_NOFILE, (200, 300))
real = resource.setrlimit
def capped(kind, limits):  # as macOS refuses values above its own cap
    if limits[0] > 160:
        raise ValueError("not allowed")
    real(kind, limits)
resource.setrlimit = capped
resource.setrlimit(resource.RLIMIT_NOFILE, (100, 300))
print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split("\n")
    # Raised to the hard limit, not past it; never lowered; where the system refuses the hard
    # limit (300), to the highest half of it that it accepts (150).
    assert out[:3] == ["(200, 300) (300, 300)", "(300, 300)", "(100, 150) (150, 300)"]
