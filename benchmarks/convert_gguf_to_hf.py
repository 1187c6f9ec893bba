#!/usr/bin/env python3
"""Convert a GGUF checkpoint into a plain Hugging Face safetensors directory.

    python benchmarks/convert_gguf_to_hf.py MODEL.gguf OUT_DIR [--dtype float32|bfloat16|float16]

The GGUF weights are dequantized by transformers while loading, so the output is an ordinary
unquantized checkpoint (config.json, model.safetensors, generation_config.json) plus the tokenizer
files, with the chat template kept in tokenizer_config.json. Reference servers that cannot read
GGUF (vLLM's CPU build, plain transformers) can then load the same weights.

Needs transformers, torch, gguf and accelerate.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _make_portable(out_dir: str) -> None:
    """Rewrite the saved json so that readers using older transformers (4.x, as bundled by other
    serving engines) load the checkpoint the same way transformers 5 does."""
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    # transformers 5 nests rope settings under rope_parameters; 4.x reads top-level rope_theta and
    # would silently fall back to its default base without it.
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in cfg:
        cfg["rope_theta"] = rope["rope_theta"]
    if rope and rope.get("rope_type", "default") != "default" and "rope_scaling" not in cfg:
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if "dtype" in cfg and "torch_dtype" not in cfg:
        cfg["torch_dtype"] = cfg["dtype"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)

    tok_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(tok_path) as f:
        tok_cfg = json.load(f)
    # "TokenizersBackend" only exists in transformers 5; PreTrainedTokenizerFast reads tokenizer.json
    # in every version. Drop load-time bookkeeping keys that are not tokenizer settings.
    if tok_cfg.get("tokenizer_class") in (None, "TokenizersBackend"):
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("backend", "is_local", "local_files_only"):
        tok_cfg.pop(key, None)
    with open(tok_path, "w") as f:
        json.dump(tok_cfg, f, indent=2, ensure_ascii=False)


def convert(gguf_path: str, out_dir: str, dtype: str = "float32") -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = os.path.abspath(gguf_path)
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(gguf_path)
    src_dir, gguf_file = os.path.split(gguf_path)
    torch_dtype = getattr(torch, dtype)

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_file, dtype=torch_dtype)
    # Loading from GGUF attaches a quantizer/quantization_config; drop it so the saved checkpoint
    # reads as an ordinary dense model.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if getattr(model.config, "quantization_config", None) is not None:
        try:
            del model.config.quantization_config
        except AttributeError:
            model.config.quantization_config = None
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)

    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
    tok.save_pretrained(out_dir)

    # Make sure the chat template ended up in tokenizer_config.json (newer transformers may write it
    # to a separate chat_template.jinja file, which older readers ignore).
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        tok_cfg = json.load(f)
    template = getattr(tok, "chat_template", None)
    if not template:
        jinja = os.path.join(out_dir, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja) as f:
                template = f.read()
    if template and tok_cfg.get("chat_template") != template:
        tok_cfg["chat_template"] = template
        with open(cfg_path, "w") as f:
            json.dump(tok_cfg, f, indent=2, ensure_ascii=False)
    if not tok_cfg.get("chat_template"):
        print("warning: no chat template found in the GGUF metadata", file=sys.stderr)

    _make_portable(out_dir)

    n_params = sum(p.numel() for p in model.parameters())
    print(f"converted {gguf_path} -> {out_dir}: {n_params / 1e6:.1f}M params, {dtype}, "
          f"chat_template={'yes' if tok_cfg.get('chat_template') else 'no'}, "
          f"{time.perf_counter() - t0:.1f}s")
    return out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", help="path to the .gguf file")
    ap.add_argument("out_dir", help="output directory (created if missing)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    convert(args.gguf, args.out_dir, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
