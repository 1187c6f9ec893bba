"""Pipeline against tensor parallelism on CPU ranks: KV capacity at one --kv-cache-memory, and offline throughput of
16 requests at once, at TP=1, PP=2 and TP=2 (2 ranks each where more than one).

    python benchmarks/pipeline_cpu.py MODEL_DIR [--kv-cache-memory 0.02] [--max-model-len 4096]

For each layout: whether --max-model-len fits the KV cache (start-up refuses it otherwise), the blocks each rank
holds, and 16 requests of 128 prompt + 64 new tokens: tokens/s. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.cpu_online_vs_offline import timed_generate  # noqa: E402


def run(model: str, tp: int, pp: int, kv_gb: float, max_model_len: int, requests: int, input_len: int,
        output_len: int) -> dict:
    from shardserve import LLM

    layout = {"tp": tp, "pp": pp}
    try:
        llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, device="cpu", dtype="float32",
                  kv_cache_memory_gb=kv_gb, max_model_len=max_model_len, max_num_seqs=requests)
    except ValueError as e:
        return {**layout, "fits": False, "error": str(e).splitlines()[0]}
    with llm:
        blocks = llm.engine.block_manager.num_blocks
        tokens, seconds = timed_generate(llm, requests, input_len, output_len)
    return {**layout, "fits": True, "kv_blocks": blocks, "kv_tokens": blocks * 16, "seconds": round(seconds, 2),
            "output_tokens_per_s": round(tokens / seconds, 1),
            "total_tokens_per_s": round((tokens + requests * input_len) / seconds, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--kv-cache-memory", type=float, default=0.02, help="GiB a rank")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--layouts", default="1x1,1x2,2x1", help="TPxPP, comma-separated")
    args = p.parse_args()
    results = []
    for layout in args.layouts.split(","):
        tp, pp = map(int, layout.split("x"))
        results.append(run(args.model, tp, pp, args.kv_cache_memory, args.max_model_len, args.requests,
                           args.input_len, args.output_len))
        print(json.dumps(results[-1]), file=sys.stderr)
    print(json.dumps({"model": args.model, "kv_cache_memory_gb": args.kv_cache_memory,
                      "max_model_len": args.max_model_len, "results": results}, indent=2))


if __name__ == "__main__":
    main()
