"""How often a greedy request's tokens differ alone and inside a batch, and by how much the two top logits
were apart where they first differ (a near-tie that a different rounding flips).

    python benchmarks/batch_invariance.py MODEL [--device cpu|cuda] [--dtype auto|bfloat16|float32]
        [--tp N] [--prompts 16] [--tokens 32] [--load-format auto|dummy]

MODEL is a checkpoint directory or .gguf. Prompts are random token ids (fixed seed), so the figure does
not depend on a tokenizer; `ignore_eos` makes every request generate --tokens tokens.
"""

from __future__ import annotations

import argparse
import json

import torch

from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> list[tuple[list[int], list]]:
    """Every prompt to completion, batched together: (token ids, per-token logprobs) in prompt order."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        llm.engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {i: [] for i in ids}
    while llm.engine.has_work():
        for out in llm.engine.step():
            logprobs[out.request_id].extend(out.new_logprobs or [])
            if out.finished:
                tokens[out.request_id] = out.token_ids
    return [(tokens[i], logprobs[i]) for i in ids]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    args = p.parse_args()
    options = dict(tensor_parallel_size=args.tp, device=args.device, dtype=args.dtype, max_model_len=512,
                   load_format=args.load_format)
    if args.device == "cpu":
        options["kv_cache_memory_gb"] = 0.5
    with LLM(args.model, **options) as llm:
        vocab = llm.engine.runner.model_config.vocab_size
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(10, vocab, (int(n),), generator=g).tolist()
                   for n in torch.randint(8, 120, (args.prompts,), generator=g)]
        greedy = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, logprobs=2)
        batched = run(llm, prompts, greedy, "batched")
        alone = [run(llm, [prompt], greedy, f"alone{i}")[0] for i, prompt in enumerate(prompts)]
        plan = getattr(llm.engine.runner, "plan", None)
        plan = plan.describe() if plan is not None else f"{llm.engine.runner.dtype} (before the kernel plan)"
    differing, margins = 0, []
    for (a, a_logprobs), (b, _) in zip(alone, batched):
        if a == b:
            continue
        differing += 1
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        top = [logprob for _, logprob in a_logprobs[i].top] if i < len(a_logprobs) else []
        margins.append(round(top[0] - top[1], 5) if len(top) > 1 else None)
    print(json.dumps({"model": args.model, "plan": plan, "prompts": args.prompts, "tokens": args.tokens,
                      "differing_requests": differing, "top2_logprob_gap_where_they_first_differ": margins}))


if __name__ == "__main__":
    main()
