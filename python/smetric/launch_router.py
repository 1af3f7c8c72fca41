"""``python -m smetric.launch_router ...``: sglang_router.launch_router's command line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

from smetric.router import parse_config, serve


def main(argv: list[str] | None = None, prog: str = "python -m smetric.launch_router") -> int:
    config = parse_config(argv, prog)
    level = {"warn": "WARNING"}.get(config.log_level, config.log_level.upper())
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr
    )
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(config))
    except OSError as e:  # the port is taken, or the host is not this machine's
        print(f"{prog}: error: cannot serve on {config.host}:{config.port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
