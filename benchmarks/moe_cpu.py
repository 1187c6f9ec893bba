"""A mixture of experts against a dense model with the same active parameters, served on CPU ranks: time per
decoded token.

    python benchmarks/moe_cpu.py [--tp 2] [--batch 1,8] [--tokens 64]

The MoE is Qwen3-MoE-shaped (8 experts, top 2, expert features F); the dense model is Qwen3 with 2F MLP features,
so a token reads the same weights in both (attention, the two chosen experts' FFNs or the one MLP, embeddings);
the MoE adds its router and the grouping of tokens by expert. Both use random weights (--load-format dummy),
float32, on TP ranks of this machine. Prints one JSON object: milliseconds per decode step (median over the
run's steps after the first) per model and batch, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMMON = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
          "head_dim": 64, "vocab_size": 8192, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
          "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "float32", "eos_token_id": 2}
EXPERT_FEATURES = 512


def model_dirs(root: str) -> dict[str, str]:
    from tokenizers import Tokenizer, models, pre_tokenizers

    shapes = {
        "moe": {**COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "intermediate_size": 2 * EXPERT_FEATURES, "moe_intermediate_size": EXPERT_FEATURES,
                "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
                "mlp_only_layers": []},
        "dense": {**COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                  "intermediate_size": 2 * EXPERT_FEATURES},
    }
    dirs = {}
    for name, shape in shapes.items():
        path = os.path.join(root, name)
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(shape, f)
        tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(shape["vocab_size"])}, unk_token="t0"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer.save(os.path.join(path, "tokenizer.json"))
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t2", "unk_token": "t0"}, f)
        dirs[name] = path
    return dirs


def step_ms(llm, batch: int, tokens: int) -> float:
    from shardserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", [5 + i, 6, 7, 8], params)
    times = []
    while engine.has_work():
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[2:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()

    from shardserve import LLM

    batches = [int(b) for b in args.batch.split(",")]
    results: dict = {"tp": args.tp, "tokens": args.tokens}
    with tempfile.TemporaryDirectory() as root:
        for name, path in model_dirs(root).items():
            with LLM(path, tensor_parallel_size=args.tp, device="cpu", load_format="dummy", dtype="float32",
                     kv_cache_memory_gb=0.2) as llm:
                step_ms(llm, 1, 8)  # warm up
                for batch in batches:
                    results[f"{name}_batch{batch}_ms_per_step"] = round(step_ms(llm, batch, args.tokens), 3)
    for batch in batches:
        results[f"moe_over_dense_batch{batch}"] = round(
            results[f"moe_batch{batch}_ms_per_step"] / results[f"dense_batch{batch}_ms_per_step"], 3)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
