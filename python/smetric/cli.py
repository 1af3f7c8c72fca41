"""The ``smetric`` command line."""

from __future__ import annotations

import argparse
import sys

from smetric import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="smetric", description="Session-aware router for LLM clusters serving agents."
    )
    parser.add_argument("--version", action="version", version=f"smetric {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="replay bundled real agent sessions through the index")
    demo.add_argument("--instances", type=int, default=4)
    demo.add_argument("--capacity-blocks", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from smetric.demo import main as demo_main

        if args.instances < 1 or args.capacity_blocks < 0:
            parser.error("--instances must be >= 1 and --capacity-blocks >= 0")
        return demo_main(args.instances, args.capacity_blocks)
    return 2


if __name__ == "__main__":
    sys.exit(main())
