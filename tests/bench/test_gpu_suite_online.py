"""benchmarks/gpu_suite.py's online phase on CPU with a tiny Llama shape: a real `shardserve serve` measured by
`shardserve bench` at concurrency 1 and 4, stopped on SIGINT; and its figures in the suite's summary and table."""

from __future__ import annotations

import importlib.util
import os

import pytest

SUITE = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu_suite.py")
REQUESTS, PROMPT, OUTPUT = 8, 16, 8


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_online_phase_serves_the_workload_and_stops_the_server(suite, tmp_path, capsys):
    # The 8B shape's vocabulary and token ids (the stand-in tokenizer's), two narrow layers.
    tiny = {**suite.LLAMA3_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}
    model_dir = suite.write_model_dir(str(tmp_path / "model"), tiny)
    out = suite.run_online(model_dir, name="tiny", device="cpu", dtype="float32", max_batched_tokens=256,
                           max_model_len=64, max_num_seqs=REQUESTS, requests=REQUESTS, prompt_len=PROMPT,
                           output_len=OUTPUT, levels=(4,), c1_requests=4, health_timeout=120,
                           extra_serve_args=("--kv-cache-memory", "0.05"), work_dir=str(tmp_path / "online"))
    for key in ("online_c1_output_tok_s", "online_c1_tpot_ms", "online_c4_output_tok_s", "online_c4_tpot_ms",
                "online_c4_server_cpu_s", "online_startup_s"):
        assert out[key] > 0, key
    assert out["online_server_stop"] == "stopped on SIGINT (status 0)"
    assert out["online_workload"]["levels"] == [1, 4]
    stdout = capsys.readouterr().out
    assert suite._servers_left_running(stdout) == [], "the phase reports its server stopped"
    assert len([ln for ln in stdout.splitlines() if ln.startswith(suite.SERVER_STARTED)]) == 1


def test_summary_and_table_carry_the_online_figures(suite, capsys):
    report = {"device": "NVIDIA H100 80GB HBM3", "gpus": 1, "torch": "2.x", "copy_GBps": 3000.0,
              "weight_bytes": 16_000_000_000, "roofline_tok_s": 187.5}
    engine = {"decode_bs1_tok_s": 150.0, "decode_bs1_samples": [150.0], "offline_samples": [20000.0],
              "offline_output_tok_s": 20000.0, "startup_s": 30.0, "preemptions": 0}
    online = {"online_startup_s": 40.0, "online_c1_output_tok_s": 140.0, "online_c1_tpot_ms": 7.0,
              "online_c64_output_tok_s": 6000.0, "online_c256_output_tok_s": 15000.0,
              "online_c512_output_tok_s": 18000.0, "online_c512_server_cpu_s": 90.0, "online_c512_duration_s": 8.0,
              "online_server_log": "/tmp/x", "online_server_stop": "stopped on SIGINT (status 0)",
              "online_workload": {"requests": 512, "c1_requests": 16, "prompt_tokens": 512, "output_tokens": 256,
                                  "levels": [1, 64, 256, 512], "api_server_count": None}}
    res = suite.summarize(report, {1: engine}, "llama3-8b", online)
    assert res["online_c512_vs_offline"] == pytest.approx(0.9)
    assert res["online_c256_vs_offline"] == pytest.approx(0.75)
    assert res["online_c1_tpot_ms"] == 7.0 and res["online_c512_server_cpu_s"] == 90.0
    assert "online_server_log" not in res, "a path on the machine that ran it is no result"
    suite.print_table(res)
    table = capsys.readouterr().out
    assert "online TP=1 512x(512+256), concurrency 512" in table and "18,000.0 tok/s" in table
    assert "online TPOT p50 at concurrency 1 (16 requests)" in table

    # Served at TP=2: compared with the offline figure of the same size, not TP=1's.
    two = {**engine, "offline_output_tok_s": 30000.0, "offline_samples": [30000.0]}
    at_two = {**online, "online_workload": {**online["online_workload"], "tensor_parallel_size": 2}}
    res = suite.summarize({**report, "gpus": 2}, {1: engine, 2: two}, "llama3-8b", at_two)
    assert res["online_c512_vs_offline"] == pytest.approx(0.6)
    suite.print_table(res)
    table = capsys.readouterr().out
    assert "online TP=2 512x(512+256), concurrency 512" in table and "concurrency 512 / offline TP=2" in table

    failed = suite.summarize(report, {1: engine}, "llama3-8b", {"error": "exit 1: ['RuntimeError: boom']"})
    assert failed["online_error"].startswith("exit 1")
    suite.print_table(failed)
    assert "failed: exit 1" in capsys.readouterr().out
