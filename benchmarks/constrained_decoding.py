"""What logits processing and structured outputs cost a running engine: time per engine step at a large batch,
for the same requests decoded plainly, with every logits processor, and under a JSON schema.

    python benchmarks/constrained_decoding.py --tokenizer DIR [--batch 256] [--prompt 128] [--output 128]

The model is Llama-3-8B's shape with random weights (--load-format dummy: speed does not depend on values) and
the tokenizer of DIR (a Hugging Face tokenizer directory: the grammar engine needs real text tokens; its
vocabulary may be smaller than the model's, whose extra ids the grammar never allows). Each mode runs --batch
requests of --prompt random tokens together; plain and processed ones generate exactly --output tokens
(ignore_eos), constrained ones until their JSON is complete. Reported per mode: milliseconds per engine step
(wall time over steps, prefill included), output tokens per second, and steps queued ahead. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_suite import LLAMA3_8B  # noqa: E402

# An order of records: the grammar is at work for the whole output (strings, numbers, enums, nesting).
SCHEMA = {"type": "object", "properties": {"orders": {"type": "array", "minItems": 6, "maxItems": 6, "items": {
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "customer": {"type": "string", "maxLength": 16},
        "status": {"enum": ["open", "shipped", "returned"]},
        "total": {"type": "integer", "minimum": 0, "maximum": 1000}},
    "required": ["id", "customer", "status", "total"], "additionalProperties": False}}},
    "required": ["orders"], "additionalProperties": False}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--config", default=None, help="a config.json other than Llama-3-8B's (a quick run on a CPU)")
    args = p.parse_args()

    from shardserve import LLM, SamplingParams
    from shardserve.engine.structured_output import StructuredOutputs
    from shardserve.requests.sampling_params import StructuredOutput

    model_dir = tempfile.mkdtemp(prefix="constrained-")
    shape = LLAMA3_8B
    if args.config:
        with open(args.config) as f:
            shape = json.load(f)
    with open(os.path.join(args.tokenizer, "tokenizer_config.json")) as f:
        eos_token = json.load(f).get("eos_token")
    if eos_token is not None:  # the tokenizer's end of sequence, not Llama-3's (past this vocabulary)
        with open(os.path.join(args.tokenizer, "tokenizer.json")) as f:
            added = {t["content"]: t["id"] for t in json.load(f).get("added_tokens", [])}
        shape = {**shape, "eos_token_id": added.get(eos_token, shape.get("eos_token_id"))}
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(shape, f)
    for name in os.listdir(args.tokenizer):
        shutil.copy(os.path.join(args.tokenizer, name), model_dir)

    plain = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    modes = {
        "plain": plain,
        "all_processors": SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True, min_p=0.05,
                                         repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2,
                                         logit_bias=((1, 2.0), (2, -5.0))),
        "json_schema": SamplingParams(max_tokens=4 * args.output, temperature=0.8, seed=1,
                                      structured=StructuredOutput("json", json.dumps(SCHEMA))),
        "plain_sampled": SamplingParams(max_tokens=args.output, temperature=0.8, seed=1, ignore_eos=True),
        "plain_again": plain,  # the first mode once more: what changed over the run, beside the differences
    }
    import torch

    g = torch.Generator().manual_seed(0)  # ids the tokenizer has (the grammar engine reads them as text)
    prompts = torch.randint(1000, 40000, (args.batch, args.prompt), generator=g).tolist()
    results: dict = {"batch": args.batch, "prompt": args.prompt, "output": args.output}
    mask_times: list[float] = []
    original_allowed = StructuredOutputs.allowed

    def timed_allowed(self, seq_ids):
        started = time.perf_counter()
        try:
            return original_allowed(self, seq_ids)
        finally:
            mask_times.append(time.perf_counter() - started)

    StructuredOutputs.allowed = timed_allowed
    from shardserve.engine.llm_engine import LLMEngine

    launches = [0]
    original_launch = LLMEngine._launch

    def counted_launch(self, plan, device_tokens=None):
        launches[0] += 1
        return original_launch(self, plan, device_tokens)

    LLMEngine._launch = counted_launch
    with LLM(model_dir, device=args.device, load_format="dummy", max_num_seqs=args.batch,
             max_num_batched_tokens=max(8192, args.batch * 8)) as llm:
        engine = llm.engine
        for name, params in modes.items():
            for warm in (True, False):  # the whole batch first for a few tokens: graphs, allocations, caches
                mask_times.clear()
                steps, overlapped = launches[0], engine.steps_overlapped
                started = time.perf_counter()
                outputs = llm.generate(prompts, dataclasses.replace(params, max_tokens=8) if warm else params)
                elapsed = time.perf_counter() - started
            steps = launches[0] - steps
            tokens = sum(len(o.token_ids) for o in outputs)
            results[name] = {"ms_per_step": round(1000 * elapsed / steps, 3), "steps": steps,
                             "output_tok_s": round(tokens / elapsed, 1), "output_tokens": tokens,
                             "steps_overlapped": engine.steps_overlapped - overlapped}
            if name == "json_schema":
                valid = sum(_conforms(o.text) for o in outputs)
                results[name].update(conforming=valid, finished_stop=sum(o.finish_reason == "stop" for o in outputs),
                                     mask_ms_median=round(1000 * sorted(mask_times)[len(mask_times) // 2], 3))
            print(name, results[name], file=sys.stderr, flush=True)
    base = results["plain"]["ms_per_step"]
    for name in modes:
        results[name]["vs_plain"] = round(results[name]["ms_per_step"] / base, 3)
    print(json.dumps(results))


def _conforms(text: str) -> bool:
    """SCHEMA checked by hand (the GPU machine has no jsonschema)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    orders = value.get("orders") if isinstance(value, dict) and set(value) == {"orders"} else None
    return isinstance(orders, list) and len(orders) == 6 and all(
        isinstance(o, dict) and set(o) == {"id", "customer", "status", "total"}
        and type(o["id"]) is int and 0 <= o["id"] <= 99999
        and isinstance(o["customer"], str) and len(o["customer"]) <= 16
        and o["status"] in ("open", "shipped", "returned")
        and type(o["total"]) is int and 0 <= o["total"] <= 1000 for o in orders)


if __name__ == "__main__":
    main()
