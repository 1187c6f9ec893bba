"""`shardserve bench`: the parsed command line in, the table and the result files out.

Exit status 0 when every request completed, 1 when some failed (their errors are printed and saved;
the run still finishes every level), 2 for a workload that cannot be built.
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys

from rich.console import Console

from shardserve.version import __version__
from shardserve.bench.metrics import client_bound_warning
from shardserve.bench.report import plot, print_table, write_csv, write_json
from shardserve.bench.runner import BenchConfig, run_bench
from shardserve.bench.workload import Workload, WorkloadError, load_dataset


def bench(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    try:
        workload = _workload(args, seed)
    except (WorkloadError, OSError) as e:
        print(f"shardserve bench: error: {e}", file=sys.stderr)
        return 2
    config = BenchConfig(base_url=args.base_url, model=args.model, concurrency=args.concurrency,
                         request_rate=args.request_rate, slos=tuple(args.goodput), api_key=args.api_key,
                         num_warmups=args.num_warmups, timeout_s=args.request_timeout)
    console = Console(stderr=True)
    print(announcement(args), file=sys.stderr, flush=True)
    levels = run_bench(config, workload, console)
    title = f"{args.model} at {args.base_url}: {_describe(args)}"
    # Off a terminal rich would wrap the table at 80 columns.
    print_table(levels, Console() if sys.stdout.isatty() else Console(width=200), title)
    record = _run_record(args, seed)
    mismatch = prompt_length_mismatch(args, levels)
    if mismatch is not None:
        print(f"shardserve bench: WARNING: {mismatch}", file=sys.stderr, flush=True)
        record.update(input_len_exact=False, prompt_length_warning=mismatch)
    client_bound = client_bound_warning(levels)
    if client_bound is not None:
        print(f"shardserve bench: WARNING: {client_bound}", file=sys.stderr, flush=True)
        record.update(client_bound_warning=client_bound)
    if args.out:
        write_json(args.out, record, levels)
    if args.csv:
        write_csv(args.csv, levels)
    if args.plot:
        plot(levels, title).savefig(args.plot, dpi=120)
    return 1 if mismatch is not None or any(level.failed for level in levels) else 0


# A first picture against a server on a few CPU cores: about a minute against SmolLM2 on two (docs/measuring.md).
SMALL_RUN = "--concurrency 1,4 --num-prompts 16 --output-len 32"
SMALL_RUN_TOKENS = 2 * 16 * 32
# A run that generates more than this takes minutes there, so the announcement says how to ask for less.
LONG_RUN_TOKENS = 4 * SMALL_RUN_TOKENS


def announcement(args: argparse.Namespace) -> str:
    """What the run will ask for, said before it starts; for a long run, how to ask a small server for less."""
    tokens = len(args.concurrency) * args.num_prompts * args.output_len
    line = (f"shardserve bench: {len(args.concurrency)} levels x {args.num_prompts} requests, {args.output_len} "
            f"output tokens each: {tokens:,} tokens to generate")
    if tokens > LONG_RUN_TOKENS:
        line += f" (against a server on a few CPU cores, fewer do: {SMALL_RUN})"
    return line


def prompt_length_mismatch(args: argparse.Namespace, levels) -> str | None:
    """Why the prompts the server counted (`usage.prompt_tokens`) are not the ones this run meant to send, or
    None. With --tokenizer every prompt is exactly --input-len tokens; without, about one token a word, so a
    count under half or over twice that means the figures describe another workload (a word-level tokenizer
    without a whitespace pre-tokenizer counts a whole prompt as one token)."""
    if args.dataset is not None:
        return None
    completed = sum(level.completed for level in levels)
    counted = sum(level.total_input_tokens for level in levels)
    if completed == 0:
        return None
    if counted == 0:
        return "the server reported no usage.prompt_tokens: the prompt lengths of this run are unchecked"
    mean = counted / completed
    if args.tokenizer is not None:
        if counted != completed * args.input_len:
            return (f"the server counted {mean:.1f} prompt tokens per request on average, not the {args.input_len} "
                    f"this run built with --tokenizer {args.tokenizer}: does the server use the same tokenizer?")
        return None
    if not 0.5 <= mean / args.input_len <= 2.0:
        return (f"the server counted {mean:.1f} prompt tokens per request on average for prompts of about "
                f"{args.input_len} words: the figures describe another workload than --input-len says (a "
                f"word-level tokenizer without a whitespace pre-tokenizer counts a whole prompt as one token); "
                f"pass --tokenizer to build prompts of exact length")
    return None


def _workload(args: argparse.Namespace, seed: int) -> Workload:
    if args.dataset is not None:
        return Workload(args.num_prompts, args.output_len, dataset=load_dataset(args.dataset), seed=seed)
    tokenizer = None
    if args.tokenizer is not None:
        from shardserve.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_model_path(args.tokenizer)
    return Workload(args.num_prompts, args.output_len, input_len=args.input_len, shared_prefix=args.shared_prefix,
                    tokenizer=tokenizer, seed=seed)


def _describe(args: argparse.Namespace) -> str:
    prompts = f"dataset {args.dataset}" if args.dataset else \
        f"{'' if args.tokenizer else '~'}{args.input_len} prompt tokens"
    rate = "all at once" if args.request_rate == float("inf") else f"{args.request_rate:g} req/s Poisson"
    return f"{args.num_prompts} requests per level, {prompts}, {args.output_len} output tokens, {rate}"


def _run_record(args: argparse.Namespace, seed: int) -> dict:
    """The settings of this run, as the JSON file records them beside the levels."""
    return {
        "tool": f"shardserve bench {__version__}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "base_url": args.base_url, "model": args.model, "concurrency": list(args.concurrency),
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "input_len_exact": args.tokenizer is not None, "tokenizer": args.tokenizer, "dataset": args.dataset,
        "shared_prefix": args.shared_prefix,
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "goodput_slos_ms": {slo.key: slo.limit_ms for slo in args.goodput}, "num_warmups": args.num_warmups,
        "seed": seed,
    }
