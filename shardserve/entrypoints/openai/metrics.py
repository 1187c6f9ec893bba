"""`/metrics` in Prometheus text format, labelled by model, with vLLM's metric names under a
`shardserve:` prefix: request counts and latencies observed per request by the HTTP layer, and the
engine's state (requests running and waiting, KV cache use, prefix cache, sleep, restarts) read at
scrape time.
"""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shardserve.requests.outputs import RequestOutput

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


_METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


class ServerMetrics:
    def __init__(self, model_name: str, engine) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        shared = _METRICS_DIR_ENV in os.environ
        if shared:  # several front-end processes: each writes its counts to files, /metrics sums them all
            MultiProcessCollector(self.registry)
        registry = None if shared else self.registry
        label = ["model_name"]
        self.prompt_tokens = Counter("shardserve:prompt_tokens", "Prompt tokens of finished requests.", label,
                                     registry=registry)
        self.generation_tokens = Counter("shardserve:generation_tokens", "Generated tokens of finished requests.",
                                         label, registry=registry)
        # finished_reason: stop, length, or abort (ended before finishing: the client went away, or the server
        # stopped it), as vLLM counts them.
        self.request_success = Counter("shardserve:request_success", "Requests that finished, by finish reason.",
                                       ["model_name", "finished_reason"], registry=registry)
        self.ttft = Histogram("shardserve:time_to_first_token_seconds", "Time to the first generated token.",
                              label, buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("shardserve:inter_token_latency_seconds", "Time between streamed outputs.", label,
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("shardserve:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             label, buckets=LATENCY_BUCKETS, registry=registry)
        self.registry.register(_EngineState(engine, model_name))
        # The children of this model's label, looked up once: RequestTimer observes every output.
        self.ttft_child = self.ttft.labels(model_name)
        self.itl_child = self.itl.labels(model_name)
        self.e2e_child = self.e2e.labels(model_name)
        self.prompt_tokens_child = self.prompt_tokens.labels(model_name)
        self.generation_tokens_child = self.generation_tokens.labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def request(self) -> "RequestTimer":
        return RequestTimer(self)


class RequestTimer:
    """Observes one request: call `output` for each engine output, in order, and `aborted` if it ends without a
    finishing output. Each request is counted once, under the reason it ended with."""

    __slots__ = ("metrics", "arrived", "last", "counted")

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrived = time.monotonic()
        self.last: float | None = None
        self.counted = False

    def output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        if self.last is None:
            m.ttft_child.observe(now - self.arrived)
        elif out.new_token_ids:
            m.itl_child.observe(now - self.last)
        self.last = now
        if out.finished and out.finish_reason in ("stop", "length"):
            m.e2e_child.observe(now - self.arrived)
            self._count(out.finish_reason)
            m.prompt_tokens_child.inc(out.num_prompt_tokens)
            m.generation_tokens_child.inc(out.num_output_tokens)
        elif out.finished and out.finish_reason == "abort":
            self._count("abort")

    def aborted(self) -> None:
        """The request ended before the engine finished it (client gone, server stopping): counted as abort,
        unless it was counted already."""
        self._count("abort")

    def _count(self, reason: str) -> None:
        if not self.counted:
            self.counted = True
            self.metrics.request_success.labels(self.metrics.model_name, reason).inc()


class _EngineState:
    """The engine's state at scrape time (EngineClient.stats())."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"shardserve:{name}", doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"shardserve:{name}", doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        try:
            s = self.engine.stats()
        except AttributeError:  # no engine yet, or none any more (a restart in progress)
            return
        yield gauge("num_requests_running", "Requests being computed.", s.running)
        yield gauge("num_requests_waiting", "Requests waiting to start (or for a wake).", s.waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                    1.0 - s.kv_blocks_free / max(s.kv_blocks_total, 1))
        # Exact counts: with no request in flight, free == total, or blocks leaked.
        yield gauge("kv_cache_blocks_total", "KV cache blocks of the engine.", s.kv_blocks_total)
        yield gauge("kv_cache_blocks_free", "KV cache blocks free or held only by the prefix cache.", s.kv_blocks_free)
        yield counter("num_preemptions", "Requests preempted (blocks freed, recomputed later) for lack of "
                                         "KV cache blocks.", s.preemptions)
        yield counter("prefix_cache_queries", "Whole prompt blocks looked up in the prefix cache, found or not.",
                      s.prefix_queries)
        yield counter("prefix_cache_hits", "Blocks found in the prefix cache.", s.prefix_hits)
        yield gauge("is_sleeping", "1 while the model sleeps.", float(s.sleeping))
        yield counter("sleeps", "Times the model was put to sleep.", s.sleeps)
        yield counter("wakes", "Times the model woke.", s.wakes)
        yield gauge("last_wake_seconds", "Duration of the last wake (0 before the first).", s.last_wake_seconds)
        yield counter("spec_decode_num_drafts", "Sequence steps that verified proposed tokens "
                                                "(--speculative-config).", s.spec_drafts)
        yield counter("spec_decode_num_draft_tokens", "Tokens proposed for verification.", s.spec_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Proposed tokens the target model accepted.",
                      s.spec_accepted_tokens)
        if s.restarts is not None:
            yield counter("restarts", "Times all ranks were restarted after a failure.", s.restarts)
