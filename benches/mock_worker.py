"""A fast mock SGLang worker for router overhead benchmarks: answers at once, streams 4 chunks.

python benches/mock_worker.py --port 31001
"""

from __future__ import annotations

import argparse
import json

from aiohttp import web

ANSWER = json.dumps(
    {
        "text": "ok",
        "output_ids": [1],
        "meta_info": {
            "id": "x",
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": 1,
            "completion_tokens": 1,
            "cached_tokens": 0,
            "e2e_latency": 0.0,
        },
    }
).encode()
CHUNK = (
    b"data: "
    + json.dumps(
        {
            "text": "ok",
            "output_ids": [1],
            "meta_info": {"id": "x", "finish_reason": None},
        }
    ).encode()
    + b"\n\n"
)
INFO = json.dumps(
    {
        "model_path": "mock",
        "tokenizer_path": "mock",
        "max_total_num_tokens": 1_000_000,
        "page_size": 16,
        "version": "0.5.9",
        "is_generation": True,
    }
).encode()
LOADS = json.dumps(
    {
        "timestamp": "",
        "version": "0.5.9",
        "loads": [
            {
                "num_running_reqs": 0,
                "num_waiting_reqs": 0,
                "num_used_tokens": 0,
                "max_total_num_tokens": 1_000_000,
                "token_usage": 0.0,
                "cache_hit_rate": 0.0,
            }
        ],
    }
).encode()


async def generate(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    if b'"stream": true' in body or b'"stream":true' in body:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(4):
            await resp.write(CHUNK)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    return web.Response(body=ANSWER, content_type="application/json")


def json_route(payload: bytes):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=payload, content_type="application/json")

    return handler


def app() -> web.Application:
    a = web.Application(client_max_size=1 << 30)
    for path in ("/generate", "/v1/chat/completions", "/v1/completions"):
        a.router.add_post(path, generate)
    for path in ("/health", "/health_generate"):
        a.router.add_get(path, json_route(b"{}"))
    for path in (
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
        "/v1/models",
    ):
        a.router.add_get(path, json_route(INFO))
    a.router.add_get("/v1/loads", json_route(LOADS))
    a.router.add_get(
        "/get_load", json_route(b'[{"num_reqs":0,"num_waiting_reqs":0,"num_tokens":0}]')
    )
    return a


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    web.run_app(app(), host="127.0.0.1", port=ap.parse_args().port, access_log=None, print=None)
