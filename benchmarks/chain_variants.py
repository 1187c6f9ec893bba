"""A batch-1 decode step's graph replayed under launch-chain variants, in one process: one engine, one set of
weights, the decode graph captured again for each variant (its environment variables set), the variants taken in
turn for several rounds so that the card's drift falls on all of them alike.

A variant is NAME or NAME:VAR=VALUE;VAR=VALUE (the variables read when kernels launch, so a new capture picks them
up). Each variant also decodes a few prompts greedily through its graphs: every variant must give the first's
tokens (the same kernels' arithmetic in another launch order), or the run says which differ.

    python3 benchmarks/gpu_suite.py ...   # the suite's figures; this script compares variants of one engine
    python3 benchmarks/chain_variants.py --model nemotron3-nano-30b-a3b --quantization nvfp4 \\
        --variants "base,early:SHARDSERVE_NEXT_EARLY=on"
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import gpu_suite  # noqa: E402
from benchmarks.result_file import report  # noqa: E402


def parse_variants(text: str) -> list[tuple[str, dict[str, str]]]:
    """--variants: comma-separated NAME[:VAR=VALUE;VAR=VALUE]; else SystemExit naming the flag."""
    variants = []
    for item in filter(None, text.split(",")):
        name, _, settings = item.partition(":")
        env = {}
        for pair in filter(None, settings.split(";")):
            var, eq, value = pair.partition("=")
            if not eq or not var:
                raise SystemExit(f"--variants: {pair!r} in {item!r} is not VAR=VALUE")
            env[var] = value
        variants.append((name, env))
    if not variants or len({name for name, _ in variants}) != len(variants):
        raise SystemExit(f"--variants takes distinct names, each with optional VAR=VALUE settings; got {text!r}")
    return variants


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(gpu_suite.SHAPES), required=True)
    p.add_argument("--quantization", choices=sorted(gpu_suite.QUANTIZATION_TAGS), default=None)
    p.add_argument("--variants", required=True, help="NAME[:VAR=VALUE;...], comma-separated; the first is the base")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--replays", type=int, default=200, help="graph replays a timing")
    p.add_argument("--out", default=None, help="a JSON file for the results")
    args = p.parse_args()
    variants = parse_variants(args.variants)
    touched = {var for _, env in variants for var in env}

    import torch

    from shardserve.entrypoints.llm import LLM
    from shardserve.requests.sampling_params import SamplingParams

    shape = gpu_suite.SHAPES[args.model]
    if args.quantization in gpu_suite.CHECKPOINT_CONFIGS:
        shape = {**shape, "quantization_config": gpu_suite.checkpoint_config(args.quantization, shape)}
    model_dir = gpu_suite.write_model_dir(tempfile.mkdtemp(prefix=f"{args.model}-shape-"), shape)
    llm = LLM(model_dir, tensor_parallel_size=1, device="cuda", dtype="bfloat16", load_format="dummy",
              max_model_len=2048, max_num_seqs=1, quantization="fp8" if args.quantization == "fp8" else None)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, detokenize=False)
    prompts = gpu_suite.random_prompts(4, 64, 5)
    llm.generate(prompts[:1], params)
    graphs = llm.engine.runner.graphs

    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, env in variants:
            for var in touched:
                os.environ.pop(var, None)
            os.environ.update(env)
            graphs.capture_all()
            graph = graphs.decode_graph(1)
            times[name].append(gpu_suite.graph_replay_ms(graph, args.replays))
            if name not in tokens:  # one prompt at a time: batch 1, the graph just timed
                tokens[name] = [llm.generate([p], params)[0].token_ids for p in prompts]
    base = variants[0][0]
    result = {
        "model": args.model, "quantization": args.quantization, "device": torch.cuda.get_device_name(),
        "commit": gpu_suite.commit_id(), "replays": args.replays,
        "variants": {name: {"env": env, "graph_replay_ms": times[name], "median_ms": statistics.median(times[name]),
                            "same_tokens_as_base": tokens[name] == tokens[base]}
                     for name, env in variants},
    }
    for name, _ in variants:
        v = result["variants"][name]
        print(f"{name:>20}: {v['median_ms']:.4f} ms (rounds {', '.join(f'{t:.4f}' for t in v['graph_replay_ms'])})"
              f"{'' if v['same_tokens_as_base'] else '  TOKENS DIFFER from ' + base}", flush=True)
    report(result, args.out)
    sys.stdout.flush()
    os._exit(0)  # NCCL and symmetric-memory teardown can hang at interpreter exit


if __name__ == "__main__":
    raise SystemExit(main())
