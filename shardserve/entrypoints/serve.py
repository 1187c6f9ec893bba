"""`shardserve serve`: start or join the ranks, then serve HTTP from rank 0."""

from __future__ import annotations

import argparse
import logging
import os

import torch

from shardserve.config import EngineConfig

logger = logging.getLogger(__name__)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was given but no CUDA GPU is visible: use --device cpu")
    return EngineConfig(
        model=args.model, tensor_parallel_size=args.tensor_parallel_size, device=device, dtype=args.dtype,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory_gb=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed, enforce_eager=args.enforce_eager,
        load_format=args.load_format, forward_env=tuple(dict.fromkeys(args.forward_env)),
    )


def serve(args: argparse.Namespace) -> int:
    from shardserve.distributed.launcher import LocalRanks, set_cpu_threads, torchrun_launch_info
    from shardserve.distributed.process_group import destroy_rank_context, init_rank_context
    from shardserve.engine.llm_engine import run_worker

    if not (args.model.endswith(".gguf") and os.path.isfile(args.model)) and not os.path.isdir(args.model):
        raise SystemExit(f"MODEL {args.model!r} is neither a .gguf file nor a model directory")
    config = engine_config_from_args(args)
    launch = torchrun_launch_info()
    ranks = None
    if launch is not None:
        if launch.world_size != config.tensor_parallel_size:
            raise SystemExit(f"torchrun started {launch.world_size} ranks but --tensor-parallel-size is "
                             f"{config.tensor_parallel_size}: make them equal")
        set_cpu_threads(launch.local_world_size)
        ctx = init_rank_context(launch.rank, launch.world_size, config.device, "env://", launch.local_rank,
                                config)
        if launch.rank != 0:
            try:
                run_worker(config, ctx)
            finally:
                destroy_rank_context(ctx)
            return 0
    else:
        ranks = LocalRanks(config)
        ctx = ranks.ctx
    try:
        _serve_rank0(args, config, ctx)
    finally:
        if ranks is not None:
            ranks.close()
        else:
            destroy_rank_context(ctx)
    return 0


def _serve_rank0(args: argparse.Namespace, config: EngineConfig, ctx) -> None:
    from shardserve.engine.async_engine import AsyncEngine
    from shardserve.engine.llm_engine import LLMEngine
    from shardserve.entrypoints.openai.server import build_app, serve_http
    from shardserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(config.model)
    engine = AsyncEngine(lambda: LLMEngine(config, ctx, tokenizer))
    try:
        app = build_app(engine, args.served_model_name or config.model, api_key=args.api_key)
        logger.info("serving %s on http://%s:%d (tensor parallel size %d, %s)", config.model, args.host,
                    args.port, config.tensor_parallel_size, config.device)
        serve_http(app, args.host, args.port)
    finally:
        engine.shutdown()
