"""Hugging Face config.json contents of real models, for the tests that plan or check without weights; and a tiny
model's config.json with some keys changed."""

import json
import os

LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def config_with(model_dir: str, tmp_path, **changes) -> str:
    """A directory (tmp_path) holding model_dir's config.json with `changes` applied: for a test of the config alone."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(tmp_path)
