"""Two Llama-3-8B-shaped models (random bf16 weights) on the same GPUs, swapped back and forth.

    python benchmarks/sleep_wake_gpu.py --tp 1 [--cycles 50]
    python benchmarks/sleep_wake_gpu.py --tp 2          # on two GPUs

Each model runs in its own process (as in `shardserve pool`). Each cycle puts the awake model to sleep
(level 1) and wakes the other, which must pass its canary before it counts as awake; then the woken
model serves one request, checked against its output before any sleep. Prints per-phase times (median,
max), the device memory in use after each cycle and the host memory of every process involved, and
writes benchmarks/results/<device-kind>-sleep-wake-tp<N>-<YYYYMMDD>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_suite import commit_id, device_kind, write_model_dir  # noqa: E402


def process_tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (the spawned ranks hold their own pinned copies)."""
    total, stack = 0, [pid]
    page = os.sysconf("SC_PAGE_SIZE")
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return total


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "max": max(values), "min": min(values)}


PROMPT = [[(7 * i) % 128000 for i in range(1, 65)]]


def serve_model(conn, model_dir: str, seed: int, options: dict) -> None:
    """One model in its own process (a process holds one torch.distributed group), driven over a pipe."""
    from shardserve.entrypoints.llm import LLM
    from shardserve.requests.sampling_params import SamplingParams

    llm = LLM(model_dir, seed=seed, **options)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, detokenize=False)
    arena = llm.engine.runner.weight_arena
    conn.send(arena.nbytes if arena is not None else None)
    while True:
        command, arg = conn.recv()
        if command == "sleep":
            llm.sleep(arg)
            conn.send(None)
        elif command == "wake":
            llm.wake_up()  # returns once the canary has passed
            conn.send(None)
        elif command == "generate":
            conn.send(llm.generate(PROMPT, params)[0].token_ids)
        elif command == "canary_reloads":
            conn.send(llm.engine.canary_reloads)
        else:
            llm.shutdown()
            conn.send(None)
            return


class ModelProcess:
    def __init__(self, model_dir: str, seed: int, options: dict) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve_model, args=(child, model_dir, seed, options))
        self.process.start()  # not a daemon: its ranks are child processes of its own
        self.weight_bytes = self.conn.recv()

    def call(self, command: str, arg=None):
        self.conn.send((command, arg))
        return self.conn.recv()

    def timed(self, command: str, arg=None) -> float:
        t = time.perf_counter()
        self.call(command, arg)
        return time.perf_counter() - t

    def stop(self) -> None:
        self.call("stop")
        self.process.join(60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cycles", type=int, default=50)
    p.add_argument("--kv-cache-memory", type=float, default=8.0, help="GiB of KV cache per model and rank")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()

    import torch

    gpus = list(range(args.tp))
    used = lambda: [torch.cuda.mem_get_info(g)[1] - torch.cuda.mem_get_info(g)[0] for g in gpus]  # noqa: E731
    model_dir = write_model_dir(os.path.join(tempfile.mkdtemp(), "llama3-8b-shape"))
    options = dict(tensor_parallel_size=args.tp, device="cuda", dtype="bfloat16", load_format="dummy",
                   max_model_len=2048, max_num_seqs=64, kv_cache_memory_gb=args.kv_cache_memory)
    started = time.perf_counter()
    models = {"a": ModelProcess(model_dir, 1, options), "b": ModelProcess(model_dir, 2, options)}
    out: dict = {"tp": args.tp, "startup_both_s": time.perf_counter() - started,
                 "weight_bytes_per_rank": models["a"].weight_bytes}
    expected = {name: m.call("generate") for name, m in models.items()}
    out["first_sleep_s"] = models["b"].timed("sleep", 1)  # includes making the pinned host image
    sleep_s, wake_s, swap_s, device, host, wrong = [], [], [], [], [], 0
    awake, asleep = "a", "b"
    for _ in range(args.cycles):
        slept = models[awake].timed("sleep", 1)
        woke = models[asleep].timed("wake")
        awake, asleep = asleep, awake
        wrong += models[awake].call("generate") != expected[awake]
        sleep_s.append(slept)
        wake_s.append(woke)
        swap_s.append(slept + woke)
        device.append(used())
        host.append(process_tree_rss(os.getpid()))
    out.update(sleep_s=summary(sleep_s[1:]), wake_s=summary(wake_s), swap_s=summary(swap_s[1:]),
               first_cycle_sleep_s=sleep_s[0], wrong_outputs=wrong, cycles=args.cycles,
               device_used_gib_after_cycle=[[round(b / 2**30, 3) for b in d] for d in device],
               device_drift_mib=max((device[-1][g] - device[0][g]) / 2**20 for g in range(len(gpus))),
               host_rss_gib_after_cycle=[round(h / 2**30, 3) for h in host],
               host_drift_mib=(host[-1] - host[0]) / 2**20,
               canary_reloads=sum(m.call("canary_reloads") for m in models.values()),
               device=torch.cuda.get_device_name(0), commit=commit_id(),
               date=datetime.date.today().isoformat())
    print("RESULT " + json.dumps(out), flush=True)
    for m in models.values():
        m.stop()

    print(f"TP={args.tp}: sleep {out['sleep_s']['median']:.3f} s (first {out['first_sleep_s']:.2f} s, "
          f"once per model: it makes the pinned image), wake {out['wake_s']['median']:.3f} s (max "
          f"{out['wake_s']['max']:.3f}), swap {out['swap_s']['median']:.3f} s median (max {out['swap_s']['max']:.3f}); "
          f"drift over {args.cycles} cycles: device {out['device_drift_mib']:+.0f} MiB, host "
          f"{out['host_drift_mib']:+.0f} MiB; wrong outputs {wrong}, canary reloads {out['canary_reloads']}")
    kind = device_kind(torch.cuda.get_device_name(0), torch.cuda.device_count())
    path = os.path.join(args.out, f"{kind}-sleep-wake-tp{args.tp}-{datetime.date.today():%Y%m%d}.json")
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
