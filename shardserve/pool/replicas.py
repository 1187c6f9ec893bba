"""`shardserve serve --data-parallel-size D`: D replicas of one model behind one endpoint.

Each replica is a whole `shardserve serve` (its own ranks, -tp T of them, its own KV and prefix cache) on a loopback
port, started with this command's own flags; on GPUs replica i takes the visible devices [i*T, (i+1)*T). This
process only routes: completions and chat completions go to the replica pool/replica_routing.py chooses, passed
through as they come (streams included). Replicas take only the member key (pool/manager.py says why), so the
endpoint's own API key is checked here.

Failures: a request that cannot reach its replica (refused, reset before any answer) or that the replica answers
503 (restarting, shutting down) goes to another live replica; one cut off mid-response ends with an error, as it
would from a single server. A replica whose process exits is no longer chosen and is started again (up to
MAX_REPLICA_RESTARTS times); the others keep serving. /health is 200 while any replica serves ("degraded" when
some do not), 503 when none does. /metrics gives each replica's samples with a `replica` label and their sums
under replica="all" (for gauges too: a fraction such as kv_cache_usage_perc sums to D x its mean). /sleep and
/wake_up apply to every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import sys
import time
from collections import defaultdict

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from shardserve.version import __version__
from shardserve.entrypoints.openai.errors import InvalidRequestError, ServiceUnavailableError, install_error_handlers
from shardserve.entrypoints.openai.middleware import require_api_key
from shardserve.pool.manager import ServerProcess
from shardserve.pool.replica_routing import ReplicaRouter, prefix_hashes, prompt_text, request_cost
from shardserve.pool.router import relayed

logger = logging.getLogger(__name__)

MAX_REPLICA_RESTARTS = 3  # each replica's; then it stays down and the others serve
WATCH_INTERVAL_S = 0.5
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
# Flags of this command that its replicas must not inherit (the router's own), with whether they take a value.
ROUTER_ONLY_FLAGS = {"--api-key": True}


class Replica(ServerProcess):
    """Replica `index`: `shardserve serve` with the router's flags, then its own port, name and devices."""

    def __init__(self, index: int, argv: list[str], served_name: str, member_key: str, gpus: list[str] | None,
                 cpu_threads: int | None) -> None:
        super().__init__(f"replica {index}", member_key)
        self.index = index
        self.argv = argv
        self.served_name = served_name
        self.gpus = gpus
        self.cpu_threads = cpu_threads
        self.ready = False
        self.restarts = 0

    def command(self) -> list[str]:
        # The replica's values come last: argparse keeps the last of a flag given twice, over a recipe's too.
        return [sys.executable, "-m", "shardserve", "serve", *self.argv, "--data-parallel-size", "1",
                "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", self.served_name]

    def environment(self) -> dict[str, str]:
        env = super().environment()
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        if self.cpu_threads is not None and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(self.cpu_threads)  # the replicas' ranks share this machine's cores
        return env


