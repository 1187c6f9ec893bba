"""Per-level figures from the requests' results: throughput, latency percentiles and goodput.

Definitions (as in vLLM's `bench serve`):
- TTFT: from sending a request to its first output chunk.
- TPOT: per request, (end-to-end - TTFT) / (completion tokens - 1).
- ITL: the gaps between consecutive output chunks, pooled over all requests.
- end-to-end latency (e2el): from sending to the end of the stream.
- goodput: completed requests per second that met every SLO given with --goodput.
Token counts are the servers' `usage`; throughputs divide by the level's duration, from its first
request sent to its last one finished.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from shardserve.bench.client import RequestResult

# --goodput keys and the per-request latency each one bounds.
SLO_KEYS = {"ttft": "time to first token", "tpot": "time per output token", "e2el": "end-to-end latency"}
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    key: str
    limit_ms: float

    def met_by(self, result: RequestResult) -> bool:
        value = {"ttft": result.ttft_s, "tpot": result.tpot_s, "e2el": result.e2e_s}[self.key]
        return value is None or value * 1000 <= self.limit_ms  # a one-token request has no TPOT to miss


def parse_slo(text: str) -> Slo:
    """`KEY:MILLISECONDS`, e.g. `ttft:500`; a ValueError names what is accepted."""
    key, _, limit = text.partition(":")
    accepted = f"KEY:MILLISECONDS with KEY one of {', '.join(SLO_KEYS)} (e.g. ttft:500)"
    if key not in SLO_KEYS:
        raise ValueError(f"--goodput takes {accepted}, got {text!r}")
    try:
        limit_ms = float(limit)
    except ValueError:
        raise ValueError(f"--goodput takes {accepted}, got {text!r}: {limit!r} is not a number") from None
    if not limit_ms > 0 or math.isinf(limit_ms):
        raise ValueError(f"--goodput takes {accepted}, got {text!r}: the limit must be a positive number")
    return Slo(key, limit_ms)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> "Distribution | None":
        if not seconds:
            return None
        ms = np.asarray(seconds) * 1000
        return cls(float(ms.mean()), *(float(np.percentile(ms, p)) for p in PERCENTILES))


@dataclass(frozen=True)
class LevelSummary:
    concurrency: int
    request_rate: float | None  # requests/s of the Poisson arrivals; None: all sent at once
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests/s
    output_throughput: float  # completion tokens/s
    total_token_throughput: float  # prompt + completion tokens/s
    total_input_tokens: int
    total_output_tokens: int
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None
    itl_ms: Distribution | None
    e2el_ms: Distribution | None
    goodput: float | None  # requests/s meeting every SLO; None without SLOs
    slos: tuple[Slo, ...] = ()
    requests_without_usage: int = 0  # counted from chunks: the server did not report usage
    client_cpu_s: float | None = None  # CPU seconds the bench process itself used during the level
    errors: dict[str, int] = field(default_factory=dict)  # message -> how many requests failed with it
    # The server's speculative decoding over the level (its /metrics counters' change): acceptance_rate (accepted /
    # proposed tokens), mean_accepted_length (tokens a verified step added), drafts; None where it does not speculate.
    speculative: dict[str, float] | None = None


def summarize(results: list[RequestResult], duration_s: float, concurrency: int, request_rate: float | None,
              slos: tuple[Slo, ...] = (), client_cpu_s: float | None = None) -> LevelSummary:
    done = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.completion_tokens for r in done)
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    goodput = sum(all(s.met_by(r) for s in slos) for r in done) * per_s if slos else None
    return LevelSummary(
        concurrency=concurrency, request_rate=request_rate, num_requests=len(results), completed=len(done),
        failed=len(results) - len(done), duration_s=duration_s, request_throughput=len(done) * per_s,
        output_throughput=output_tokens * per_s, total_token_throughput=(input_tokens + output_tokens) * per_s,
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        ttft_ms=Distribution.of([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=Distribution.of([r.tpot_s for r in done if r.tpot_s is not None]),
        itl_ms=Distribution.of([gap for r in done for gap in r.itl_s]),
        e2el_ms=Distribution.of([r.e2e_s for r in done]),
        goodput=goodput, slos=slos, requests_without_usage=sum(not r.usage_reported for r in done), errors=errors,
        client_cpu_s=client_cpu_s)


# The bench process busy this share of a level's wall time read its streams late: it measured itself.
CLIENT_BOUND_SHARE = 0.85


def client_bound_warning(levels: list[LevelSummary]) -> str | None:
    """Which levels kept the bench client busy nearly all the time (their figures are the client's limit,
    not the server's), or None."""
    busy = [f"concurrency {s.concurrency}: {s.client_cpu_s:.1f} s of CPU in {s.duration_s:.1f} s" for s in levels
            if s.client_cpu_s is not None and s.duration_s > 0 and s.client_cpu_s >= CLIENT_BOUND_SHARE * s.duration_s]
    if not busy:
        return None
    return ("the bench client was busy almost all the time (" + "; ".join(busy) + "), so it may have read the "
            "streams late and these levels measure it rather than the server: run several bench processes with "
            "a share of the concurrency each, or the client on another machine")


def speculative_summary(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """LevelSummary.speculative from the server's counters before and after a level."""
    if not after:
        return None
    delta = {k: after.get(k, 0.0) - (before or {}).get(k, 0.0) for k in ("drafts", "draft_tokens", "accepted_tokens")}
    if delta["drafts"] <= 0:
        return None
    return {"acceptance_rate": delta["accepted_tokens"] / max(delta["draft_tokens"], 1.0),
            "mean_accepted_length": 1.0 + delta["accepted_tokens"] / delta["drafts"], "drafts": delta["drafts"]}
