"""Online against offline on a CPU: the same 64 x (128 in, 64 out) workload through `LLM.generate` and through
`shardserve serve` + `shardserve bench`, for each --api-server-count given (0: HTTP in the engine's process).

    python benchmarks/cpu_online_vs_offline.py models/SmolLM2-135M-Instruct.Q4_1.gguf --api-server-counts 0,1

Also runs the notebook's CPU levels (docs/benchmarks-notebook.md: 32 requests of 128 + 64 tokens at concurrency 1,
4 and 16) against each server. Prints one JSON object (and writes it with --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.result_file import report  # noqa: E402


def timed_generate(llm, requests: int, input_len: int, output_len: int) -> tuple[int, float]:
    """(output tokens, seconds) of `requests` random prompts of input_len tokens, output_len new tokens each (greedy,
    no detokenizing), generated at once by `llm` after a two-prompt warm-up."""
    from shardserve import SamplingParams

    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(input_len)] for _ in range(requests)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outputs), time.perf_counter() - started


def offline(model: str, requests: int, input_len: int, output_len: int) -> dict:
    from shardserve import LLM

    with LLM(model, device="cpu", max_model_len=2048, max_num_seqs=requests) as llm:
        tokens, seconds = timed_generate(llm, requests, input_len, output_len)
    return {"output_tokens": tokens, "seconds": round(seconds, 2), "output_tok_s": round(tokens / seconds, 1)}


def bench(url: str, model: str, concurrency: str, prompts: int, out: str) -> list[dict]:
    cmd = [sys.executable, "-m", "shardserve", "bench", "--base-url", url, "--model", "m", "--concurrency", concurrency,
           "--num-prompts", str(prompts), "--input-len", "128", "--output-len", "64", "--tokenizer", model,
           "--seed", "0", "--out", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["levels"]


def online(model: str, api_servers: int, workdir: str) -> dict:
    port = 8300 + api_servers
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "shardserve", "serve", model, "--device", "cpu", "--port", str(port),
                               "--max-model-len", "2048", "--served-model-name", "m", "--max-num-seqs", "64",
                               "--api-server-count", str(api_servers)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode}")
            time.sleep(0.5)
        levels = bench(url, model, "1,4,16", 32, os.path.join(workdir, f"levels-{api_servers}.json"))
        levels += bench(url, model, "64", 64, os.path.join(workdir, f"c64-{api_servers}.json"))
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(60)
    return {f"c{lv['concurrency']}": {"output_tok_s": round(lv["output_throughput"], 1),
                                     "tpot_p50_ms": round(lv["tpot_ms"]["p50"], 1),
                                     "prompt_tokens": lv.get("total_input_tokens")} for lv in levels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--api-server-counts", default="0,1")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = {"offline_64x(128+64)": offline(args.model, 64, 128, 64)}
    with tempfile.TemporaryDirectory() as workdir:
        for count in (int(c) for c in args.api_server_counts.split(",")):
            result[f"api_server_count={count}"] = online(args.model, count, workdir)
    report(result, args.out, print_indent=1)


if __name__ == "__main__":
    main()
