"""What the per-request logits processing costs the sampler at a large batch: Sampler.enqueue + resolve over
one batch of logits, without processing and with every processor on every row.

    python benchmarks/sampler_cost.py [--device cuda] [--batch 256] [--vocab 128256] [--history 640]

The first of the timed steps of a mode meets its sequences for the first time (prompts counted then); the
median is a step of a running batch, where each row adds the one token it generated since.

Prints one JSON object (milliseconds per sampling step, median of --repeats). On GPUs compare it with the
decode step of the same batch (docs/benchmarks-notebook.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--history", type=int, default=640, help="prompt + output tokens per row")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()

    import torch

    from shardserve.engine.sampler import RowHistory, Sampler
    from shardserve.requests.sampling_params import SamplingParams

    rng = random.Random(0)
    device = torch.device(args.device)
    logits = torch.randn(args.batch, args.vocab, device=device, dtype=torch.bfloat16)
    prompts = [[rng.randrange(args.vocab) for _ in range(args.history // 2)] for _ in range(args.batch)]
    outputs = [[rng.randrange(args.vocab) for _ in range(args.history // 2)] for _ in range(args.batch)]
    processing = dict(min_p=0.05, min_tokens=4096, repetition_penalty=1.1, presence_penalty=0.3,
                      frequency_penalty=0.2, logit_bias=((1, 2.0), (2, -5.0)))
    modes = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, top_p=0.95)}
    sampler = Sampler(seed=0, eos_token_ids=(0,))

    def step_ms(params) -> float:
        """Each step, as in decoding: every row has one token more than at its previous step."""
        times = []
        for _ in range(args.repeats + 3):
            for output in outputs:
                output.append(rng.randrange(args.vocab))
            histories = [RowHistory(prompt, output, len(output)) for prompt, output in zip(prompts, outputs)]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            sampler.resolve(sampler.enqueue(logits, seq_ids, params, histories))
            times.append((time.perf_counter() - started) * 1000)
        return statistics.median(times[3:])

    result = {"device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
              "batch": args.batch, "vocab": args.vocab, "history": args.history}
    for i, (mode, sampling) in enumerate(modes.items()):
        seq_ids = [i * args.batch + j for j in range(args.batch)]  # new sequences for each mode
        plain = step_ms([SamplingParams(max_tokens=4096, **sampling)] * args.batch)
        processed = step_ms([SamplingParams(max_tokens=4096, **sampling, **processing)] * args.batch)
        result[mode] = {"plain_ms": round(plain, 3), "all_processors_ms": round(processed, 3),
                        "extra_ms": round(processed - plain, 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
