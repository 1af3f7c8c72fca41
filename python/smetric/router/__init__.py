"""The smetric router: a drop-in for sglang-router."""

from smetric.router.app import Router, serve
from smetric.router.config import RouterConfig, build_parser, parse_config

__all__ = ["Router", "RouterConfig", "build_parser", "parse_config", "serve"]
