"""Where a tensor-parallel batch-1 decode step's time goes, on a Llama-3-8B-shaped model (random bf16 weights).

    python benchmarks/profile_tp.py [--tp 2] [--tokens 256]

1. The device's share: every rank builds its model runner and replays its batch-1 (and batch-64) CUDA
   graph in a loop at the same time, so the all-reduces inside pair up; CUDA events time rank 0's
   replays, and the torch profiler lists rank 0's kernels by GPU time.
2. The whole engine (`LLM.generate`, scheduler, control plane, sampling) at batch 1, overlapped decoding
   off and on, and the host functions rank 0 spends the most time in (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_suite import graph_replay_ms, write_model_dir  # noqa: E402

REPLAYS = 200


def _engine_config(model_dir: str, tp: int, max_num_seqs: int = 64):
    from shardserve.config import EngineConfig

    return EngineConfig(model=model_dir, tensor_parallel_size=tp, device="cuda", dtype="bfloat16",
                        load_format="dummy", max_model_len=2048, max_num_seqs=max_num_seqs,
                        kv_cache_memory_gb=8)


def replay_worker(config, ctx) -> None:
    """Every rank: build the runner, replay graphs in step with the others; rank 0 reports."""
    import torch

    from shardserve.config import ModelConfig
    from shardserve.engine.model_runner import ModelRunner

    runner = ModelRunner(config, ModelConfig.from_model_path(config.model), ctx)
    graphs = runner.graphs
    for size in (1, 64):
        print(f"rank {ctx.rank}: batch-{size} graph replay {_ms_per_replay(graphs.decode_graph(size)):.3f} ms per step",
              flush=True)
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graphs.decode_graph(1).replay()
        torch.cuda.synchronize()
    if ctx.rank == 0:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70),
              flush=True)
    if os.environ.get("PROFILE_TP_ALONE") == "1" and ctx.world_size > 1:
        alone_ms = _replay_without_communication(runner, ctx)
        print(f"rank {ctx.rank}: batch-1 graph without any collective (each rank on its own shard) "
              f"{alone_ms:.3f} ms per step", flush=True)
    runner.close()


def _ms_per_replay(graph) -> float:
    """Mean ms of REPLAYS replays after 20 to warm up (the other ranks replay at the same time)."""
    for _ in range(20):
        graph.replay()
    return graph_replay_ms(graph, REPLAYS)


def _replay_without_communication(runner, ctx) -> float:
    """The batch-1 graph captured again as if the rank were alone (every collective skipped, wrong numbers):
    what the step costs with no communication at all, on the same shard."""
    comm = ctx.comm
    world, tokens = comm.world_size, comm.tokens
    comm.world_size, comm.tokens = 1, None
    try:
        graphs = runner.graphs
        graphs.shares_tokens = False
        graphs.capture_all()
        return _ms_per_replay(graphs.decode_graph(1))
    finally:
        comm.world_size, comm.tokens = world, tokens


def device_share(model_dir: str, tp: int) -> None:
    from shardserve.distributed.launcher import LocalRanks

    config = _engine_config(model_dir, tp)
    ranks = LocalRanks(config, worker=replay_worker)
    try:
        replay_worker(config, ranks.ctx)
    finally:
        ranks.close()


def engine_share(model_dir: str, tp: int, tokens: int, timeline: bool = True, overlap=(False, True)) -> None:
    from shardserve.entrypoints.llm import LLM
    from shardserve.requests.sampling_params import SamplingParams

    llm = LLM(model_dir, tensor_parallel_size=tp, **{k: v for k, v in vars(_engine_config(model_dir, tp)).items()
                                                     if k not in ("model", "tensor_parallel_size")})
    prompt = [[(7 * i) % 128000 for i in range(1, 129)]]

    def per_token_ms() -> float:
        def run(n):
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
            t = time.perf_counter()
            llm.generate(prompt, params)
            return time.perf_counter() - t
        run(8)
        return (run(tokens + 32) - run(32)) * 1000 / tokens

    for overlap in overlap:
        llm.engine.overlap_steps = overlap
        ms = per_token_ms()
        print(f"engine TP={tp} batch 1, overlapped decoding {'on' if overlap else 'off'}: {ms:.3f} ms/token "
              f"({1000 / ms:.1f} tok/s)", flush=True)
    if not timeline:
        llm.shutdown()
        return
    gpu_timeline(llm, prompt, 64)
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, detokenize=False))
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    print(text.getvalue(), flush=True)
    llm.shutdown()


def gpu_timeline(llm, prompt, tokens: int) -> None:
    """Rank 0's GPU during overlapped decoding: busy share, mean time per kernel name, and the longest idle
    gaps with the kernels on either side (what the device waits for between steps)."""
    from torch.profiler import ProfilerActivity, profile

    from shardserve.requests.sampling_params import SamplingParams

    llm.engine.overlap_steps = True
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate(prompt, params)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        llm.generate(prompt, params)
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    if not events:
        return
    span = events[-1].time_range.end - events[0].time_range.start
    busy = sum(e.time_range.end - e.time_range.start for e in events)
    print(f"rank 0 GPU over {tokens} overlapped steps: span {span / tokens:.1f} us/step, kernels {busy / tokens:.1f} "
          f"us/step", flush=True)
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name[:60], []).append(e.time_range.end - e.time_range.start)
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(f"  {sum(times) / tokens:8.1f} us/step  {len(times) / tokens:5.1f}/step  mean {sum(times) / len(times):6.1f} us"
              f"  {name}", flush=True)
    gaps = sorted(((b.time_range.start - a.time_range.end, a.name[:40], b.name[:40]) for a, b in zip(events, events[1:])),
                  reverse=True)
    total_gap = sum(g for g, _, _ in gaps if g > 0)
    print(f"  idle {total_gap / tokens:.1f} us/step; longest gaps:", flush=True)
    for gap, before, after in gaps[:8]:
        print(f"    {gap:8.1f} us  after {before}  before {after}", flush=True)
    by_pair: dict[tuple[str, str], list[float]] = {}
    for gap, before, after in gaps:
        if gap > 0:
            by_pair.setdefault((before, after), []).append(gap)
    print("  idle by the kernels on either side (all steps):", flush=True)
    for (before, after), times in sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:10]:
        print(f"    {sum(times) / tokens:8.1f} us/step  {len(times) / tokens:5.1f}/step  after {before}  "
              f"before {after}", flush=True)
    cpu = {}
    for e in prof.key_averages():
        if e.cpu_time_total > 0:
            cpu[e.key] = e.cpu_time_total
    for key, us in sorted(cpu.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  host {us / tokens:8.1f} us/step  {key[:70]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--skip-device", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--no-timeline", action="store_true", help="the engine's times per token only, no profilers")
    p.add_argument("--overlap", choices=("both", "on", "off"), default="both",
                   help="the engine's overlapped decoding (with SHARDSERVE_GRAPH_TIMING=1: time one mode's replays)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model_dir = write_model_dir(os.path.join(tempfile.mkdtemp(), "llama3-8b-shape"))
    if not args.skip_device:
        device_share(model_dir, args.tp)
    if not args.skip_engine:
        overlap = {"both": (False, True), "on": (True,), "off": (False,)}[args.overlap]
        engine_share(model_dir, args.tp, args.tokens, timeline=not args.no_timeline, overlap=overlap)


if __name__ == "__main__":
    main()
