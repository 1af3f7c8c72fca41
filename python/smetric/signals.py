"""Stopping a long-running server (the router, the emulated cluster) on a signal."""

from __future__ import annotations

import asyncio
import contextlib
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Ctrl-C, and what process managers (systemd, Docker, Kubernetes) send to stop a process."""


async def until_stopped() -> None:
    """Returns once the process is asked to stop by one of ``STOP_SIGNALS``, so that the caller
    shuts down in order. It listens even where the process was started with SIGINT ignored, as
    a shell's background job is (Python then leaves Ctrl-C ignored). Outside the main thread,
    where no signal can be listened for, it waits until cancelled."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    listening = []
    for sig in STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            listening.append(sig)
    try:
        await stop.wait()
    finally:
        for sig in listening:
            loop.remove_signal_handler(sig)
