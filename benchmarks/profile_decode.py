"""Where a batch-1 decode step's time goes, on the host and on the GPU, for a Llama-3-8B-shaped model.

    python benchmarks/profile_decode.py [--tokens 200]

Prints the engine's step time (overlapped decoding off and on), the GPU time of one step (CUDA events around the graph replay alone),
and the host functions that take the most time per step (cProfile, cumulative).
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=200)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


    from shardserve.engine.sampling_params import SamplingParams
    from shardserve.entrypoints.llm import LLM

    model_dir = write_model_dir(os.path.join(tempfile.mkdtemp(), "llama3-8b-shape"))
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=2048, max_num_seqs=64)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, detokenize=False)
    prompt = [[(7 * i) % 128000 for i in range(1, 129)]]
    llm.generate(prompt, params)  # warm up

    replay_ms = graph_replay_ms(llm.engine.runner.graphs.graphs[1])

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


if __name__ == "__main__":
    main()
