"""One Gated DeltaNet layer's prefill on a GPU: shardserve's chunked delta rule (torch, float32 chunks of 64 tokens)
against the flash-linear-attention kernels (`fla-core`'s Triton chunk_gated_delta_rule) where that package is
installed, at Qwen3-Next-80B-A3B's head sizes on one rank (16 key heads, 32 value heads of 128 x 128).

    python benchmarks/delta_rule_prefill.py [--tokens 4096,32768] [--value-heads 32] [--key-heads 16]

Prints milliseconds per layer for each form, the relative difference of their outputs and final states, and the
time for the model's 36 such layers.
"""

from __future__ import annotations

import argparse
import json

import torch


def timed_ms(fn, repeats: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def inputs(tokens: int, key_heads: int, value_heads: int, dim: int, seed: int = 0):
    from shardserve.kernels.gated_delta_rule import l2_normalized

    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (l2_normalized(torch.randn(tokens, key_heads, dim, device="cuda", generator=g)) for _ in range(2))
    v = torch.randn(tokens, value_heads, dim, device="cuda", generator=g).bfloat16()
    decay = -torch.rand(tokens, value_heads, device="cuda", generator=g) * 0.1
    beta = torch.rand(tokens, value_heads, device="cuda", generator=g)
    state = torch.zeros(value_heads, dim, dim, device="cuda")
    return q, k, v, decay, beta, state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096,32768")
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--value-heads", type=int, default=32)
    p.add_argument("--layers", type=int, default=36)
    args = p.parse_args()
    from shardserve.kernels.gated_delta_rule import chunked_gated_delta_rule

    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - reported, the torch form is measured alone
        chunk_gated_delta_rule, missing = None, f"{type(e).__name__}: {e}"
    results = {"device": torch.cuda.get_device_name(0)}
    for tokens in map(int, args.tokens.split(",")):
        q, k, v, decay, beta, state = inputs(tokens, args.key_heads, args.value_heads, 128)
        scale = 128 ** -0.5
        ours = lambda: chunked_gated_delta_rule(q, k, v, decay, beta, scale, state)  # noqa: E731
        row = {"torch_chunked_ms": timed_ms(ours)}
        if chunk_gated_delta_rule is not None:
            group = args.value_heads // args.key_heads
            fq, fk = (x.repeat_interleave(group, dim=1).bfloat16()[None] for x in (q, k))

            def theirs():
                return chunk_gated_delta_rule(fq, fk, v[None], decay[None], beta[None], scale=scale,
                                              initial_state=state[None], output_final_state=True)

            row["fla_chunk_ms"] = timed_ms(theirs)
            o_ref, s_ref = ours()
            o, s = theirs()
            row["output_rel_diff"] = ((o[0].float() - o_ref).norm() / o_ref.norm()).item()
            row["state_rel_diff"] = ((s[0].float() - s_ref).norm() / s_ref.norm()).item()
        else:
            row["fla"] = missing
        for key in [k for k in row if k.endswith("_ms")]:
            row[key.replace("_ms", f"_{args.layers}_layers_s")] = row[key] * args.layers / 1000
        results[f"{tokens}_tokens"] = row
        print(tokens, json.dumps(row), flush=True)
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
