"""`shardserve serve`: start or join the ranks, then serve HTTP from rank 0."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import threading

import torch

from shardserve.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500
# API server processes by device when --api-server-count is not given (0: HTTP in the engine's own process).
DEFAULT_API_SERVERS = {"cuda": 1, "cpu": 1}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was given but no CUDA GPU is visible: use --device cpu")
    return EngineConfig(
        model=args.model, tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1), device=device, dtype=args.dtype,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory_gb=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed, enforce_eager=args.enforce_eager,
        load_format=args.load_format, forward_env=tuple(dict.fromkeys(args.forward_env)),
        wake_on_request=args.wake_on_request,
        enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
        quantization=getattr(args, "quantization", None),
        mamba_ssm_cache_dtype=getattr(args, "mamba_ssm_cache_dtype", "auto"),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        speculative_config=getattr(args, "speculative_config", None),
    )


def choose_launch(args: argparse.Namespace, world_size: int):
    """A LaunchInfo (this process is one rank: torchrun, srun per rank) or a NodeLaunch (this process
    starts a node's ranks: --nnodes, srun per node, or all ranks on this machine)."""
    from shardserve.distributed.launcher import NodeLaunch, single_node, slurm_launch, torchrun_launch_info

    torchrun = torchrun_launch_info()
    if torchrun is not None:
        if torchrun.world_size != world_size:
            raise SystemExit(f"torchrun started {torchrun.world_size} ranks but --tensor-parallel-size x "
                             f"--pipeline-parallel-size is {world_size}: make them equal")
        return torchrun
    try:
        if args.nnodes > 1:
            if args.node_rank is None or args.master_addr is None:
                raise ValueError("--nnodes > 1 needs --node-rank and --master-addr (the address of node 0)")
            return NodeLaunch(world_size, args.nnodes, args.node_rank,
                              f"tcp://{args.master_addr}:{args.master_port or DEFAULT_MASTER_PORT}")
        slurm = slurm_launch(world_size, args.master_addr, args.master_port)
    except ValueError as e:
        raise SystemExit(str(e))
    return slurm if slurm is not None else single_node(world_size)


def chat_parsers(args: argparse.Namespace):
    from shardserve.entrypoints.openai.chat_output import ChatParsers

    return ChatParsers(getattr(args, "tool_call_parser", "auto"), getattr(args, "reasoning_parser", None))


def _check_draft_model(args: argparse.Namespace) -> None:
    """--speculative-config's draft model, or the checkpoint's MTP layer, against the target's config, before
    anything loads (ValueError)."""
    spec = getattr(args, "speculative_config", None)
    if spec is None or spec.method not in ("draft_model", "mtp"):
        return
    from shardserve.config import ModelConfig
    from shardserve.engine.draft_model import check_draft_model
    from shardserve.engine.mtp import check_mtp

    target = ModelConfig.from_model_path(args.model)
    if spec.method == "mtp":
        check_mtp(args.model, target, args.pipeline_parallel_size)
    else:
        check_draft_model(spec, target)


def serve(args: argparse.Namespace) -> int:
    from shardserve.distributed.launcher import LaunchInfo, LocalRanks, NodeLaunch, set_cpu_threads
    from shardserve.distributed.process_group import destroy_rank_context, init_rank_context
    from shardserve.engine.llm_engine import run_worker
    from shardserve.engine.pipeline_split import check_stages

    from shardserve.model_files import check_model_path

    try:
        check_model_path(args.model, args.load_format)  # files, architecture, quantization: one line if not
        _check_draft_model(args)
    except ValueError as e:  # a ModelPathError, or a draft model refused
        raise SystemExit(f"shardserve serve: {e}") from None
    if getattr(args, "data_parallel_size", 1) > 1:
        if getattr(args, "distributed_executor_backend", "mp") == "ray":
            raise SystemExit("shardserve serve: --data-parallel-size with --distributed-executor-backend ray is not "
                             "supported: start one server per replica on the cluster")
        from shardserve.pool.replicas import serve_replicas

        return serve_replicas(args, args.argv)
    if args.control_interface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.control_interface  # before any gloo group exists
    config = engine_config_from_args(args)
    try:
        check_stages(config)  # a model or split -pp cannot serve: one line, before any rank starts
    except ValueError as e:
        raise SystemExit(f"shardserve serve: {e}") from None
    if getattr(args, "distributed_executor_backend", "mp") == "ray":
        if config.pipeline_parallel_size > 1:
            raise SystemExit("shardserve serve: --pipeline-parallel-size with --distributed-executor-backend ray is "
                             "not supported yet: use the mp backend (local ranks, torchrun, srun or --nnodes)")
        return _serve_on_ray(args, config)
    launch = choose_launch(args, config.world_size)
    if _serves_http(launch):
        from shardserve.entrypoints.openai.server import bind_http_port

        args.http_socket = bind_http_port(args.host, args.port)
    if isinstance(launch, NodeLaunch) and launch.nnodes == 1:
        return _serve_supervised(args, config)
    if args.max_restarts:
        logger.info("ranks on several machines or under torchrun/srun: restarts are left to the launcher "
                    "(--max-restarts applies to ranks this command starts on one machine)")
    ranks = None
    if isinstance(launch, LaunchInfo):
        set_cpu_threads(launch.local_world_size)
        ctx = init_rank_context(launch.rank, launch.world_size, config.device, launch.init_method,
                                launch.local_rank, config)
    else:
        ranks = LocalRanks(config, launch, worker=run_worker)
        ctx = ranks.ctx
    code = 0
    try:
        if ctx.rank == 0:
            code = _serve_rank0(args, config, ctx)
        else:
            run_worker(config, ctx)
    finally:
        if ranks is not None:
            ranks.close()
        else:
            destroy_rank_context(ctx)
    return code


def _serve_on_ray(args: argparse.Namespace, config: EngineConfig) -> int:
    """Rank 0 here, the other ranks as actors on a Ray cluster (distributed/ray_ranks.py), under the supervisor."""
    from shardserve.distributed.launcher import torchrun_launch_info
    from shardserve.entrypoints.openai.server import bind_http_port

    if importlib.util.find_spec("ray") is None:
        raise SystemExit("shardserve serve: --distributed-executor-backend ray needs Ray: pip install 'shardserve[ray]'")
    if args.nnodes > 1 or torchrun_launch_info() is not None or "SLURM_PROCID" in os.environ:
        raise SystemExit("--distributed-executor-backend ray starts every rank itself: run one `shardserve serve` "
                         "on a node of the Ray cluster, without --nnodes, torchrun or srun")
    from shardserve.distributed.ray_ranks import RayClusterError, preflight

    args.http_socket = bind_http_port(args.host, args.port)
    try:
        preflight(config, _ray_name(args))  # refusals before the API servers start
        return _serve_supervised(args, config)
    except RayClusterError as e:
        raise SystemExit(f"shardserve serve: Ray: {e}") from None


def _start_ranks(args: argparse.Namespace, config: EngineConfig, worker):
    """A fresh set of ranks (a fresh rendezvous port each time): processes on this machine, or Ray actors."""
    from shardserve.distributed.launcher import LocalRanks

    if getattr(args, "distributed_executor_backend", "mp") == "ray":
        from shardserve.distributed.ray_ranks import RayRanks

        return RayRanks(config, worker=worker, name=_ray_name(args))
    return LocalRanks(config, worker=worker)


def _ray_name(args: argparse.Namespace) -> str:
    """The prefix of the rank actors' names: one server per HTTP port, so a live actor under it is an earlier one."""
    return f"shardserve-{args.port}"


def _serves_http(launch) -> bool:
    """Whether this process becomes rank 0, the one that serves the API."""
    from shardserve.distributed.launcher import LaunchInfo, NodeLaunch

    if isinstance(launch, LaunchInfo):
        return launch.rank == 0
    return isinstance(launch, NodeLaunch) and launch.node_rank == 0


def _serve_supervised(args: argparse.Namespace, config: EngineConfig) -> int:
    """All ranks on this machine (or on Ray), under a supervisor that restarts them when one dies."""
    from shardserve.engine.async_engine import AsyncEngine
    from shardserve.engine.llm_engine import LLMEngine, run_worker
    from shardserve.entrypoints.supervisor import Supervisor
    from shardserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(config.model)

    def start_engine(after_iteration):
        def start():
            ranks = _start_ranks(args, config, run_worker)
            try:
                return AsyncEngine(lambda: LLMEngine(config, ranks.ctx, tokenizer), after_iteration), ranks
            except BaseException:
                ranks.close(timeout=10)
                raise

        return Supervisor(start, args.max_restarts)

    return _serve_engine(args, config, start_engine)


def _serve_rank0(args: argparse.Namespace, config: EngineConfig, ctx) -> int:
    from shardserve.engine.async_engine import AsyncEngine
    from shardserve.engine.llm_engine import LLMEngine
    from shardserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(config.model)
    return _serve_engine(args, config,
                         lambda after_iteration: AsyncEngine(lambda: LLMEngine(config, ctx, tokenizer), after_iteration))


def _serve_engine(args: argparse.Namespace, config: EngineConfig, start_engine) -> int:
    """Serve the engine `start_engine(after_iteration)` builds (an AsyncEngine or a Supervisor): through
    --api-server-count front-end processes, or with 0, from this process."""
    if api_server_count(args, config) == 0:
        return _serve_http_until_stopped(args, config, start_engine(None))
    return _serve_through_api_servers(args, config, start_engine)


def api_server_count(args: argparse.Namespace, config: EngineConfig) -> int:
    return args.api_server_count if args.api_server_count is not None else DEFAULT_API_SERVERS[config.device]


def _serve_through_api_servers(args: argparse.Namespace, config: EngineConfig, start_engine) -> int:
    """This process is the engine core; the API servers (front ends) are spawned processes
    (entrypoints/api_servers.py) that reach it through ipc/. Runs until SIGINT/SIGTERM (0) or until the
    engine is dead for good (1)."""
    from shardserve.entrypoints.api_servers import ApiServers, FrontendOptions
    from shardserve.entrypoints.openai.middleware import api_key_in_force
    from shardserve.ipc.core_server import EngineCoreServer

    count = api_server_count(args, config)
    ipc_dir, metrics_dir = ApiServers.make_dirs()
    options = FrontendOptions(
        tokenizer_path=config.model, served_model_name=args.served_model_name or config.model,
        api_key=api_key_in_force(args.api_key), max_body_bytes=int(args.max_request_body_mb * 2**20),
        host=args.host, port=args.port, ipc_dir=ipc_dir, metrics_dir=metrics_dir,
        log_level=logging.getLogger().level, chat_parsers=chat_parsers(args))
    api_servers = ApiServers(count, args.http_socket, options)
    core_server = EngineCoreServer(ipc_dir, count)
    engine = None
    stop = threading.Event()
    previous = {}
    try:
        api_servers.start()  # their tokenizers load while the model does
        engine = start_engine(core_server.flush)
        core_server.attach(engine)
        # From here until every process has stopped in order, SIGINT and SIGTERM only ask for that stop: a
        # second signal (Ctrl-C reaches every process of the group, a pool or systemd adds SIGTERM) must not
        # end this process before it has sent the other ranks their shutdown plan.
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        logger.info("serving %s on http://%s:%d (tensor parallel size %d, %s, %d API server process%s%s)",
                    config.model, args.host, args.port, config.tensor_parallel_size, config.device, count,
                    "es" if count > 1 else "", ", API key required" if options.api_key else "")
        reason = _run_until_stopped(stop, engine, api_servers, core_server)
    finally:
        api_servers.stop(timeout=30)
        core_server.close()
        if engine is not None:
            engine.shutdown()
        api_servers.cleanup()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if reason is None:
        return 0
    logger.error("exiting with status 1: %s", reason)
    return 1


def _run_until_stopped(stop: threading.Event, engine, api_servers, core_server) -> str | None:
    """Watch until `stop` is set (a signal: None) or until the engine is dead for good (the reason); restart API
    servers that die meanwhile."""
    while not stop.wait(0.5):
        reason = _dead_for_good(engine)
        if reason is None:
            reason = api_servers.restart_dead(on_lost=core_server.forget_frontend)
        if reason is not None:
            return reason
    return None


def _serve_http_until_stopped(args: argparse.Namespace, config: EngineConfig, engine) -> int:
    """The HTTP API over `engine` (an AsyncEngine or a Supervisor) until SIGINT/SIGTERM (exit status 0), or
    until the engine is dead for good (1): a supervisor that used up its restarts, or, without one (ranks
    under torchrun, srun or on several machines, which restart them), an engine that failed. Requests in
    flight have their errors by then; the server finishes sending them before it stops."""
    from shardserve.entrypoints.openai.middleware import api_key_in_force
    from shardserve.entrypoints.openai.server import build_app, serve_http

    try:
        api_key = api_key_in_force(args.api_key)
        app = build_app(engine, args.served_model_name or config.model, api_key=api_key,
                        max_body_bytes=int(args.max_request_body_mb * 2**20), chat_parsers=chat_parsers(args))
        logger.info("serving %s on http://%s:%d (tensor parallel size %d, %s%s)", config.model, args.host,
                    args.port, config.tensor_parallel_size, config.device,
                    ", API key required" if api_key else "")
        reason = serve_http(app, args.host, args.port, getattr(args, "http_socket", None),
                            stop_when=lambda: _dead_for_good(engine))
    finally:
        engine.shutdown()
    if reason is None:
        return 0
    logger.error("exiting with status 1: %s", reason)
    return 1


def _dead_for_good(engine) -> str | None:
    if hasattr(engine, "gave_up"):  # a supervisor: dead for good once its restarts are used up
        return engine.gave_up
    error = engine.error
    return f"the engine failed: {error}" if error is not None else None
