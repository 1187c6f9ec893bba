"""Does tensor parallelism change a model's answers by more than rounding? One model shape with synthetic weights
(every rank sees the same full tensors at every TP size: weights/synthetic.py) run at several TP sizes, one process
a size, on the same prompts:

    python benchmarks/tp_agreement.py --model nemotron3-nano-30b-a3b --tp 1,2 --dtype float32 --layers 26
    python benchmarks/tp_agreement.py --model nemotron3-nano-30b-a3b --runs 1:float32,1:bfloat16,2:bfloat16 --layers 26

The last form asks whether TP 2 in bfloat16 is further from the float32 answers than TP 1 in bfloat16 is: each run
is compared with the first. For each prompt it records the first token's top logprobs (one step) and 16 greedy
tokens, then compares each run with the first:
- how far the first token's logprobs move (the tokens both sizes list in their top 5): a split that reads the
  wrong slice moves them by whole units, rounding by about the dtype's epsilon times the logits' size;
- which prompts' first greedy tokens differ, each with its margin (top 1 minus top 2 logprob at the smaller size):
  a near-tie flips under rounding, a clear choice does not;
- the greedy tokens that agree (prompts whose 16 tokens all do, and the mean length of the common prefix).

Prints one table and writes benchmarks/results/tp-agreement-<model>-<runs>-<YYYYMMDD>.json (--out for another
path). `--layers N` keeps the first N layers (NemotronH: the first N of its pattern), to fit float32 on one card.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.gpu_suite import SHAPES, random_prompts, write_model_dir  # noqa: E402

PROMPTS, PROMPT_TOKENS, GREEDY_TOKENS, TOP = 32, 64, 16, 5
DTYPES = ("float32", "bfloat16", "float16")


def shape_with_layers(shape: dict, layers: int | None) -> dict:
    """The shape with its first `layers` layers only (NemotronH's pattern cut to them); all of them for None."""
    if not layers:
        return dict(shape)
    if layers > shape["num_hidden_layers"]:
        raise SystemExit(f"--layers {layers}: the model has {shape['num_hidden_layers']}")
    out = {**shape, "num_hidden_layers": layers}
    if "hybrid_override_pattern" in shape:
        out["hybrid_override_pattern"] = shape["hybrid_override_pattern"][:layers]
    if "layer_types" in shape:
        out["layer_types"] = shape["layer_types"][:layers]
    return out


def run_size(model_dir: str, tp: int, dtype: str, device: str) -> dict:
    """One run's first-token logprobs and greedy tokens (in this process)."""
    from shardserve.entrypoints.llm import LLM
    from shardserve.requests.sampling_params import SamplingParams

    llm = LLM(model_dir, tensor_parallel_size=tp, device=device, dtype=dtype, load_format="dummy",
              max_model_len=PROMPT_TOKENS + GREEDY_TOKENS + 16, max_num_seqs=PROMPTS)
    try:
        prompts = random_prompts(PROMPTS, PROMPT_TOKENS, 9)
        first = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=TOP, detokenize=False))
        greedy = llm.generate(prompts, SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True,
                                                      detokenize=False))
        return {"tp": tp, "dtype": dtype, "top": [[list(t) for t in r.new_logprobs[0].top] for r in first],
                "greedy": [list(r.token_ids) for r in greedy]}
    finally:
        llm.shutdown()


