"""The smetric router: a drop-in for sglang-router."""

from smetric.router.app import Listening, Router, listen, serve
from smetric.router.config import RouterConfig, build_parser, parse_config

__all__ = ["Listening", "Router", "RouterConfig", "build_parser", "listen", "parse_config", "serve"]
