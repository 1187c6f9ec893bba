"""The host memory one sampling step takes beyond its float32 logits, per logit, at its peak: the planner's
SAMPLER_BYTES_PER_LOGIT must cover it.

    python benchmarks/sampler_memory.py [--rows 256] [--vocab 152064] [--top-p 0.9] [--logprobs 20] [--penalty]

The figure is the growth of the process's peak resident memory over one Sampler.sample of [rows, vocab] logits
with temperature 0.8, after a warm-up on two rows: the peak (VmHWM) is reset to the current resident memory
just before (Linux; ru_maxrss would not do: a process started from a large one inherits its peak across exec).
--logprobs and --penalty (a frequency penalty, each row with a 64-token history) ask for those on every row.
Prints one JSON object: the peak per logit of the step, and what the planner reserves for the same rows and
vocabulary beyond the logits (planner.sampling_bytes, and with --penalty the token counts), per logit.
"""

from __future__ import annotations

import argparse
import json


def peak_bytes_per_logit(rows: int, vocab: int, top_p: float, logprobs: int | None = None,
                         penalty: bool = False) -> float:
    import torch

    from shardserve.engine.sampler import RowHistory, Sampler
    from shardserve.requests.sampling_params import SamplingParams

    torch.set_num_threads(1)
    logits = torch.randn(rows, vocab)
    params = [SamplingParams(temperature=0.8, top_p=top_p, max_tokens=4, logprobs=logprobs,
                             frequency_penalty=0.5 if penalty else 0.0)] * rows
    histories = [RowHistory(prompt_token_ids=list(range(r, r + 64)), output_token_ids=[r], num_generated=1)
                 for r in range(rows)] if penalty else None
    sampler = Sampler(0)
    sampler.sample(logits[:2].clone(), [0, 1], params[:2], histories[:2] if histories else None)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident memory back to the current one
    before = _status_kib("VmRSS")
    sampler.sample(logits, list(range(rows)), params, histories)
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
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--penalty", action="store_true")
    args = p.parse_args()
    from shardserve.engine.sampler import TokenCounts
    from shardserve.planner import sampling_bytes

    measured = peak_bytes_per_logit(args.rows, args.vocab, args.top_p, args.logprobs, args.penalty)
    # The penalties' token counts grow to the step's rows during the measured step: the planner counts them too.
    planned = sampling_bytes(args.rows, args.vocab) + (TokenCounts.peak_bytes(args.rows, args.vocab)
                                                       if args.penalty else 0)
    print(json.dumps({"rows": args.rows, "vocab": args.vocab, "top_p": args.top_p, "logprobs": args.logprobs,
                      "penalty": args.penalty, "peak_bytes_per_logit": round(measured, 1),
                      "planned_bytes_per_logit": round(planned / (args.rows * args.vocab), 1)}))


if __name__ == "__main__":
    main()
