"""A symmetric 4-bit GPTQ checkpoint decoded on CPU ranks: its groups read as Q4_0 blocks (blockq-decode) against
the float32 values through oneDNN; milliseconds per decode step.

    python benchmarks/gptq_cpu.py [--tp 1,2] [--tokens 48] [--group 128]

The model is a Llama shape (hidden 1024, 8 layers, 16 heads of 64 over 4 KV heads, 2816 MLP features,
vocabulary 8192) with random weights, quantized here (round to nearest, the tests' GPTQ writer) and loaded as
a checkpoint; batch 1, float32 activations. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
         "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 2816,
         "vocab_size": 8192, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
         "tie_word_embeddings": False, "torch_dtype": "float32", "eos_token_id": 2}


def float_checkpoint(path: Path) -> str:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True)
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{k: v for k, v in SHAPE.items() if k != "architectures"})
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(SHAPE["vocab_size"])}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "eos_token": "t2", "unk_token": "t0"}))
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", default="1,2")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--group", type=int, default=128, choices=[32, 64, 128])
    args = p.parse_args()

    from benchmarks.moe_cpu import step_ms
    from shardserve import LLM
    from tests.weights import test_quantized_checkpoints as writer

    scheme = f"gptq-sym-g{args.group}"
    writer.SCHEMES[scheme] = ({"quant_method": "gptq", "bits": 4, "group_size": args.group, "sym": True,
                               "desc_act": False, "checkpoint_format": "gptq"},
                              lambda w, seed: writer.gptq(w, args.group, sym=True, act_order=False, seed=seed))
    results: dict = {"shape": "llama hidden 1024 x 8 layers, 2816 MLP", "scheme": scheme, "tokens": args.tokens}
    with tempfile.TemporaryDirectory() as root:
        source = float_checkpoint(Path(root) / "float")
        quant_dir, _ = writer.write_quantized(source, scheme, Path(root) / "q")
        for tp in (int(t) for t in args.tp.split(",")):
            for kernel in ("blockq-decode", "onednn-packed"):
                os.environ["SHARDSERVE_LINEAR_KERNEL"] = kernel
                with LLM(quant_dir, tensor_parallel_size=tp, device="cpu", dtype="float32",
                         kv_cache_memory_gb=0.2) as llm:
                    step_ms(llm, 1, 8)  # warm up
                    results[f"tp{tp}_{kernel}_ms_per_step"] = round(step_ms(llm, 1, args.tokens), 3)
            results[f"tp{tp}_speedup"] = round(results[f"tp{tp}_onednn-packed_ms_per_step"]
                                               / results[f"tp{tp}_blockq-decode_ms_per_step"], 3)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
