"""Speculative decoding with a draft model on one GPU, batch-1 greedy decode, dummy weights (speed does not depend on
the values; gpu_suite.py's shapes and model directories):

1. the upper bound: a Llama-3-8B-shaped target whose draft is itself (its own directory: the same weights, so every
   proposal is accepted): tokens/s without speculation and at k = 1, 2, 3, 4;
2. the overhead at acceptance ~0: a Llama-3.2-1B-shaped target with a draft of the same shape in another directory
   (dummy weights of another seed, which agree on almost nothing), at k = 1 and 3;
3. the 8B target with the 1B-shaped draft at --k: tokens/s at acceptance ~0 (as it comes) and 1 (every proposal
   taken: the tokens are then the draft's, only the time counts), what a step of k proposals costs in steps without
   speculation, and the acceptance at which speculation breaks even: where (1 - a^(k+1)) / (1 - a), the tokens a
   step adds, equals that cost.

    python benchmarks/speculative_gpu.py                       # one GPU (nine engines: about 2.5 minutes on an
                                                               # H200, start-ups included)
    python benchmarks/speculative_gpu.py --device cpu --tiny   # the same runs on tiny shapes: a CPU smoke test
                                                               # (about 35 s on 2 cores; its numbers mean nothing)

Requests never stop proposing (the break-even rule is off: these runs measure the steps). Decode tokens/s are
(288 - 32) / (the time of 288 tokens - that of 32) after a warm-up, the median of the repeats; each line prints the
bandwidth it implies for the target's weights (read once a token without speculation). Any error stops the script
with its traceback; so does a draft equal to the target with under half its proposals accepted. Writes
benchmarks/results/speculative-draft-<device>-<YYYYMMDD>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from gpu_suite import SHAPES, commit_id, device_kind, weight_bytes, write_model_dir  # noqa: E402

# Llama-3.2-1B's shape (its embedding tied to the LM head), at the 8B shape's context and RoPE.
LLAMA32_1B = {**SHAPES["llama3-8b"], "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True}
# --tiny: the same two roles in shapes a CPU runs in seconds.
TINY_TARGET = {**SHAPES["llama3-8b"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096}
TINY_DRAFT = {**TINY_TARGET, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "tie_word_embeddings": True}
UPPER_BOUND_K = (1, 2, 3, 4)
PARTS = ("upper", "overhead", "draft")  # the three runs of the module docstring, in its order
OVERHEAD_K = (1, 3)
PROMPT_LEN, SHORT, LONG = 128, 32, 288
MAX_MODEL_LEN = 1024
# A draft equal to the target under this acceptance is broken (a wrong cache gives about 0); above it, bf16 verification
# of k + 1 rows in one pass may round a near-tie of random weights otherwise than the draft's one-row passes.
EQUAL_DRAFT_MIN_ACCEPTANCE = 0.5


def build(target: str, args, draft: str | None = None, k: int = 0):
    """An engine of `target` (speculating with `draft` at k) whose requests never stop proposing; (LLM, start-up s)."""
    from shardserve.entrypoints.llm import LLM

    started = time.perf_counter()
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k} if draft else None
    llm = LLM(target, device=args.device, dtype=args.dtype, load_format="dummy", max_model_len=MAX_MODEL_LEN,
              max_num_seqs=4, kv_cache_memory_gb=args.kv_cache_gb, speculative_config=spec)
    if llm.engine.proposer is not None:
        llm.engine.proposer.break_even = 0.0
    return llm, time.perf_counter() - started


def close(llm) -> None:
    """Shut an engine down and give its device memory back before the next one starts."""
    llm.shutdown()
    del llm
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode(llm, args) -> dict:
    """Batch-1 greedy decode: tokens/s (median and samples), and the speculation counters over the timed runs."""
    import torch

    from shardserve.requests.sampling_params import SamplingParams

    prompt = [list(range(1000, 1000 + args.prompt_len))]
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def run(tokens: int) -> tuple[float, list[int]]:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, detokenize=False)
        sync()
        started = time.perf_counter()
        [out] = llm.generate(prompt, params)
        sync()
        assert len(out.token_ids) == tokens, f"{len(out.token_ids)} tokens of {tokens}"
        return time.perf_counter() - started, list(out.token_ids)

    run(8)  # warm up (and fill the prefix cache: every timed run skips the same prefill)
    before = llm.engine.stats()
    samples, tokens = [], []
    for _ in range(args.repeats):
        short, _ = run(args.short)
        long, tokens = run(args.long)
        samples.append((args.long - args.short) / (long - short))
    after = llm.engine.stats()
    drafts = after.spec_drafts - before.spec_drafts
    proposed = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    out = {"tok_s": statistics.median(samples), "samples": [round(s, 1) for s in samples], "token_ids": tokens}
    if drafts:
        out.update(acceptance=accepted / proposed, tokens_per_step=1 + accepted / drafts, verified_steps=drafts)
    elif llm.engine.proposer is not None:
        raise RuntimeError("a speculating engine made no proposals in the timed runs")
    return out


@contextlib.contextmanager
def every_proposal_accepted():
    """Greedy verification takes every proposal and then the target's next token (acceptance 1: the tokens are the
    draft's, the steps those of a draft that is always right)."""
    from shardserve.engine import speculative

    real = speculative.accepted_tokens
    speculative.accepted_tokens = lambda drafts, targets: drafts + [targets[len(drafts)]]
    try:
        yield
    finally:
        speculative.accepted_tokens = real


