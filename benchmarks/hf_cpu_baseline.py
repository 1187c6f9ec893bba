#!/usr/bin/env python3
"""Plain Hugging Face transformers baseline on CPU, for comparison with the serving engines.

    python benchmarks/hf_cpu_baseline.py MODEL_DIR [--max-new-tokens 128] [--batch 16] \
        [--threads 2] [--dtype float32] [--json out.json]

MODEL_DIR is an HF safetensors directory (e.g. the output of convert_gguf_to_hf.py). Greedy
decoding, generation forced to exactly --max-new-tokens (min_new_tokens = max_new_tokens, the
equivalent of ignore_eos). Uses the same prompts as openai_load.py.

  batch-1 decode tok/s: a streamer timestamps each generated token; rate is
      (new_tokens - 1) / (t_last_token - t_first_token), i.e. prefill excluded. Median of --repeats.
  batched output tok/s: one generate() call over --batch distinct prompts (left padded);
      batch * max_new_tokens / wall time of that call (prefill included, as for a server).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from openai_load import DEFAULT_PROMPT, concurrent_prompts  # noqa: E402


class TimingStreamer(BaseStreamer):
    """Records a timestamp for every decoding step (the first put() carries the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def load(model_dir: str, dtype: str):
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    return tok, model


def _gen_kwargs(tok, n: int) -> dict:
    return dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id,
                temperature=None, top_p=None, top_k=None)


@torch.inference_mode()
def bench_batch1(tok, model, prompt: str, n: int, repeats: int) -> dict:
    enc = tok(prompt, return_tensors="pt")
    runs = []
    for _ in range(repeats):
        st = TimingStreamer()
        t0 = time.perf_counter()
        out = model.generate(**enc, streamer=st, **_gen_kwargs(tok, n))
        t_end = time.perf_counter()
        new = out.shape[1] - enc["input_ids"].shape[1]
        decode_s = st.times[-1] - st.times[0]
        runs.append({"new_tokens": int(new), "ttft_s": st.times[0] - t0, "total_s": t_end - t0,
                     "decode_s": decode_s,
                     "decode_tok_s": (new - 1) / decode_s if new > 1 and decode_s > 0 else None})
    rates = [r["decode_tok_s"] for r in runs if r["decode_tok_s"] is not None]
    return {"decode_tok_s_median": statistics.median(rates) if rates else None,
            "decode_tok_s_all": rates, "prompt_tokens": int(enc["input_ids"].shape[1]),
            "ttft_s_median": statistics.median(r["ttft_s"] for r in runs), "runs": runs}


@torch.inference_mode()
def bench_batched(tok, model, batch: int, n: int) -> dict:
    prompts = concurrent_prompts(batch)
    enc = tok(prompts, return_tensors="pt", padding=True)
    t0 = time.perf_counter()
    out = model.generate(**enc, **_gen_kwargs(tok, n))
    wall = time.perf_counter() - t0
    new = out.shape[1] - enc["input_ids"].shape[1]
    total = int(new) * batch
    return {"batch": batch, "output_tok_s": total / wall, "total_new_tokens": total,
            "new_tokens_per_seq": int(new), "wall_s": wall,
            "padded_prompt_len": int(enc["input_ids"].shape[1])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="0 skips the batched run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    tok, model = load(args.model_dir, args.dtype)
    load_s = time.perf_counter() - t0

    # warm-up (first call allocates / initialises kernels)
    with torch.inference_mode():
        model.generate(**tok(args.prompt, return_tensors="pt"), **_gen_kwargs(tok, 8))

    res = {"system": "hf-transformers", "model_dir": os.path.abspath(args.model_dir),
           "dtype": args.dtype, "threads": args.threads, "max_new_tokens": args.max_new_tokens,
           "load_s": load_s, "torch": torch.__version__,
           "transformers": __import__("transformers").__version__,
           "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    res["batch1"] = bench_batch1(tok, model, args.prompt, args.max_new_tokens, args.repeats)
    if args.batch > 0:
        res["batched"] = bench_batched(tok, model, args.batch, args.max_new_tokens)

    b = res["batch1"]
    print(f"\nHF transformers ({args.dtype}, {args.threads} threads) on {args.model_dir}")
    print(f"{'metric':<36}{'value':>12}")
    print("-" * 48)
    print(f"{'load s':<36}{load_s:>12.1f}")
    print(f"{'batch-1 decode tok/s (median)':<36}{b['decode_tok_s_median']:>12.1f}")
    print(f"{'  runs':<36}{', '.join(f'{x:.1f}' for x in b['decode_tok_s_all']):>12}")
    print(f"{'  TTFT s (median)':<36}{b['ttft_s_median']:>12.3f}")
    if "batched" in res:
        c = res["batched"]
        print(f"{str(c['batch']) + '-batch output tok/s':<36}{c['output_tok_s']:>12.1f}")
        print(f"{'  wall s':<36}{c['wall_s']:>12.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
        print(f"\nwrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
