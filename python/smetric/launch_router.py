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
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
