"""What the reliability checks read from outside the server: /metrics (requests in the engine, KV blocks,
finished requests) and /health, exactly as an operator's scraper would."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class EngineState:
    running: int
    waiting: int
    blocks_free: int
    blocks_total: int
    finished: int  # requests that ended with finish reason stop or length, since start
    preemptions: int  # requests preempted for lack of KV blocks, since start

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0

    @property
    def blocks_used(self) -> int:
        """KV blocks held by requests; with the engine idle, every one of them is leaked."""
        return self.blocks_total - self.blocks_free


def engine_state(url: str, api_key: str | None = None) -> EngineState:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    response.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.labels.get("finished_reason") == "abort":
                continue  # `finished` counts requests that ran to their end
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return EngineState(
        running=int(values["shardserve:num_requests_running"]),
        waiting=int(values["shardserve:num_requests_waiting"]),
        blocks_free=int(values["shardserve:kv_cache_blocks_free"]),
        blocks_total=int(values["shardserve:kv_cache_blocks_total"]),
        finished=int(values.get("shardserve:request_success_total", 0)),
        preemptions=int(values["shardserve:num_preemptions_total"]),
    )


def wait_until_idle(url: str, timeout: float = 30.0, api_key: str | None = None) -> EngineState:
    """The engine's state once no request is running or waiting (or when `timeout` runs out)."""
    deadline = time.monotonic() + timeout
    while True:
        state = engine_state(url, api_key)
        if (state.idle and state.blocks_used == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False
