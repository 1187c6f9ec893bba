"""What a step plan costs on the host between ranks: rank 0's ControlPlane.send and the other rank's receive.

    python benchmarks/control_plane_latency.py [--steps 300] [--step-ms 3] [--seqs 1,64] [--transport tcp,gloo]

Two CPU processes, one rank each, with the engine's own rank context (gloo control group, the launch's control key)
and ControlPlane, its plans sent over TCP connections (the default; distributed/plan_stream.py) or gloo broadcasts. Rank 0 sends a decode plan of `seqs` sequences (one token from the device each, a block table of
16 blocks) every `step-ms` milliseconds, as a GPU step of that length would pace it; rank 1 receives them. Reports
the median and 99th percentile of the time rank 0 spends in send (the host time it takes from each step) and the
time from rank 0's send starting to rank 1 holding the decoded plan (both clocks are the same machine's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 2)[0])

TOKEN = "control-plane-latency"


def decode_plan(step: int, seqs: int):
    from shardserve.wire.step_plan import FROM_DEVICE, PlanKind, SeqChunk, StepPlan

    chunks = [SeqChunk(s, 128 + step, [FROM_DEVICE], list(range(16 * s, 16 * s + 16)), True) for s in range(seqs)]
    return StepPlan(step, PlanKind.RUN, chunks, tokens_from_device=True)


def rank_main(rank: int, port: int, args, transport: str, results) -> None:
    import os

    import torch

    from shardserve.distributed.control_plane import ControlPlane
    from shardserve.distributed.process_group import destroy_rank_context, init_rank_context

    torch.set_num_threads(1)
    os.environ["SHARDSERVE_PLAN_TRANSPORT"] = transport
    ctx = init_rank_context(rank, 2, "cpu", f"tcp://127.0.0.1:{port}", control_token=TOKEN)
    try:
        plane = ControlPlane.connect(ctx)
        assert plane.transport == transport, f"asked for {transport}, connected {plane.transport}"
        for seqs in args.seqs:
            times = []
            for step in range(args.steps + 20):  # the first 20 warm the connection up
                if rank == 0:
                    plan = decode_plan(step, seqs)
                    started = time.time()
                    plane.send(plan)
                    times.append((started, time.time() - started))
                    time.sleep(args.step_ms / 1000)
                else:
                    plane.receive()
                    times.append(time.time())
            results.put((rank, seqs, times[20:]))
        plane.close()
    finally:
        destroy_rank_context(ctx)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--step-ms", type=float, default=3.0)
    p.add_argument("--seqs", type=lambda s: [int(v) for v in s.split(",")], default=[1, 64])
    p.add_argument("--transport", type=lambda s: s.split(","), default=["tcp", "gloo"])
    args = p.parse_args()
    for transport in args.transport:
        measure(args, transport)
    return 0


def measure(args, transport: str) -> None:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, args, transport, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    got = {}
    for _ in range(2 * len(args.seqs)):
        rank, seqs, times = results.get(timeout=600)
        got[rank, seqs] = times
    for proc in procs:
        proc.join()
    for seqs in args.seqs:
        sends = got[0, seqs]
        send_us = sorted(t * 1e6 for _, t in sends)
        arrive_us = sorted((r - s) * 1e6 for (s, _), r in zip(sends, got[1, seqs]))
        p99 = int(0.99 * (len(send_us) - 1))
        print(f"{transport}, {seqs} sequences: rank 0 in send median {statistics.median(send_us):.0f} us (p99 {send_us[p99]:.0f}); "
              f"plan decoded on rank 1 median {statistics.median(arrive_us):.0f} us after the send began "
              f"(p99 {arrive_us[p99]:.0f})")


if __name__ == "__main__":
    sys.exit(main())
