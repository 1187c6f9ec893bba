"""Does a large decode step run faster as two half batches on two CUDA streams than as one batch?

    python benchmarks/overlap_probe.py [--batch 512 --context 640 --layers 32]

At 512 sequences a Llama-3-8B-shaped decode step is GEMM-bound (compute) and the paged attention is bound by
memory bandwidth; run back to back they add up. Splitting the batch in two and running the halves on two
streams lets one half's attention share the device with the other half's GEMMs. This probe times the layer
stack (QKV, paged attention, O, gate/up, SwiGLU, down; the real kernels) captured in CUDA graphs: the whole
batch on one stream, and two half batches on two streams, and prints both with the attention and GEMMs alone.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_suite import graph_replay_ms  # noqa: E402


def timed_graph(fn, repeats: int = 20) -> float:
    """Milliseconds per replay of `fn` captured in a CUDA graph (run once first, outside the graph, so Triton
    compiles and cuBLAS picks its algorithms)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    return graph_replay_ms(graph, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--context", type=int, default=640)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()

    from shardserve.kernels.triton.fused_ops import silu_and_mul
    from shardserve.kernels.triton.paged_decode import choose_num_splits, paged_decode_attention

    dev, dt = torch.device("cuda"), torch.bfloat16
    hidden, inter, heads, kv_heads, head_dim, block = 4096, 14336, 32, 8, 128, 16
    batch, ctx, layers = args.batch, args.context, args.layers
    blocks_per_seq = -(-ctx // block)
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=gen) * 0.02

    weights = [dict(qkv=rand(hidden, (heads + 2 * kv_heads) * head_dim), o=rand(heads * head_dim, hidden),
                    gate_up=rand(hidden, 2 * inter), down=rand(inter, hidden)) for _ in range(layers)]
    caches = [(rand(batch * blocks_per_seq * block, kv_heads, head_dim),
               rand(batch * blocks_per_seq * block, kv_heads, head_dim)) for _ in range(layers)]
    tables = torch.randperm(batch * blocks_per_seq, device=dev).to(torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    x = rand(batch, hidden)
    qkv_static = rand(batch, (heads + 2 * kv_heads) * head_dim)

    def layer_stack(rows: slice, attention: bool = True, gemms: bool = True):
        h = x[rows]
        n = h.shape[0]
        splits = choose_num_splits(n, kv_heads, ctx)
        for w, (kc, vc) in zip(weights, caches):
            if gemms:
                qkv = h @ w["qkv"]
            else:
                qkv = qkv_static[rows]
            q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
            if attention:
                a = paged_decode_attention(q, kc, vc, tables[rows], lens[rows], head_dim ** -0.5, block, splits)
                a = a.view(n, heads * head_dim)
            else:
                a = qkv[:, : heads * head_dim]
            if gemms:
                h = h + a @ w["o"]
                h = h + silu_and_mul(h @ w["gate_up"]) @ w["down"]

    full = slice(0, batch)
    halves = (slice(0, batch // 2), slice(batch // 2, batch))
    side = torch.cuda.Stream()

    def two_streams():
        side.wait_stream(torch.cuda.current_stream())
        layer_stack(halves[0])
        with torch.cuda.stream(side):
            layer_stack(halves[1])
        torch.cuda.current_stream().wait_stream(side)

    def halves_in_turn():
        layer_stack(halves[0])
        layer_stack(halves[1])

    rows = {
        "attention alone, whole batch": timed_graph(lambda: layer_stack(full, gemms=False)),
        "GEMMs alone, whole batch": timed_graph(lambda: layer_stack(full, attention=False)),
        "whole batch, one stream": timed_graph(lambda: layer_stack(full)),
        "two halves, one after the other": timed_graph(halves_in_turn),
        "two halves on two streams": timed_graph(two_streams),
    }
    print(f"{layers} layers, batch {batch}, context {ctx} (Llama-3-8B layer shapes, bf16)")
    for name, ms in rows.items():
        print(f"{name:36s} {ms:8.3f} ms  ({ms / layers * 1000:7.1f} us per layer)")


if __name__ == "__main__":
    main()
