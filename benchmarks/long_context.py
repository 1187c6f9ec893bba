"""Long contexts on one GPU, bfloat16 against FP8 KV cache: how many tokens the cache holds, the prefill time of one
long prompt (TTFT), and decode at a large batch over long contexts, where reading the KV cache dominates a step.

    python benchmarks/long_context.py [--kv-cache-dtypes auto,fp8] [--prefill-lengths 32768,131008]
                                      [--decode-batch 64] [--decode-context 8192] [--decode-tokens 128]
                                      [--only decode] [--out FILE]

Llama-3.1-8B's shape (llama3 RoPE scaling to 131,072 positions) with random weights (--load-format dummy): speed
does not depend on the values. For each cache dtype one engine: its KV capacity in tokens; each prefill length's
prompt timed alone with one output token (after a 16k-token prompt, so compilation is not counted); then --decode-batch prompts of --decode-context tokens prefilled with one output token, and the same
prompts again with --decode-tokens + 1 (their prefixes now cached: what remains is --decode-tokens decode steps at
that batch). Beside it the card's bfloat16 matrix rate (an 8192^3 matmul), against which prefill's model FLOPs
(2 x parameters a token, plus causal attention) are a fraction. --only decode: the decode measurement alone (no
matrix rate, no prefill lengths nor their warm-up prompt). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_suite import LLAMA3_8B, random_prompts, write_model_dir  # noqa: E402
from result_file import report  # noqa: E402

LLAMA31_8B = {**LLAMA3_8B, "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}


def matmul_tflops() -> float:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * 20 / (time.perf_counter() - start) / 1e12


def prefill_flops(length: int, shape: dict) -> float:
    """Model FLOPs of one prompt: 2 x the parameters of the layers and head a token, plus causal attention (QK^T and
    PV over length / 2 keys on average)."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * shape["intermediate_size"]
    params = layers * per_layer + h * shape["vocab_size"]
    return 2 * params * length + 4 * layers * h * length * length / 2


def measure(model_dir: str, kv_dtype: str, args) -> dict:
    from shardserve.entrypoints.llm import LLM
    from shardserve.requests.sampling_params import SamplingParams

    # The decode sequences fit whole (prompt + decode tokens): a sequence stops at max_model_len, which sized by the
    # decode prompts alone (8,192 + 64) would leave them 64 of their 129 tokens.
    longest = max(args.prefill_lengths + [args.decode_context + args.decode_tokens + 1])
    with LLM(model_dir, device="cuda", dtype="bfloat16", load_format="dummy", kv_cache_dtype=kv_dtype,
             max_model_len=longest + 64, max_num_seqs=args.decode_batch, max_num_batched_tokens=8192,
             gpu_memory_utilization=0.9) as llm:
        engine = llm.engine
        out = {"kv_cache_dtype": kv_dtype,
               "kv_cache_tokens": engine.block_manager.num_blocks * engine.config.block_size}

        def timed(prompts, tokens: int) -> float:
            params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompts, params)
            return time.perf_counter() - start

        if args.prefill_lengths:
            timed(random_prompts(1, 16384, 3), 1)  # compiles the prefill kernels of every chunk shape
        for length in args.prefill_lengths:
            seconds = timed(random_prompts(1, length, 20 + length), 1)
            out[f"ttft_{length}_s"] = round(seconds, 3)
            out[f"prefill_{length}_tok_s"] = round(length / seconds, 1)
        prompts = random_prompts(args.decode_batch, args.decode_context, 7)
        out["decode_prefill_s"] = round(timed(prompts, 1), 2)
        seconds = timed(prompts, args.decode_tokens + 1)  # the prefixes are cached now: decode steps remain
        out["decode_s"] = round(seconds, 3)
        out["decode_tok_s"] = round(args.decode_batch * args.decode_tokens / seconds, 1)
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-cache-dtypes", default="auto,fp8")
    p.add_argument("--prefill-lengths", default="32768,131008")
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-context", type=int, default=8192)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--only", choices=["decode"])
    p.add_argument("--out")
    args = p.parse_args()
    args.prefill_lengths = [int(n) for n in args.prefill_lengths.split(",") if n and args.only != "decode"]

    import torch

    model_dir = write_model_dir(os.path.join(tempfile.mkdtemp(), "llama3.1-8b-shape"), LLAMA31_8B)
    result = {"device": torch.cuda.get_device_name(), "model": "llama3.1-8b (dummy weights)", "runs": []}
    if args.prefill_lengths:
        result["bf16_matmul_tflops"] = round(matmul_tflops(), 1)
    for kv_dtype in args.kv_cache_dtypes.split(","):
        run = measure(model_dir, kv_dtype, args)
        for length in args.prefill_lengths:
            run[f"prefill_{length}_of_matmul_rate"] = round(
                prefill_flops(length, LLAMA31_8B) / run[f"ttft_{length}_s"] / 1e12 / result["bf16_matmul_tflops"], 3)
        print(json.dumps(run), file=sys.stderr, flush=True)
        result["runs"].append(run)
    if len(result["runs"]) == 2:
        base, fp8 = result["runs"]
        result["fp8_over_bf16"] = {"kv_cache_tokens": round(fp8["kv_cache_tokens"] / base["kv_cache_tokens"], 2),
                                   "decode_tok_s": round(fp8["decode_tok_s"] / base["decode_tok_s"], 2)}
    report(result, args.out, print_indent=1)


if __name__ == "__main__":
    main()
