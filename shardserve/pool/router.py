"""`shardserve pool`: one OpenAI endpoint in front of several models sharing the devices.

Requests are routed by their `model` to that model's own server (a `shardserve serve` process),
which the pool wakes first if it sleeps (see pool/manager.py). Streams are passed through as they
come; a request holds its model until its response has ended. With the config's `api_key`, every path
but /health needs `Authorization: Bearer <api_key>`, checked as `shardserve serve` checks its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Awaitable, Callable

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from shardserve.version import __version__
from shardserve.entrypoints.openai.errors import InvalidRequestError, NotFoundError, install_error_handlers
from shardserve.entrypoints.openai.middleware import require_api_key
from shardserve.pool.config import PoolConfig
from shardserve.pool.manager import Pool

logger = logging.getLogger(__name__)

TTL_CHECK_S = 1.0
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


def build_pool_app(pool: Pool) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.start()
        expiry = asyncio.create_task(_expire_forever(pool))
        try:
            yield
        finally:
            expiry.cancel()
            await pool.close()

    app = FastAPI(title="shardserve pool", version=__version__, lifespan=lifespan)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        dead = [b.name for b in pool.backends.values() if not b.alive()]
        if dead:
            return JSONResponse({"status": "unhealthy", "dead": dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": b.name, "object": "model", "created": created, "owned_by": "shardserve", "root": b.spec.model,
             "state": "awake" if b.awake else "asleep", "in_flight": b.in_flight, "wakes": b.swaps}
            for b in pool.backends.values()]}

    async def route(request: Request) -> Response:
        body = await request.body()
        try:
            name = json.loads(body).get("model")
        except (ValueError, AttributeError):
            raise InvalidRequestError("the request body is not a JSON object") from None
        known = ", ".join(pool.backends)
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"The request names no model: set 'model' to one of this pool's ({known}).",
                                      param="model")
        if name not in pool.backends:
            raise NotFoundError(f"The model {name!r} is not in this pool (models: {known}).", param="model",
                                code="model_not_found")
        backend = await pool.acquire(name)
        try:
            # Only the body goes on: the client's headers (its API key among them) stay here, and
            # pool.client adds the member key (pool/manager.py).
            upstream = pool.client.build_request(request.method, backend.url + request.url.path, content=body,
                                                 headers={"content-type": "application/json"})
            response = await pool.client.send(upstream, stream=True)
        except BaseException:
            await pool.release(backend)
            raise

        return relayed(response, lambda: pool.release(backend))

    for path in ROUTED_PATHS:
        app.add_api_route(path, route, methods=["POST"])
    require_api_key(app, pool.config.api_key)
    return app


def relayed(upstream: httpx.Response, on_end: Callable[[], Awaitable[None] | None]) -> StreamingResponse:
    """A member server's streamed response passed on as it comes (its status, content type and cache control),
    `on_end()` called (and awaited where it is a coroutine) once it has ended, however it ends."""

    async def relay():
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            ended = on_end()
            if ended is not None:
                await ended

    headers = {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "cache-control")}
    return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers)


async def _expire_forever(pool: Pool) -> None:
    while True:
        await asyncio.sleep(TTL_CHECK_S)
        try:
            await pool.expire_idle()
        except Exception:  # noqa: BLE001 - a failed sleep is logged; the pool goes on
            logger.exception("putting idle models to sleep failed")


def run_pool(config: PoolConfig, host: str, port: int, device: str | None) -> None:
    uvicorn.run(build_pool_app(Pool(config, device)), host=host, port=port, log_level="info")
