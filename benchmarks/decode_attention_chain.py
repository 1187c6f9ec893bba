"""Decode attention with the rotary kernel before it against the rotation inside it, on one GPU.

    python benchmarks/decode_attention_chain.py

A chain of 32 batch-1 layers (QKV GEMV -> [rotary + cache write] -> decode attention -> o GEMV) in one CUDA
graph, in the head layouts of Llama-3-8B and Qwen3-30B-A3B (with head norms), at three context lengths; prints
microseconds a layer for the rotary kernel + decode ("separate") and decode with the new token inside ("fused"),
each with four and eight warps in the decode launch. Random weights: the time does not depend on values.
"""
import torch
import triton

from shardserve.kernels.triton import fused_ops, gemv as gemv_mod, paged_decode as pa
from shardserve.layers.rotary import RotaryEmbedding

dev = torch.device("cuda")


SHAPES = {"llama3-8b": (32, 8, 4096, False), "qwen3-30b-a3b": (32, 4, 2048, True)}


def chain(mode, shape, ctx, layers=32, max_ctx=2048):
    """us a layer of the chain, with the decode launches' warps as the module is set."""
    nq, nkv, hidden, norm = shape
    D, block = 128, 16
    nb = triton.cdiv(max_ctx, block) + 2
    k_cache = torch.randn(layers, nb * block, nkv, D, device=dev).to(torch.bfloat16)
    v_cache = torch.randn(layers, nb * block, nkv, D, device=dev).to(torch.bfloat16)
    table = torch.randperm(nb, device=dev).to(torch.int32)[None, : triton.cdiv(max_ctx, block)].contiguous()
    lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
    pos = lens.long() - 1
    slot = (table[0, pos // block].long() * block + pos % block).contiguous()
    rope = RotaryEmbedding(D, 8192, 500000.0, None, torch.bfloat16).to(dev)
    w_qkv = [torch.randn((nq + 2 * nkv) * D, hidden, device=dev).to(torch.bfloat16) * 0.02 for _ in range(layers)]
    w_o = [torch.randn(hidden, nq * D, device=dev).to(torch.bfloat16) * 0.02 for _ in range(layers)]
    head_norm = (torch.ones(D, device=dev, dtype=torch.bfloat16), torch.ones(D, device=dev, dtype=torch.bfloat16),
                 1e-6) if norm else None
    x0 = torch.randn(1, hidden, device=dev).to(torch.bfloat16)
    splits = pa.choose_num_splits(1, nkv, max_ctx, 132, block)
    counts = torch.zeros(64, dtype=torch.int32, device=dev)

    def step():
        x = x0
        for i in range(layers):
            qkv = gemv_mod.gemv(x, w_qkv[i]).view(1, -1, D)
            qk, v = qkv[:, : nq + nkv], qkv[:, nq + nkv:]
            if mode == "separate":
                fused_ops.apply_rotary_and_store_(qk, nq, v, pos, rope.cos, rope.signed_sin, k_cache[i], v_cache[i],
                                                  slot, head_norm)
                out = pa.paged_decode_attention(qk[:, :nq], k_cache[i], v_cache[i], table, lens, D ** -0.5, block,
                                                splits, arrivals=counts)
            else:
                new = pa.NewTokens(qk[:, nq:], v, slot, rope.cos, rope.signed_sin, head_norm)
                out = pa.paged_decode_attention(qk[:, :nq], k_cache[i], v_cache[i], table, lens, D ** -0.5, block,
                                                splits, arrivals=counts, new_tokens=new)
            x = gemv_mod.gemv(out.view(1, -1), w_o[i])
        return x

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    best = []
    for _ in range(3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(100):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        best.append(s.elapsed_time(e) * 1000 / 100 / layers)
    return min(best)


def main() -> None:
    four_warps, new_token_warps = pa._decode_config, pa.DECODE_NEW_TOKEN_WARPS
    try:
        for shape_name, shape in SHAPES.items():
            for ctx, max_ctx in ((300, 2048), (1800, 2048), (6000, 8192)):
                line = [f"{shape_name} context {ctx}"]
                for mode in ("separate", "fused"):
                    for warps in (4, 8):
                        pa._decode_config = lambda head_dim, dtype, w=warps: {**four_warps(head_dim, dtype),
                                                                              "num_warps": w}
                        pa.DECODE_NEW_TOKEN_WARPS = warps
                        line.append(f"{mode} {warps} warps {chain(mode, shape, ctx, max_ctx=max_ctx):.2f}")
                print(", ".join(line) + " us a layer", flush=True)
    finally:
        pa._decode_config, pa.DECODE_NEW_TOKEN_WARPS = four_warps, new_token_warps


if __name__ == "__main__":
    main()
