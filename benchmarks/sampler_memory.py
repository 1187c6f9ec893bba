"""The host memory one sampling step takes beyond its float32 logits, per logit, at its peak: the planner's
SAMPLER_BYTES_PER_LOGIT must cover it.

    python benchmarks/sampler_memory.py [--rows 256] [--vocab 152064] [--top-p 0.9]

The figure is the growth of the process's peak resident memory over one Sampler.sample of [rows, vocab] logits
with temperature 0.8, after a warm-up on two rows: the peak (VmHWM) is reset to the current resident memory
just before (Linux; ru_maxrss would not do: a process started from a large one inherits its peak across exec).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json


def peak_bytes_per_logit(rows: int, vocab: int, top_p: float) -> float:
    import torch

    from shardserve.engine.sampler import Sampler
    from shardserve.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    logits = torch.randn(rows, vocab)
    params = [SamplingParams(temperature=0.8, top_p=top_p, max_tokens=4)] * rows
    sampler = Sampler(0)
    sampler.sample(logits[:2].clone(), [0, 1], params[:2])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident memory back to the current one
    before = _status_kib("VmRSS")
    sampler.sample(logits, list(range(rows)), params)
    return (_status_kib("VmHWM") - before) * 1024 / (rows * vocab)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--top-p", type=float, default=0.9)
    args = p.parse_args()
    print(json.dumps({"rows": args.rows, "vocab": args.vocab, "top_p": args.top_p,
                      "peak_bytes_per_logit": round(peak_bytes_per_logit(args.rows, args.vocab, args.top_p), 1)}))


if __name__ == "__main__":
    main()