def measured(target: str, args, draft: str | None = None, k: int = 0, forced: bool = False) -> dict:
    """decode() of one engine, built and shut down here; with `forced` a second run at acceptance 1."""
    llm, startup = build(target, args, draft, k)
    try:
        result = {"k": k, "startup_s": round(startup, 1), **decode(llm, args)}
        if forced:
            with every_proposal_accepted():
                result["accepted_all"] = decode(llm, args)
    finally:
        close(llm)
    return result


def report(name: str, result: dict, target_bytes: int, plain_tok_s: float | None = None) -> None:
    """One line: tokens/s, the bandwidth it implies for the target's weights, and the speculation counters."""
    line = f"{name:<34} {result['tok_s']:8.1f} tok/s  {result['tok_s'] * target_bytes / 1e9:7.0f} GB/s of weights"
    if plain_tok_s:
        line += f"  x{result['tok_s'] / plain_tok_s:.2f}"
    if "acceptance" in result:
        line += f"  acceptance {result['acceptance']:.3f}, {result['tokens_per_step']:.2f} tokens a step"
    print(line, flush=True)


def step_costs(k: int, plain: dict, at_zero: dict, at_one: dict) -> dict:
    """A verified step of k proposals in steps without speculation, at acceptance ~0 and 1 (step time = tokens a
    step / tokens/s), and the acceptance at which the measured cost at ~0 breaks even."""
    from shardserve.engine.speculative import break_even_acceptance

    plain_step = 1 / plain["tok_s"]
    cost0 = at_zero.get("tokens_per_step", 1.0) / at_zero["tok_s"] / plain_step
    cost1 = at_one["tokens_per_step"] / at_one["tok_s"] / plain_step
    pays = cost0 < k + 1  # at acceptance 1 a step adds k + 1 tokens
    return {"step_cost_at_0": round(cost0, 3), "step_cost_at_1": round(cost1, 3),
            "break_even_acceptance": round(break_even_acceptance(k, max(cost0 - 1, 0) / k), 3) if pays else None}


def upper_bound(target: str, args, target_bytes: int, plain: dict) -> dict:
    out = {"plain": plain}
    for k in args.ks:
        result = measured(target, args, target, k)
        report(f"8B, draft = itself, k={k}", result, target_bytes, plain["tok_s"])
        if result["acceptance"] < EQUAL_DRAFT_MIN_ACCEPTANCE:
            raise RuntimeError(f"a draft equal to the target had {result['acceptance']:.3f} of its proposals "
                               f"accepted at k = {k}: verification or the draft's cache is wrong")
        result["same_tokens_as_plain"] = result["token_ids"] == plain["token_ids"]
        out[f"k{k}"] = result
    return out


