"""Disconnects: clients that hang up at random points of their streams, while other clients' requests run.

Each cut stream is a raw HTTP/1.1 connection closed at one of these points:
- "mid-body": after part of the request body (the server never gets a whole request);
- "after-request": right after the request, before the first event;
- "mid-stream": after a random number of events, fewer than the stream would send;
each either with a FIN (close) or a reset (SO_LINGER 0, as when a client process dies).

Afterwards the server must be idle at once, with every KV block back in the pool, and healthy (cut
requests ask for 200 tokens: one the server failed to abort would keep the engine busy for seconds,
and hold its blocks meanwhile); and the other requests must equal their solo runs.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from tests.reliability.load import LoadFigures, compare
from tests.reliability.observe import engine_state, healthy, wait_until_idle
from tests.reliability.workload import Job, send_all, send_one_by_one

CUT_POINTS = ("mid-body", "after-request", "mid-stream")
# Cut streams ask for this many tokens: far more than they read before hanging up.
CUT_STREAM_TOKENS = 200


@dataclass
class DisconnectFigures:
    cuts: int
    cut_points: Counter = field(default_factory=Counter)  # "mid-stream/reset" -> how many
    leaked_blocks: int = 0
    idle_after_s: float = 0.0  # from the end of the run to an idle engine with every block free
    healthy_after: bool = False
    others: LoadFigures | None = None  # the requests that ran meanwhile, against their solo runs


def cut_jobs(n: int, seed: int, max_prompt_words: int) -> list[Job]:
    """Streams long enough to cut in the middle: CUT_STREAM_TOKENS tokens, ignoring end-of-sequence."""
    rng = random.Random(seed)
    return [Job(i, rng.choice(("completions", "chat")), True,
                tuple(f"w{rng.randrange(5, 1000)}" for _ in range(rng.randint(1, max_prompt_words))),
                CUT_STREAM_TOKENS, ignore_eos=True, include_usage=rng.random() < 0.5) for i in range(n)]


async def cut_stream(host: str, port: int, job: Job, point: str, reset: bool, rng: random.Random) -> None:
    body = json.dumps(job.body()).encode()
    head = (f"POST {job.path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        if point == "mid-body":
            writer.write(head + body[:rng.randrange(1, len(body))])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.05))
            return
        writer.write(head + body)
        await writer.drain()
        if point == "after-request":
            await asyncio.sleep(rng.uniform(0, 0.05))
            return
        events_to_read = rng.randint(1, CUT_STREAM_TOKENS // 4)
        received = b""
        while received.count(b"data: ") < events_to_read:
            chunk = await asyncio.wait_for(reader.read(4096), timeout=120)
            if not chunk:
                raise ConnectionError(f"the server closed the stream of job {job.index} before it was cut: "
                                      f"{received[:300]!r}")
            received += chunk
    finally:
        if reset:  # an RST instead of a FIN: the peer vanished rather than hung up
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()


async def _cut_all(url: str, jobs: list[Job], concurrency: int, seed: int, figures: DisconnectFigures) -> None:
    parts = urlsplit(url)
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Job) -> None:
        point, reset = rng.choice(CUT_POINTS), rng.random() < 0.5
        figures.cut_points[f"{point}/{'reset' if reset else 'close'}"] += 1
        async with gate:
            await cut_stream(parts.hostname, parts.port, job, point, reset, random.Random(rng.random()))

    await asyncio.gather(*(one(job) for job in jobs))


def run_disconnects(url: str, cuts: list[Job], others: list[Job], concurrency: int, seed: int) -> DisconnectFigures:
    """Cut every job of `cuts` (at most `concurrency` at once) while `others` run, 8 at a time."""
    figures = DisconnectFigures(len(cuts))
    solo = asyncio.run(send_one_by_one(url, others))

    async def both():
        return await asyncio.gather(_cut_all(url, cuts, concurrency, seed, figures), send_all(url, others, 8))

    _, together = asyncio.run(both())
    ended = time.perf_counter()
    state = wait_until_idle(url, timeout=60)
    figures.idle_after_s = time.perf_counter() - ended
    figures.leaked_blocks = state.blocks_used
    figures.others = LoadFigures(len(others), 8, leaked_blocks=state.blocks_used)
    compare(others, solo, together, figures.others)
    figures.healthy_after = healthy(url) and engine_state(url).idle
    return figures
