"""`shardserve doctor`: can this machine (and its peers) serve? Devices, memory, RDMA limits, the
start-up handshake, and an all-reduce smoke test over the same groups `serve` would use.

Exit status: 0 all good, 1 something blocks serving, 3 warnings only.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardserve.config import EngineConfig

logger = logging.getLogger(__name__)

OK, WARN, FAIL = "ok", "warning", "FAIL"
EXIT = {OK: 0, WARN: 3, FAIL: 1}
SMALL_BYTES, LARGE_BYTES = 4 * 1024, 64 * 1024 * 1024
# Graph-bucket-sized messages of an 8B model (hidden 4096, bf16) for the all-reduce choice on GPUs.
CHOICE_SIZES = [n * 4096 * 2 for n in (1, 8, 64, 256, 512)]


@dataclass
class Finding:
    level: str
    topic: str
    message: str

    def __str__(self) -> str:
        return f"[{self.level:>7}] {self.topic}: {self.message}"


# -- this host ---------------------------------------------------------------------------------
def host_findings(device: str) -> list[Finding]:
    return [*_device_findings(device), _memory_finding(), *_rdma_findings()]


def _device_findings(device: str) -> list[Finding]:
    if not torch.cuda.is_available():
        if device == "cuda":
            return [Finding(FAIL, "GPUs", "--device cuda but torch sees no CUDA GPU (driver, CUDA_VISIBLE_DEVICES?)")]
        from shardserve.distributed.fingerprint import _cpu_model

        return [Finding(OK, "CPU", f"{_cpu_model()}, {os.cpu_count()} cores (no CUDA GPU: serving on CPU)")]
    findings = [Finding(OK, "driver", _driver_version())]
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        level = OK if free > 0.8 * total else WARN
        note = "" if level == OK else " (another process holds the rest)"
        findings.append(Finding(level, f"GPU {i}", f"{torch.cuda.get_device_name(i)}, {free / 2**30:.1f} of "
                                                   f"{total / 2**30:.1f} GiB free{note}"))
    return findings


def _driver_version() -> str:
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return f"NVIDIA driver {out.stdout.splitlines()[0].strip()}, CUDA {torch.version.cuda} in torch"
    return f"CUDA {torch.version.cuda} in torch (nvidia-smi not found)"


def _memory_finding() -> Finding:
    try:
        info = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines() if ":" in line)
        total, available = (int(info[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
    except (OSError, KeyError, ValueError):
        return Finding(OK, "host memory", "unknown (no /proc/meminfo)")
    level = OK if available > 0.1 * total else WARN
    return Finding(level, "host memory", f"{available / 2**30:.1f} of {total / 2**30:.1f} GiB available")


def _rdma_findings() -> list[Finding]:
    if not os.path.isdir("/dev/infiniband"):
        return [Finding(OK, "RDMA", "no /dev/infiniband: NCCL between machines goes over sockets")]
    devices = ", ".join(sorted(os.listdir("/dev/infiniband")))
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY:
        return [Finding(WARN, "RDMA", f"/dev/infiniband has {devices}, but the locked-memory limit is "
                                      f"{soft // 1024} KiB: RDMA needs it unlimited. Fix: `ulimit -l unlimited` "
                                      "before starting, or `* - memlock unlimited` in /etc/security/limits.conf "
                                      "(containers: --ulimit memlock=-1)")]
    return [Finding(OK, "RDMA", f"/dev/infiniband has {devices}; locked memory unlimited")]


# -- across the ranks --------------------------------------------------------------------------
def smoke_test(config: EngineConfig, ctx) -> dict:
    """All-reduce over the data group: correctness, latency at 4 KiB, bus bandwidth at 64 MiB."""
    device = ctx.device
    world = ctx.world_size
    result: dict = {"rank": ctx.rank, "host": os.uname().nodename}
    ones = torch.ones(LARGE_BYTES // 4, dtype=torch.float32, device=device)
    dist.all_reduce(ones, group=ctx.comm.group)
    result["sum_ok"] = bool((ones == world).all())
    small = torch.ones(SMALL_BYTES // 4, dtype=torch.float32, device=device)
    result["small_us"] = statistics.median(_timed(lambda: dist.all_reduce(small, group=ctx.comm.group), device)
                                           for _ in range(50)) * 1e6
    seconds = statistics.median(_timed(lambda: dist.all_reduce(ones, group=ctx.comm.group), device)
                                for _ in range(5))
    result["large_busbw_GBps"] = LARGE_BYTES / seconds * 2 * (world - 1) / world / 1e9
    if device.type == "cuda":
        from shardserve.distributed import all_reduce

        # As the engine measures it: the peer-memory kernels too, on [tokens, 4096] messages.
        choice = all_reduce.calibrate(ctx.comm.group, device, torch.bfloat16, CHOICE_SIZES, graph_slots=4,
                                      control_group=ctx.control_group, row_bytes=4096 * 2)
        result["choice"] = choice.describe()
        ctx.comm.use(choice)
        ctx.comm.close()  # frees the peer memory the measurement set up
    return result


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def doctor_worker(config: EngineConfig, ctx) -> None:
    """What a spawned rank runs under `doctor`: the smoke test, its result gathered on rank 0."""
    _gather(ctx, smoke_test(config, ctx))


def _gather(ctx, mine: dict) -> list[dict] | None:
    from shardserve.distributed.control_plane import all_gather_msgpack

    return all_gather_msgpack(mine, ctx.control_group, ctx.world_size)


def rank_findings(results: list[dict], backend: str) -> list[Finding]:
    world = len(results)
    bad = [f"rank {r['rank']} ({r['host']})" for r in results if not r["sum_ok"]]
    if bad:
        return [Finding(FAIL, "all-reduce", f"wrong sums on {', '.join(bad)}: the data plane corrupts messages")]
    small = max(r["small_us"] for r in results)
    busbw = min(r["large_busbw_GBps"] for r in results)
    findings = [Finding(OK, "all-reduce", f"{world} ranks over {backend}: 4 KiB in {small:.1f} us (median, "
                                          f"slowest rank), 64 MiB at {busbw:.2f} GB/s bus bandwidth")]
    if "choice" in results[0]:
        findings.append(Finding(OK, "all-reduce choice", results[0]["choice"]))
    return findings


# -- the command -------------------------------------------------------------------------------
def doctor(args: argparse.Namespace) -> int:
    from shardserve.distributed.handshake import StartupMismatch
    from shardserve.distributed.launcher import LaunchInfo, LocalRanks, set_cpu_threads
    from shardserve.distributed.process_group import destroy_rank_context, init_rank_context
    from shardserve.entrypoints.serve import choose_launch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.control_interface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.control_interface
    findings = host_findings(device)
    config = EngineConfig(model="", tensor_parallel_size=args.tensor_parallel_size, device=device,
                          forward_env=tuple(dict.fromkeys(args.forward_env)))
    ctx = ranks = None
    if config.tensor_parallel_size > 1 and not any(f.level == FAIL for f in findings):
        try:
            launch = choose_launch(args, config.tensor_parallel_size)
            if isinstance(launch, LaunchInfo):
                set_cpu_threads(launch.local_world_size)
                ctx = init_rank_context(launch.rank, launch.world_size, device, launch.init_method,
                                        launch.local_rank, config)
            else:
                ranks = LocalRanks(config, launch, worker=doctor_worker)
                ctx = ranks.ctx
            findings.append(Finding(OK, "handshake", f"{ctx.world_size} ranks run the same code, config and "
                                                     "environment"))
            results = _gather(ctx, smoke_test(config, ctx))
            if ctx.rank == 0:
                findings += rank_findings(results, "NCCL" if device == "cuda" else "gloo")
        except StartupMismatch as e:
            findings.append(Finding(FAIL, "handshake", str(e)))
        finally:
            if ranks is not None:
                ranks.close()
            elif ctx is not None:
                destroy_rank_context(ctx)
    for finding in findings:
        print(finding, flush=True)
    worst = max((EXIT[f.level] for f in findings), key=lambda code: (code == 1, code))
    verdict = {0: "ready to serve", 3: "can serve, with warnings above", 1: "cannot serve: see FAIL above"}[worst]
    print(f"doctor: {verdict}")
    return worst
