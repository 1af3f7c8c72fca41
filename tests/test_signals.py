"""Stopping the servers users run: ``smetric emulate`` and the router stop in order on SIGINT or
SIGTERM, also when started with SIGINT ignored (as a shell's background job is)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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


def start(*args: str) -> subprocess.Popen[bytes]:
    """``python -m args`` with SIGINT ignored from the start (set, then kept across exec)."""
    ignore_then_exec = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "os.execv(sys.executable, [sys.executable, '-m', *sys.argv[1:]])"
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


def test_the_router_and_the_emulator_stop_on_sigterm_and_sigint():
    worker_port, router_port = free_port(), free_port()
    emulator = start("smetric", "emulate", "--workers", "1", "--base-port", str(worker_port))
    worker = f"http://127.0.0.1:{worker_port}"
    router = None
    try:
        ready(worker)
        router = start("smetric.launch_router", "--worker-urls", worker, "--port", str(router_port))
        ready(f"http://127.0.0.1:{router_port}")
        router_status = stops(router, signal.SIGTERM)
        emulator_status = stops(emulator, signal.SIGINT)  # ignored at start: still heard
    finally:
        for p in (router, emulator):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert (router_status, emulator_status) == (0, 0)
