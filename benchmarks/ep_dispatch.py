"""Expert parallelism's two ways of moving tokens, timed on this machine's ranks: what each layer sends.

    python benchmarks/ep_dispatch.py [--ranks 2] [--backend gloo] [--hidden 2048] [--top-k 8] [--tokens 1,16,256,2048]

With attention split by heads (tensor parallelism), every rank holds every token's hidden state after the
layer's norm. Masking (shardserve's way): each rank computes the (token, expert) pairs of its own experts and
one all-reduce of [tokens, hidden] sums the partial outputs, the same collective a dense MLP needs. All-to-all
(for attention split by tokens, data parallel): each rank sends the hidden state of each of its tokens' choices
to the rank holding that expert and gets the results back: two all-to-alls of tokens / ranks * top_k * (ranks -
1) / ranks rows each way per rank, with experts chosen uniformly. Both compute the same expert FLOPs; this
times the communication of each (float32, median of 20 after 3 warm-ups) and prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _median_ms(fn, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _rank(rank: int, args, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    n = args.ranks
    rows = []
    for tokens in args.tokens:
        hidden = torch.randn(tokens, args.hidden)
        masking = _median_ms(lambda: dist.all_reduce(hidden))
        local = max(1, tokens // n)  # tokens per rank under data-parallel attention
        per_peer = -(-local * args.top_k // n)  # choices sent to each other rank, uniform routing
        send = torch.randn(per_peer * n, args.hidden)
        receive = torch.empty_like(send)

        def all_to_all_twice() -> None:
            dist.all_to_all_single(receive, send)  # dispatch
            dist.all_to_all_single(send, receive)  # combine

        rows.append({"tokens": tokens, "masking_all_reduce_ms": round(masking, 3),
                     "all_to_all_dispatch_and_combine_ms": round(_median_ms(all_to_all_twice), 3)})
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 256, 2048])
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from shardserve.distributed.process_group import find_free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_rank, args=(r, args, port, results)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    rows = results.get(timeout=600)
    for proc in procs:
        proc.join()
    print(json.dumps({"ranks": args.ranks, "backend": args.backend, "hidden": args.hidden, "top_k": args.top_k,
                      "dtype": "float32", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