def compare(a: dict, b: dict) -> dict:
    """Run b against run a: logprob moves, first-token flips with a's margins, greedy agreement."""
    moves, flips = [], []
    for i, (top_a, top_b) in enumerate(zip(a["top"], b["top"])):
        la, lb = dict((t, lp) for t, lp in top_a), dict((t, lp) for t, lp in top_b)
        moves += [abs(la[t] - lb[t]) for t in la.keys() & lb.keys()]
        if top_a[0][0] != top_b[0][0]:
            flips.append({"prompt": i, "margin": top_a[0][1] - top_a[1][1]})
    prefixes = []
    for ga, gb in zip(a["greedy"], b["greedy"]):
        same = 0
        while same < min(len(ga), len(gb)) and ga[same] == gb[same]:
            same += 1
        prefixes.append(same)
    margins = [top[0][1] - top[1][1] for top in a["top"]]
    return {"logprob_move_max": max(moves), "logprob_move_median": statistics.median(moves),
            "first_token_flips": flips, "largest_flipped_margin": max((f["margin"] for f in flips), default=None),
            "margin_median": statistics.median(margins),
            "all_greedy_agree_fraction": sum(p == GREEDY_TOKENS for p in prefixes) / len(prefixes),
            "greedy_common_prefix_mean": statistics.mean(prefixes)}


def parse_sizes(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise SystemExit(f"--tp takes comma-separated sizes like 1,2, got {text!r}") from None


def parse_runs(text: str) -> list[tuple[int, str]]:
    """--runs' TP:DTYPE,... as (size, dtype) pairs."""
    runs = []
    for item in text.split(","):
        tp, _, dtype = item.partition(":")
        if not tp.isdigit() or dtype not in DTYPES:
            raise SystemExit(f"--runs takes TP:DTYPE items (DTYPE one of {', '.join(DTYPES)}), got {item!r}")
        runs.append((int(tp), dtype))
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--tp", default="1,2", help="comma-separated TP sizes, the first the reference (default 1,2)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--runs", default=None, metavar="TP:DTYPE,...",
                   help="runs of their own dtypes, the first the reference (in place of --tp and --dtype)")
    p.add_argument("--layers", type=int, default=None, help="keep the model's first N layers")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    p.add_argument("--run-size", type=int, default=None, help=argparse.SUPPRESS)  # one size, in a child process
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run_size:
        print("RESULT " + json.dumps(run_size(args.model_dir, args.run_size, args.dtype, args.device)), flush=True)
        return 0
    runs = parse_runs(args.runs) if args.runs else [(tp, args.dtype) for tp in parse_sizes(args.tp)]
    shape = shape_with_layers(SHAPES[args.model], args.layers)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(os.path.join(tmp, "model"), shape)
        for tp, dtype in runs:  # one process a run: its ranks and memory are gone before the next starts
            cmd = [sys.executable, __file__, "--run-size", str(tp), "--model-dir", model_dir, "--dtype", dtype,
                   "--device", args.device, "--model", args.model]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"TP {tp} in {dtype} failed (exit {proc.returncode})")
            results.append(json.loads(lines[-1][len("RESULT "):]))
    names = [f"tp{tp}_{dtype}" for tp, dtype in runs]
    report = {"model": args.model, "layers": shape["num_hidden_layers"], "runs": names, "prompts": PROMPTS,
              "greedy_tokens": GREEDY_TOKENS, "date": datetime.date.today().isoformat(),
              "comparisons": {f"{names[0]}__{name}": compare(results[0], r)
                              for name, r in zip(names[1:], results[1:])}}
    if args.device == "cuda":
        import torch

        report["device"] = torch.cuda.get_device_name()
    for name, c in report["comparisons"].items():
        print(f"{name} ({args.model}, {shape['num_hidden_layers']} layers): first-token logprobs move "
              f"{c['logprob_move_median']:.2e} median, {c['logprob_move_max']:.2e} at most; "
              f"{len(c['first_token_flips'])} of {PROMPTS} first tokens differ (largest margin among them "
              f"{c['largest_flipped_margin']}, median margin {c['margin_median']:.3f}); "
              f"all {GREEDY_TOKENS} greedy tokens agree in {c['all_greedy_agree_fraction']:.2f} of prompts, "
              f"common prefix {c['greedy_common_prefix_mean']:.1f} tokens on average")
    out = args.out or os.path.join(HERE, "results", f"tp-agreement-{args.model}-{'-'.join(names)}-"
                                                    f"{datetime.date.today():%Y%m%d}.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
