"""Speculative decoding with n-gram proposals on a CPU: SmolLM2-135M-Instruct answering prompts that quote their
context (repeat a passage, edit code, continue a list), greedy, one request at a time (batch 1, where proposals
pay) and all at once, with and without `--speculative-config`.

    python benchmarks/speculative_cpu.py models/SmolLM2-135M-Instruct.Q4_1.gguf [--k 3] [--tokens 128] [--out FILE]

Reports output tokens a second, the acceptance rate (accepted / proposed tokens) and the mean tokens a verified step
adds, and checks the two runs give the same tokens. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.result_file import report  # noqa: E402

PASSAGE = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
           "members agreed to increase funding for the library, to repair the roof of the town hall, and to hire "
           "two new teachers for the primary school. The chair thanked everyone for their patience.")
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
TASKS = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rename the function total_price to order_total in this code and return the whole code:\n\n{CODE}",
    f"Summarize this text, quoting its most important sentence:\n\n{PASSAGE}",
    "Count from 1 to 40, separated by commas.",
]


def run(model: str, k: int | None, tokens: int, one_at_a_time: bool) -> dict:
    from shardserve import LLM, SamplingParams

    options = {} if k is None else {"speculative_config": {"method": "ngram", "num_speculative_tokens": k}}
    with LLM(model, device="cpu", kv_cache_memory_gb=0.2, max_model_len=1024, **options) as llm:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in TASKS]
        params = SamplingParams(max_tokens=tokens, temperature=0)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        started = time.perf_counter()
        if one_at_a_time:
            outputs = [llm.generate([p], params)[0] for p in prompts]
        else:
            outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - started
        stats = llm.engine.stats()
    generated = sum(len(o.token_ids) for o in outputs)
    result = {"tokens": generated, "seconds": round(seconds, 2), "tok_s": round(generated / seconds, 1),
              "token_ids": [list(o.token_ids) for o in outputs]}
    if k is not None:
        result.update(acceptance=round(stats.spec_accepted_tokens / max(stats.spec_draft_tokens, 1), 3),
                      tokens_per_verified_step=round(1 + stats.spec_accepted_tokens / max(stats.spec_drafts, 1), 2),
                      proposed=stats.spec_draft_tokens, accepted=stats.spec_accepted_tokens)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens (default 3)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out")
    args = p.parse_args()
    report = {}
    for mode, one in (("batch 1", True), ("all at once", False)):
        plain, spec = run(args.model, None, args.tokens, one), run(args.model, args.k, args.tokens, one)
        same = plain.pop("token_ids") == spec.pop("token_ids")
        report[mode] = {"without": plain, "ngram": spec, "same_tokens": same,
                        "speedup": round(spec["tok_s"] / plain["tok_s"], 2)}
        print(mode, json.dumps(report[mode]), file=sys.stderr)
    report(report, args.out)


if __name__ == "__main__":
    main()
