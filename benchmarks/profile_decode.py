"""Where a batch-1 decode step's time goes, on the host and on the GPU, for a model of a real shape (random weights).

    python benchmarks/profile_decode.py [--model llama3-8b] [--tokens 200] [--kernels] [--quantization fp8|fp8-block|gptq-int4[-head]]
                                        [--sms N]

Prints the engine's step time (overlapped decoding off and on), the GPU time of one step (CUDA events around the
graph replay alone), and the host functions that take the most time per step (cProfile). --kernels adds the GPU
kernels of one replayed step by total time (torch.profiler over 20 replays); --timeline, what each kernel adds to
the step: its end minus the end of the kernel before it. Kernels launched early by dependent launch overlap the
one before them, so their own durations add up to more than the step; these exposed times add up to the step.

--sms N runs the whole engine, its start-up timing and its CUDA graphs included, on N of the GPU's SMs (a CUDA green
context): 92 of an H100's 132 SMs must each issue for as many bytes a second as an H200's (4.8 TB/s over 132 SMs
against 3.35), so kernels bound by their instructions slow down there as they would on an H200, and the ones bound by
memory do not.
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

from gpu_suite import CHECKPOINT_CONFIGS, SHAPES, checkpoint_config, graph_replay_ms, write_model_dir  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--model", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--kernels", action="store_true", help="the GPU kernels of a step, by total time")
    p.add_argument("--timeline", action="store_true",
                   help="what each kernel adds to a step (its end minus the previous kernel's end), by name")
    p.add_argument("--quantization", choices=["fp8", *CHECKPOINT_CONFIGS], default=None,
                   help="fp8: the projections quantized at load; gptq-int4: a 4-bit GPTQ checkpoint (groups of 128); "
                        "gptq-int4-head: the same with its LM head quantized (lm_head: true); fp8-block: an FP8 "
                        "checkpoint with 128 x 128 blocks")
    p.add_argument("--sms", type=int, default=None, help="run everything on this many SMs (a CUDA green context)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.sms:
        run_on_sms(args.sms)

    from shardserve.entrypoints.llm import LLM
    from shardserve.requests.sampling_params import SamplingParams

    shape = SHAPES[args.model]
    if args.quantization in CHECKPOINT_CONFIGS:  # the checkpoint's config says so: no --quantization at load
        shape = {**shape, "quantization_config": checkpoint_config(args.quantization, shape)}
    model_dir = write_model_dir(os.path.join(tempfile.mkdtemp(), f"{args.model}-shape"), shape)
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=2048, max_num_seqs=64,
              quantization="fp8" if args.quantization == "fp8" else None)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, detokenize=False)
    prompt = [[(7 * i) % 128000 for i in range(1, 129)]]
    llm.generate(prompt, params)  # warm up

    graph = llm.engine.runner.graphs.decode_graph(1)
    replay_ms = graph_replay_ms(graph)
    if args.kernels:
        print_kernels(graph, replays=20)
    if args.timeline:
        print_exposed(graph, replays=20)

    step_ms = {}
    for overlap in (False, True):
        llm.engine.overlap_steps = overlap
        t = time.perf_counter()
        llm.generate(prompt, params)
        step_ms[overlap] = (time.perf_counter() - t) * 1000 / args.tokens

    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompt, params)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    for overlap, ms in step_ms.items():
        print(f"engine step, overlapped decoding {'on' if overlap else 'off'}: {ms:.3f} ms/token "
              f"({1000 / ms:.1f} tok/s)")
    print(f"graph replay alone {replay_ms:.3f} ms ({1000 / replay_ms:.1f} tok/s)")
    print(text.getvalue())
    llm.shutdown()


def run_on_sms(sms: int) -> None:
    """Make a green context of `sms` SMs hold every kernel from here on: its stream current, and the stream CUDA
    graphs are captured on (kernels captured there replay on its SMs)."""
    import torch

    from gemv_shapes import use_sms

    stream = use_sms(sms)
    torch.cuda.graph.default_capture_stream = stream
    print(f"running on {sms} of the GPU's {torch.cuda.get_device_properties(0).multi_processor_count} SMs", flush=True)


def profiled_replays(graph, replays: int):
    """torch.profiler's record of the GPU kernels of `replays` replays of the graph."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return prof


def print_kernels(graph, replays: int) -> None:
    import torch

    prof = profiled_replays(graph, replays)
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(event.name, [0.0, 0])
            entry[0] += getattr(event, "device_time", event.cuda_time) / replays
            entry[1] += 1 / replays
    step_us = sum(us for us, _ in totals.values())
    print(f"GPU kernels of one step: {step_us:.1f} us in all")
    for name, (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"{us:9.1f} us {us / step_us:6.1%} x{count:5.0f}  {name[:110]}")


def print_exposed(graph, replays: int) -> None:
    """Each kernel's exposed time, averaged over replays: its end minus the end of the kernel that ended before it
    (the first kernel of a replay counts from its own start). A step is one chain of kernels, so these add up to the
    replay's GPU time; a kernel whose launch overlaps the one before it is charged only for what it adds."""
    import torch

    prof = profiled_replays(graph, replays)
    kernels = sorted(((e.end_ns(), e.start_ns(), e.name()) for e in prof.profiler.kineto_results.events()
                      if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0))
    per_replay = len(kernels) // replays
    if per_replay == 0 or len(kernels) % replays:
        print(f"timeline: {len(kernels)} kernels over {replays} replays do not divide; not shown")
        return
    exposed: dict[str, list[float]] = {}
    own: dict[str, float] = {}
    idle_ns = 0
    window = range(per_replay // 2, min(per_replay, per_replay // 2 + 12))  # a few launches mid-step, in order
    at_position = {j: [0.0, 0.0, kernels[j][2]] for j in window}
    for r in range(replays):
        step = kernels[r * per_replay:(r + 1) * per_replay]
        previous_end = step[0][1]
        for j, (end, start, name) in enumerate(step):
            added_us, own_us = (end - previous_end) / 1000, (end - start) / 1000
            exposed.setdefault(name, []).append(added_us)
            own[name] = own.get(name, 0.0) + own_us
            idle_ns += max(0, start - previous_end)
            if j in at_position:
                at_position[j][0] += added_us / replays
                at_position[j][1] += own_us / replays
            previous_end = end
    step_us = sum(sum(v) for v in exposed.values()) / replays
    print(f"exposed time of one step's {per_replay} kernels: {step_us:.1f} us, of which the GPU idle between kernels "
          f"{idle_ns / 1000 / replays:.1f} us (exposed sum, us a launch, its own duration a launch)")
    for name, values in sorted(exposed.items(), key=lambda kv: -sum(kv[1]))[:25]:
        count = len(values) / replays
        total = sum(values) / replays
        print(f"{total:9.1f} us {total / step_us:6.1%} x{count:5.0f}  {total / count:6.2f} "
              f"{own[name] / replays / count:6.2f}  {name[:90]}")
    print("launches mid-step in order (exposed us, own duration us):")
    for j, (exposed_us, own_us, name) in at_position.items():
        print(f"  {j:5d} {exposed_us:6.2f} {own_us:6.2f}  {name[:100]}")


if __name__ == "__main__":
    main()