def overhead(small: str, other: str, args, small_bytes: int) -> dict:
    plain = measured(small, args)
    report("1B, no speculation", plain, small_bytes)
    out = {"plain": plain}
    for k in OVERHEAD_K:
        result = measured(small, args, other, k)
        report(f"1B, draft = other 1B, k={k}", result, small_bytes, plain["tok_s"])
        result["slowdown"] = round(plain["tok_s"] / result["tok_s"], 3)
        out[f"k{k}"] = result
    return out


def big_with_small(target: str, draft: str, args, target_bytes: int, plain: dict) -> dict:
    result = measured(target, args, draft, args.k, forced=True)
    report(f"8B, 1B draft, k={args.k}, as it comes", result, target_bytes, plain["tok_s"])
    report(f"8B, 1B draft, k={args.k}, all accepted", result["accepted_all"], target_bytes, plain["tok_s"])
    result.update(step_costs(args.k, plain, result, result["accepted_all"]))
    print(f"a step of {args.k} proposals costs {result['step_cost_at_0']:.2f} steps without speculation at acceptance "
          f"~0 ({result['step_cost_at_1']:.2f} at 1): speculation pays above acceptance "
          f"{result['break_even_acceptance']}", flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes instead of 8B and 1B (a smoke test)")
    p.add_argument("--k", type=int, default=3, help="proposals a step of the 8B target with the 1B draft (default 3)")
    p.add_argument("--ks", type=lambda t: [int(k) for k in t.split(",")], default=list(UPPER_BOUND_K),
                   help="the upper bound's proposal counts (default 1,2,3,4)")
    p.add_argument("--parts", type=lambda t: t.split(","), default=list(PARTS),
                   help=f"which of {','.join(PARTS)} to run (default all)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-gb", type=float, default=4.0, help="the KV cache, the draft's included (GiB)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.prompt_len, args.short, args.long = (16, 8, 24) if args.tiny else (PROMPT_LEN, SHORT, LONG)
    if args.tiny:
        args.repeats, args.kv_cache_gb = 1, min(args.kv_cache_gb, 0.05)
    big_shape, small_shape = (TINY_TARGET, TINY_DRAFT) if args.tiny else (SHAPES["llama3-8b"], LLAMA32_1B)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is visible (use --device cpu --tiny for the smoke test)")
    root = tempfile.mkdtemp(prefix="speculative-gpu-")
    big = write_model_dir(os.path.join(root, "target-8b"), big_shape)
    small = write_model_dir(os.path.join(root, "draft-1b"), small_shape)
    other = write_model_dir(os.path.join(root, "other-1b"), small_shape)  # another directory: other weights
    big_bytes, small_bytes = weight_bytes(big_shape), weight_bytes(small_shape)
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"--parts: unknown {', '.join(unknown)}; accepted: {', '.join(PARTS)}")
    started = time.perf_counter()
    results = {}
    if "upper" in args.parts or "draft" in args.parts:
        plain = measured(big, args)
        report("8B, no speculation", plain, big_bytes)
    if "upper" in args.parts:
        results["upper_bound"] = upper_bound(big, args, big_bytes, plain)
    if "overhead" in args.parts:
        results["overhead_at_acceptance_0"] = overhead(small, other, args, small_bytes)
    if "draft" in args.parts:
        results["target_8b_draft_1b"] = big_with_small(big, small, args, big_bytes, plain)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    kind = device_kind(name, 1) if args.device == "cuda" else "cpu"
    summary = {"device": name, "device_kind": kind, "commit": commit_id(), "date": f"{datetime.date.today()}",
               "tiny": args.tiny, "dtype": args.dtype, "target_weight_bytes": big_bytes,
               "draft_weight_bytes": small_bytes, "prompt_len": args.prompt_len, "repeats": args.repeats,
               "seconds": round(time.perf_counter() - started, 1), **results}
    os.makedirs(args.out, exist_ok=True)
    parts = "" if set(args.parts) == set(PARTS) else "-" + "-".join(args.parts)
    path = os.path.join(args.out, f"speculative-draft-{kind}{'-tiny' if args.tiny else ''}{parts}-"
                                  f"{datetime.date.today():%Y%m%d}.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {path} ({summary['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
