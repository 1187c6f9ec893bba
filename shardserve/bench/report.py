"""What `shardserve bench` writes: a table on the terminal, JSON (run settings and every level), CSV (one
row per level) and a PNG of throughput and latency against concurrency."""

from __future__ import annotations

import csv
import dataclasses
import json

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter
from rich.console import Console
from rich.table import Table

from shardserve.bench.metrics import PERCENTILES, Distribution, LevelSummary

LATENCIES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2el_ms": "E2E"}
_STATS = ("mean", *(f"p{p}" for p in PERCENTILES))


def print_table(levels: list[LevelSummary], console: Console, title: str) -> None:
    table = Table(title=title, title_justify="left")
    for header in ("concurrency", "done", "failed", "req/s", "output tok/s", "total tok/s", "TTFT p50/p99 ms",
                   "TPOT p50/p99 ms", "ITL p50/p99 ms", "E2E p50/p99 s", "goodput req/s"):
        table.add_column(header, justify="right")
    for s in levels:
        table.add_row(str(s.concurrency), str(s.completed), str(s.failed), f"{s.request_throughput:.2f}",
                      f"{s.output_throughput:.1f}", f"{s.total_token_throughput:.1f}", _p50_p99(s.ttft_ms),
                      _p50_p99(s.tpot_ms), _p50_p99(s.itl_ms), _p50_p99(s.e2el_ms, scale=1e-3, digits=2),
                      "-" if s.goodput is None else f"{s.goodput:.2f}")
    console.print(table)
    for s in levels:
        for error, count in s.errors.items():
            console.print(f"concurrency {s.concurrency}: {count} failed: {error}", style="red")
        if s.speculative:
            console.print(f"concurrency {s.concurrency}: speculative decoding accepted "
                          f"{s.speculative['acceptance_rate']:.1%} of proposed tokens, "
                          f"{s.speculative['mean_accepted_length']:.2f} tokens a verified step")
        if s.requests_without_usage:
            console.print(f"concurrency {s.concurrency}: {s.requests_without_usage} responses had no usage; "
                          "their output tokens were counted from the chunks", style="yellow")


def _p50_p99(d: Distribution | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if d is None else f"{d.p50 * scale:.{digits}f} / {d.p99 * scale:.{digits}f}"


def write_json(path: str, run: dict, levels: list[LevelSummary]) -> None:
    """`run` (settings, server, date) and every level's summary, latencies in ms."""
    with open(path, "w") as f:
        json.dump({**run, "levels": [dataclasses.asdict(s) for s in levels]}, f, indent=2)
        f.write("\n")


def csv_row(s: LevelSummary) -> dict[str, object]:
    """One level as flat columns: the counts and throughputs, then each latency's mean and percentiles."""
    row: dict[str, object] = {
        "concurrency": s.concurrency, "request_rate": "inf" if s.request_rate is None else s.request_rate,
        "num_requests": s.num_requests, "completed": s.completed, "failed": s.failed,
        "duration_s": s.duration_s, "request_throughput": s.request_throughput,
        "output_throughput": s.output_throughput, "total_token_throughput": s.total_token_throughput,
        "total_input_tokens": s.total_input_tokens, "total_output_tokens": s.total_output_tokens,
        "goodput": "" if s.goodput is None else s.goodput,
        "client_cpu_s": "" if s.client_cpu_s is None else s.client_cpu_s,
        "spec_acceptance_rate": "" if not s.speculative else s.speculative["acceptance_rate"],
        "spec_mean_accepted_length": "" if not s.speculative else s.speculative["mean_accepted_length"]}
    for name in LATENCIES:
        d = getattr(s, name)
        for stat in _STATS:
            row[f"{name}_{stat}"] = "" if d is None else getattr(d, stat)
    return row


def write_csv(path: str, levels: list[LevelSummary]) -> None:
    rows = [csv_row(s) for s in levels]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(levels: list[LevelSummary], title: str) -> Figure:
    """Throughput (left) and latency percentiles (right, log scale) against concurrency (log scale)."""
    figure = Figure(figsize=(12, 4.8), layout="constrained")
    throughput_axes, latency_axes = figure.subplots(1, 2)
    concurrency = [s.concurrency for s in levels]
    throughput_axes.plot(concurrency, [s.output_throughput for s in levels], "o-", label="output tokens/s")
    throughput_axes.plot(concurrency, [s.total_token_throughput for s in levels], "s--",
                         label="total (prompt + output) tokens/s")
    throughput_axes.set(xlabel="concurrency (requests in flight)", ylabel="throughput (tokens/s)",
                        title="throughput")
    throughput_axes.set_ylim(bottom=0)
    for name, stat, style in (("ttft_ms", "p50", "o-"), ("ttft_ms", "p99", "o:"), ("tpot_ms", "p50", "s-"),
                              ("itl_ms", "p50", "^-"), ("itl_ms", "p99", "^:")):
        points = [(s.concurrency, getattr(getattr(s, name), stat)) for s in levels if getattr(s, name) is not None]
        if points:
            latency_axes.plot(*zip(*points), style, label=f"{LATENCIES[name]} {stat}")
    latency_axes.set(xlabel="concurrency (requests in flight)", ylabel="latency (ms)", title="latency", yscale="log")
    latency_axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # 20, not 2x10^1
    # Between decades only 2x and 5x are labelled, so the labels stay apart.
    latency_axes.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if f"{value:g}"[0] in "25"
                                                         else ""))
    for axes in (throughput_axes, latency_axes):
        axes.set_xscale("log", base=2)
        axes.set_xticks(concurrency, [str(c) for c in concurrency])
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    return figure
