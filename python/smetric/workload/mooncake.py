"""Mooncake FAST'25 traces: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``.

Each hash id names one 512-token block and ids are chained (equal ids mean equal prefixes), so
they key the index as they are. The last block of a prompt is usually partial.
"""

from __future__ import annotations

import json
from pathlib import Path

from smetric import BlockKeys
from smetric.sim import SimRequest

MOONCAKE_BLOCK_TOKENS = 512


def load_mooncake(path: str | Path, limit: int | None = None) -> list[SimRequest]:
    requests = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                hash_ids = row["hash_ids"]
                try:
                    keys = BlockKeys.from_ids(hash_ids, chained=True)
                except ValueError:  # a repeated id: chain them so keys stay prefix-unique
                    keys = BlockKeys.from_ids(hash_ids)
                requests.append(
                    SimRequest(
                        rid=f"mc{lineno - 1}",
                        prompt_tokens=int(row["input_length"]),
                        output_tokens=int(row["output_length"]),
                        keys=keys,
                        block_tokens=MOONCAKE_BLOCK_TOKENS,
                        arrival_s=float(row["timestamp"]) / 1000.0,
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace row ({e!r})") from e
            if limit is not None and len(requests) >= limit:
                break
    return requests