def replica_argv(argv: list[str]) -> list[str]:
    """`argv` (serve's own arguments) without the flags only the router keeps (the API key), in either form."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in ROUTER_ONLY_FLAGS:
            skip = ROUTER_ONLY_FLAGS[flag] and "=" not in arg
            continue
        out.append(arg)
    return out


def replica_devices(count: int, tensor_parallel_size: int, device: str) -> list[list[str] | None]:
    """Each replica's CUDA devices (of those visible, tensor_parallel_size each), or None on CPUs; ValueError
    naming the flags when there are too few."""
    if device != "cuda":
        return [None] * count
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d for d in visible.split(",") if d.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    wanted = count * tensor_parallel_size
    if wanted > len(ids):
        raise ValueError(f"--data-parallel-size {count} x --tensor-parallel-size {tensor_parallel_size} needs "
                         f"{wanted} GPUs; {len(ids)} are visible")
    return [ids[i * tensor_parallel_size:(i + 1) * tensor_parallel_size] for i in range(count)]


class ReplicaSet:
    """The replicas, their router, and the client that reaches them."""

    def __init__(self, argv: list[str], served_name: str, count: int, tensor_parallel_size: int, device: str,
                 policy: str) -> None:
        member_key = secrets.token_urlsafe(32)
        devices = replica_devices(count, tensor_parallel_size, device)
        threads = None if device == "cuda" else max(1, (os.cpu_count() or 1) // (count * tensor_parallel_size))
        self.replicas = [Replica(i, replica_argv(argv), served_name, member_key, devices[i], threads)
                         for i in range(count)]
        self.router = ReplicaRouter(count, policy)
        self.client = httpx.AsyncClient(timeout=None, headers={"Authorization": f"Bearer {member_key}"})
        self._restarting: set[int] = set()

    def live(self) -> list[int]:
        return [r.index for r in self.replicas if r.ready and r.alive()]

    async def start(self) -> None:
        """All replicas load at once; RuntimeError (the others stopped) if one fails to start."""
        for r in self.replicas:
            r.start()
        try:
            await asyncio.gather(*(r.wait_ready(self.client) for r in self.replicas))
        except BaseException:
            self.stop()
            raise
        for r in self.replicas:
            r.ready = True
        logger.info("%d replicas ready (%s routing)", len(self.replicas), self.router.policy)

    async def watch_forever(self) -> None:
        """Restart replicas whose process exits (up to MAX_REPLICA_RESTARTS each); the others serve meanwhile."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for r in self.replicas:
                if r.ready and not r.alive():
                    r.ready = False
                    self.router.forget(r.index)
                    logger.error("replica %d (pid %d) exited with code %s; %d of %d replicas serve", r.index,
                                 r.process.pid, r.process.returncode, len(self.live()), len(self.replicas))
                    if r.restarts < MAX_REPLICA_RESTARTS and r.index not in self._restarting:
                        self._restarting.add(r.index)
                        asyncio.create_task(self._restart(r))

    async def _restart(self, r: Replica) -> None:
        r.restarts += 1
        started = time.monotonic()
        try:
            r.start()
            await r.wait_ready(self.client)
            r.ready = True
            logger.info("replica %d serves again after a restart (%d of %d) in %.1f s", r.index, r.restarts,
                        MAX_REPLICA_RESTARTS, time.monotonic() - started)
        except Exception as e:  # noqa: BLE001 - it stays down; the others serve
            logger.error("replica %d did not restart: %s", r.index, e)
            r.stop()
        finally:
            self._restarting.discard(r.index)

    def stop(self) -> None:
        for r in self.replicas:
            if r.alive():
                r.process.terminate()
        for r in self.replicas:
            r.stop()

    async def each(self, method: str, path: str, **kwargs) -> list[tuple[int, httpx.Response | Exception]]:
        """`method path` on every live replica at once: (index, response or the error that reached none)."""
        live = self.live()

        async def one(i: int):
            try:
                return i, await self.client.request(method, self.replicas[i].url + path, **kwargs)
            except httpx.HTTPError as e:
                return i, e

        return list(await asyncio.gather(*(one(i) for i in live)))


