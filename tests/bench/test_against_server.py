"""`shardserve bench` against a real server on a tiny random model: the files it writes, token counts that
agree with the server's /metrics, prompts that never hit the prefix cache, goodput, and failed requests
counted without ending the run."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import matplotlib.image
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from shardserve.bench.metrics import parse_slo
from shardserve.bench.report import plot
from shardserve.bench.runner import BenchConfig, run_bench
from shardserve.bench.workload import Workload, load_dataset
from shardserve.tokenizer import Tokenizer
from tests.serving import serve_model

MODEL = "tiny"
MAX_MODEL_LEN = 128
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 24, 8


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return tiny_model_dir("llama-tied")


@pytest.fixture(scope="module")
def server(model_dir):
    with serve_model(model_dir, name=MODEL, max_model_len=MAX_MODEL_LEN, kv_cache_memory_gb=0.05) as running:
        yield running


def _counters(server) -> dict[str, float]:
    """The server's counters for MODEL, by sample name."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(server.http().get("/metrics").text):
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("model_name") == MODEL:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def _bench_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardserve", "bench", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_writes_results_whose_tokens_match_the_servers_counters(server, model_dir, tmp_path):
    before = _counters(server)
    out, table, png = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.png"
    run = _bench_cli("--base-url", server.url, "--model", MODEL, "--concurrency", "1,4",
                     "--num-prompts", str(NUM_PROMPTS), "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                     "--tokenizer", model_dir, "--num-warmups", "0", "--goodput", "ttft:60000", "tpot:60000",
                     "--out", str(out), "--csv", str(table), "--plot", str(png))
    assert run.returncode == 0, run.stderr
    assert f"2 levels x {NUM_PROMPTS} requests, {OUTPUT_LEN} output tokens each: " \
           f"{2 * NUM_PROMPTS * OUTPUT_LEN:,} tokens to generate" in run.stderr, "the run says what it will ask for"
    after = _counters(server)

    results = json.loads(out.read_text())
    levels = results["levels"]
    assert [level["concurrency"] for level in levels] == [1, 4]
    for level in levels:
        assert (level["completed"], level["failed"]) == (NUM_PROMPTS, 0)
        assert level["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN, "--tokenizer makes prompts exact"
        assert level["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN, "ignore_eos runs to --output-len"
        assert level["goodput"] == pytest.approx(level["request_throughput"]), "every request met a 60 s SLO"
        assert 0 < level["ttft_ms"]["p50"] <= level["ttft_ms"]["p99"] <= level["e2el_ms"]["p99"]
        assert 0 < level["client_cpu_s"] < level["duration_s"] * 2, "the client's own CPU time is recorded"
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    assert delta["shardserve:prompt_tokens_total"] == sum(level["total_input_tokens"] for level in levels)
    assert delta["shardserve:generation_tokens_total"] == sum(level["total_output_tokens"] for level in levels)
    assert delta["shardserve:prefix_cache_queries_total"] > 0
    assert delta["shardserve:prefix_cache_hits_total"] == 0, "no two prompts share a prefix, across levels too"

    with table.open() as f:
        rows = list(csv.DictReader(f))
    assert [int(row["concurrency"]) for row in rows] == [1, 4]
    assert [float(row["output_throughput"]) for row in rows] == [level["output_throughput"] for level in levels]
    assert float(rows[0]["ttft_ms_p99"]) == levels[0]["ttft_ms"]["p99"]
    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 1000 and height > 500
    assert "TTFT p50/p99 ms" in run.stdout and "output tok/s" in run.stdout


def test_plot_labels_throughput_and_latency_against_concurrency(server, model_dir):
    workload = Workload(4, output_len=4, input_len=16, tokenizer=Tokenizer.from_model_path(model_dir), seed=1)
    levels = run_bench(BenchConfig(server.url, MODEL, concurrency=(1, 2), num_warmups=0), workload, Console(quiet=True))
    throughput, latency = plot(levels, "tiny").axes
    assert throughput.get_xlabel() == latency.get_xlabel() == "concurrency (requests in flight)"
    assert throughput.get_ylabel() == "throughput (tokens/s)"
    assert latency.get_ylabel() == "latency (ms)"
    assert list(throughput.get_xticks()) == [1, 2]
    assert "output tokens/s" in [line.get_label() for line in throughput.get_lines()]
    assert {"TTFT p50", "TPOT p50", "ITL p50"} <= {line.get_label() for line in latency.get_lines()}


def test_goodput_counts_only_requests_within_every_slo(server, model_dir):
    workload = Workload(4, output_len=4, input_len=16, tokenizer=Tokenizer.from_model_path(model_dir), seed=2)
    slos = (parse_slo("ttft:60000"), parse_slo("e2el:0.001"))  # nobody finishes within a microsecond
    [level] = run_bench(BenchConfig(server.url, MODEL, concurrency=(2,), slos=slos, num_warmups=0), workload,
                        Console(quiet=True))
    assert level.completed == 4 and level.goodput == 0


def test_failed_requests_are_counted_with_their_error_and_the_run_goes_on(server, tmp_path):
    dataset = tmp_path / "mixed.jsonl"
    too_long = " ".join(f"w{i}" for i in range(10, 10 + 2 * MAX_MODEL_LEN))
    dataset.write_text(json.dumps({"prompt": "w5 w6 w7"}) + "\n" + json.dumps({"prompt": too_long}) + "\n")
    workload = Workload(4, output_len=4, dataset=load_dataset(str(dataset)), seed=3)
    [level] = run_bench(BenchConfig(server.url, MODEL, concurrency=(2,), num_warmups=0), workload, Console(quiet=True))
    assert (level.completed, level.failed) == (2, 2)
    [(error, count)] = level.errors.items()
    assert count == 2 and error.startswith("HTTP 400") and str(MAX_MODEL_LEN) in error

    run = _bench_cli("--base-url", server.url, "--model", "no-such-model", "--concurrency", "1,2", "--num-prompts", "2",
                     "--input-len", "8", "--output-len", "2", "--out", str(tmp_path / "failed.json"))
    assert run.returncode == 1, "some requests failed"
    levels = json.loads((tmp_path / "failed.json").read_text())["levels"]
    assert [(level["completed"], level["failed"]) for level in levels] == [(0, 2), (0, 2)]
    assert "no-such-model" in next(iter(levels[0]["errors"]))
    assert "no-such-model" in run.stdout and "warm-up request failed" in run.stderr


def test_a_server_that_counts_other_prompt_lengths_is_reported_loudly(model_dir, tmp_path):
    """A word-level tokenizer without a whitespace pre-tokenizer counts each whole prompt as one token: the
    run's figures then describe another workload, and bench must say so (exit status 1), not report
    input_len_exact."""
    import shutil

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    broken = tmp_path / "no-pre-tokenizer"
    shutil.copytree(model_dir, broken)
    vocab = json.loads((broken / "tokenizer.json").read_text())["model"]["vocab"]
    HFTokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(broken / "tokenizer.json"))
    out = tmp_path / "r.json"
    with serve_model(str(broken), name=MODEL, max_model_len=MAX_MODEL_LEN, kv_cache_memory_gb=0.05) as running:
        run = _bench_cli("--base-url", running.url, "--model", MODEL, "--concurrency", "1", "--num-prompts", "2",
                         "--input-len", "32", "--output-len", "2", "--num-warmups", "0", "--out", str(out))
    assert run.returncode == 1, run.stderr
    assert "WARNING: the server counted 1.0 prompt tokens per request on average for prompts of about 32 words" \
        in run.stderr
    record = json.loads(out.read_text())
    assert record["input_len_exact"] is False and "pre-tokenizer" in record["prompt_length_warning"]
