"""Where the engine's host time goes at a large batch: cProfile over one `LLM.generate` of N requests.

    python benchmarks/profile_host.py [--requests 256] [--prompt 64] [--output 64] [--device cpu]

On CPUs it uses a tiny random Llama (the tests' model) so that the model's own compute stays small beside
the host work being profiled; on GPUs pass --model-dir for a real-shape model with --load-format dummy.
Prints the wall time and the functions with the most time of their own.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model-dir", default=None, help="default: a tiny random Llama written to a temporary folder")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()

    from shardserve import LLM, SamplingParams

    model_dir = args.model_dir
    if model_dir is None:
        from tests.tiny_models import TINY_SPECS, make_tiny_model

        model_dir = make_tiny_model(TINY_SPECS["llama-untied"], os.path.join(tempfile.mkdtemp(), "tiny"))
    llm = LLM(model_dir, device=args.device, load_format=args.load_format, max_num_seqs=args.requests,
              max_num_batched_tokens=8192, max_model_len=args.prompt + args.output + 16,
              kv_cache_memory_gb=None if args.device == "cuda" else 0.5)
    prompts = [[(i * 7 + j) % 900 + 5 for j in range(args.prompt)] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    llm.generate(prompts[:8], params)  # warm up
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params)
    profiler.disable()
    wall = time.perf_counter() - started
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
    print(f"{args.requests} requests x ({args.prompt} + {args.output}) tokens: {wall:.2f} s wall "
          f"(under cProfile)\n{text.getvalue()}")
    llm.shutdown()


if __name__ == "__main__":
    main()
