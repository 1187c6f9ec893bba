"""Runs the levels one after another: each sends the workload's requests for that level, arriving all
at once or as a Poisson process, with at most `concurrency` in flight, under a progress bar."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from shardserve.bench.client import OpenAIClient, RequestResult
from shardserve.bench.metrics import LevelSummary, Slo, speculative_summary, summarize
from shardserve.bench.workload import BenchRequest, Workload


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str
    concurrency: tuple[int, ...]
    request_rate: float = math.inf  # requests/s; inf: all requests arrive at once
    slos: tuple[Slo, ...] = ()
    api_key: str | None = None
    num_warmups: int = 1
    timeout_s: float = 600.0


def run_bench(config: BenchConfig, workload: Workload, console: Console) -> list[LevelSummary]:
    """Every level's summary, in the order of `config.concurrency`; failures are counted, never raised."""
    return asyncio.run(_run(config, workload, console))


async def _run(config: BenchConfig, workload: Workload, console: Console) -> list[LevelSummary]:
    client = OpenAIClient(config.base_url, config.model, config.api_key, config.timeout_s)
    rate = None if math.isinf(config.request_rate) else config.request_rate
    summaries = []
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
                      TimeElapsedColumn(), console=console, disable=not console.is_terminal) as progress:
            if config.num_warmups:
                await _warm_up(client, workload, config.num_warmups, progress, console)
            for level, concurrency in enumerate(config.concurrency):
                requests = workload.requests(level)
                task = progress.add_task(f"concurrency {concurrency}", total=len(requests))
                counters = await client.spec_counters()
                cpu = time.process_time()
                results, duration = await _run_level(client, requests, concurrency, rate, workload.seed + level,
                                                     lambda: progress.advance(task))
                summary = summarize(results, duration, concurrency, rate, config.slos,
                                    client_cpu_s=time.process_time() - cpu)
                speculative = speculative_summary(counters, await client.spec_counters())
                summaries.append(dataclasses.replace(summary, speculative=speculative))
    finally:
        await client.aclose()
    return summaries


async def _warm_up(client: OpenAIClient, workload: Workload, count: int, progress: Progress,
                   console: Console) -> None:
    """A few requests before the first level (lazy initialisation on the server), outside every figure.

    They use the prompts of a level after the last one, so they share no prefix with measured requests.
    """
    requests = workload.requests(level=-1)[:count]
    task = progress.add_task("warm-up", total=len(requests))
    results, _ = await _run_level(client, requests, 1, None, 0, lambda: progress.advance(task))
    for result in results:
        if not result.ok:
            console.print(f"warm-up request failed: {result.error}", style="yellow")


async def _run_level(client: OpenAIClient, requests: list[BenchRequest], concurrency: int, rate: float | None,
                     seed: int, on_done) -> tuple[list[RequestResult], float]:
    """The results in request order and the level's duration (first request sent to last one finished)."""
    gate = asyncio.Semaphore(concurrency)
    delays = arrival_offsets(len(requests), rate, random.Random(seed))
    started = time.perf_counter()

    async def one(request: BenchRequest, delay: float) -> RequestResult:
        await asyncio.sleep(delay)
        async with gate:
            result = await client.send(request, started)
        on_done()
        return result

    results = await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays)))
    return list(results), time.perf_counter() - started


def arrival_offsets(n: int, rate: float | None, rng: random.Random) -> list[float]:
    """When each of `n` requests arrives, in seconds from the start: a Poisson process of `rate` per
    second (exponential gaps, the first request at 0), or all at 0 without a rate."""
    if rate is None:
        return [0.0] * n
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets
