"""Where offline throughput goes: GPU time per kernel family and the host's share, for a Llama-3-8B-shaped
model (random bf16 weights) on one GPU or, with --tp N, on N (rank 0's GPU is profiled).

    python benchmarks/profile_offline.py [--requests 512 --prompt 512 --output 64 --tp 1]

Runs the workload once to warm up, then once under torch.profiler; prints wall time, the summed GPU kernel
time (the rest is the device idling while the host works), and the kernels with the most GPU time.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_suite import random_prompts, write_model_dir  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (rank 0, in this process, is profiled)")
    args = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from shardserve.entrypoints.llm import LLM
    from shardserve.requests.sampling_params import SamplingParams

    model_dir = write_model_dir(os.path.join(tempfile.mkdtemp(), "llama3-8b-shape"))
    llm = LLM(model_dir, tensor_parallel_size=args.tp, device="cuda", dtype="bfloat16", load_format="dummy",
              max_model_len=2048, max_num_seqs=args.requests, max_num_batched_tokens=8192)
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate(random_prompts(args.requests, args.prompt, 1), params)  # warm up
    prompts = random_prompts(args.requests, args.prompt, 2)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernels = collections.Counter()
    calls = collections.Counter()
    for event in prof.events():
        if event.device_type.name == "CUDA":
            name = event.name[:90]
            kernels[name] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            calls[name] += 1
    gpu_s = sum(kernels.values()) / 1e6
    print(f"{args.requests} x ({args.prompt} + {args.output}): wall {wall:.2f} s, "
          f"{args.requests * args.output / wall:.0f} output tok/s; GPU kernels {gpu_s:.2f} s "
          f"({100 * gpu_s / wall:.0f}% of wall)")
    for name, us in kernels.most_common(30):
        print(f"{us / 1e6:8.3f} s {calls[name]:7d} x  {name}")
    llm.shutdown()


if __name__ == "__main__":
    main()