def merged_metrics(texts: dict[int, str]) -> str:
    """Prometheus text of every replica's samples with a `replica` label, and their sums as replica="all"."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str]] = {}
    samples: dict[str, list[str]] = defaultdict(list)
    sums: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
    for index, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, (family.documentation, family.type))
            for s in family.samples:
                labels = dict(s.labels)
                samples[family.name].append(_sample_line(s.name, {**labels, "replica": str(index)}, s.value))
                if not s.name.endswith("_created"):  # a time, not a count
                    sums[family.name][(s.name, tuple(sorted(labels.items())))] += s.value
    lines = []
    for name, (doc, kind) in families.items():
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *samples[name]]
        lines += [_sample_line(sample, {**dict(labels), "replica": "all"}, value)
                  for (sample, labels), value in sums[name].items()]
    return "\n".join(lines) + "\n"


def _sample_line(name: str, labels: dict[str, str], value: float) -> str:
    def escaped(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    text = "+Inf" if value == math.inf else "-Inf" if value == -math.inf else "NaN" if value != value else repr(value)
    return name + "{" + ",".join(f'{k}="{escaped(str(v))}"' for k, v in labels.items()) + "} " + text


def build_replicas_app(replicas: ReplicaSet, api_key: str | None) -> FastAPI:
    router = replicas.router

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await replicas.start()
        watcher = asyncio.create_task(replicas.watch_forever())
        try:
            yield
        finally:
            watcher.cancel()
            replicas.stop()
            await replicas.client.aclose()

    app = FastAPI(title="shardserve", version=__version__, lifespan=lifespan)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        live = replicas.live()
        status = "ok" if len(live) == len(replicas.replicas) else "degraded" if live else "unhealthy"
        body = {"status": status, "replicas": [
            {"replica": r.index, "serving": r.index in live, "pid": r.process.pid if r.process else None,
             "restarts": r.restarts,
             "outstanding_tokens": router.outstanding[r.index], "requests": router.routed[r.index]}
            for r in replicas.replicas]}
        return JSONResponse(body, status_code=200 if live else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        texts = {i: r.text for i, r in await replicas.each("GET", "/metrics")
                 if isinstance(r, httpx.Response) and r.status_code == 200}
        return PlainTextResponse(merged_metrics(texts))

    async def on_every_replica(request: Request) -> Response:
        answers = await replicas.each(request.method, request.url.path, params=dict(request.query_params))
        failed = [(i, r) for i, r in answers if not isinstance(r, httpx.Response) or r.status_code >= 400]
        if not answers:
            raise ServiceUnavailableError("no replica is serving")
        if failed:
            i, r = failed[0]
            detail = r.text if isinstance(r, httpx.Response) else f"{type(r).__name__}: {r}"
            return JSONResponse({"error": {"message": f"replica {i}: {detail}", "type": "server_error"}},
                                status_code=r.status_code if isinstance(r, httpx.Response) else 503)
        return JSONResponse({"replicas": [{"replica": i, **_json_or_text(r)} for i, r in answers]})

    for path in ("/sleep", "/wake_up"):
        app.add_api_route(path, on_every_replica, methods=["POST"])

    async def from_any_replica(request: Request) -> Response:
        for i in replicas.live():
            try:
                r = await replicas.client.request(request.method, replicas.replicas[i].url + request.url.path,
                                                  content=await request.body(),
                                                  headers={"content-type": "application/json"})
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        raise ServiceUnavailableError("no replica is serving")

    for path in ("/v1/models", "/v1/models/{model_id:path}", "/version", "/is_sleeping"):
        app.add_api_route(path, from_any_replica, methods=["GET"])
    for path in ("/tokenize", "/detokenize"):
        app.add_api_route(path, from_any_replica, methods=["POST"])

    async def route(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body is not a JSON object")
        text = prompt_text(body)
        hashes, cost = prefix_hashes(text), request_cost(body, text)
        tried: set[int] = set()
        while True:
            live = [i for i in replicas.live() if i not in tried]
            if not live:
                raise ServiceUnavailableError(f"no replica could take the request ({len(tried)} tried, "
                                              f"{len(replicas.live())} of {len(replicas.replicas)} serving)")
            i = router.choose(hashes, live)
            router.sent(i, hashes, cost)
            upstream = replicas.client.build_request("POST", replicas.replicas[i].url + request.url.path,
                                                     content=raw, headers={"content-type": "application/json"})
            try:
                response = await replicas.client.send(upstream, stream=True)
            except httpx.TransportError as e:
                router.finished(i, cost)
                tried.add(i)
                logger.warning("replica %d did not take a request (%s: %s); trying another", i, type(e).__name__, e)
                continue
            if response.status_code == 503 and len(live) > 1:
                await response.aclose()
                router.finished(i, cost)
                tried.add(i)
                continue
            break

        return relayed(response, lambda: router.finished(i, cost))

    for path in ROUTED_PATHS:
        app.add_api_route(path, route, methods=["POST"])
    require_api_key(app, api_key)
    return app


def _json_or_text(r: httpx.Response) -> dict:
    try:
        return {"status": r.status_code, "body": r.json()}
    except ValueError:
        return {"status": r.status_code, "body": r.text}


def serve_replicas(args, argv: list[str]) -> int:
    """Run the replicas of `shardserve serve` (its parsed `args` and raw `argv`) behind this process's endpoint."""
    import torch

    from shardserve.entrypoints.openai.middleware import api_key_in_force

    for flag, value in (("--nnodes", args.nnodes > 1), ("--master-addr", args.master_addr)):
        if value:
            raise SystemExit(f"shardserve serve: --data-parallel-size runs its replicas on this machine; "
                             f"{flag} is not supported with it")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        replicas = ReplicaSet(argv, args.served_model_name or args.model, args.data_parallel_size,
                              args.tensor_parallel_size, device, args.data_parallel_routing)
    except ValueError as e:
        raise SystemExit(f"shardserve serve: {e}") from None
    app = build_replicas_app(replicas, api_key_in_force(args.api_key))
    logger.info("serving %s on http://%s:%d: %d replicas of tensor parallel size %d (%s)", args.model, args.host,
                args.port, args.data_parallel_size, args.tensor_parallel_size, device)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
