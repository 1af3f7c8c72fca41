"""Workloads: loaders for real traces and agent sessions."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def text_lines(path: str | Path) -> Iterator[str]:
    """The lines of a text file, gunzipped when its name ends in ``.gz``."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        yield from f


def read_jsonl(
    source: str | Path,
    parse: Callable[[Any], T],
    what: str,
    limit: int | None = None,
    lines: Iterable[str] | None = None,
) -> list[T]:
    """``parse`` of each non-blank line's JSON, the first ``limit`` of them. A line that is not
    JSON or that ``parse`` rejects (``KeyError``, ``TypeError``, ``ValueError``) is a
    ``ValueError`` naming ``source``, the line and ``what`` it should have been."""
    out: list[T] = []
    for lineno, line in enumerate(text_lines(source) if lines is None else lines, 1):
        if not line.strip():
            continue
        try:
            out.append(parse(json.loads(line)))
        except KeyError as e:
            raise ValueError(f"{source}:{lineno}: not {what} (no {e} field: {e!r})") from e
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}:{lineno}: not {what} ({e!r})") from e
        if limit is not None and len(out) >= limit:
            break
    return out
