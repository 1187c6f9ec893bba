"""What a batch-1 decode step's bytes cost to stream with nothing computed (step_floor.cu), phase by phase (a
phase: the bytes one of the step's kernels reads, in the engine's order): Nemotron-3-Nano in bf16 and NVFP4 (every
projection and expert, the head bf16; 239 phases), Qwen3-Next-80B-A3B in bf16 and FP8 blocks (349 phases). Each as one
launch with a grid-wide barrier after each phase (a persistent step kernel's floor), and as one launch a phase chained
by dependent launch (waiting first, or streaming before the wait), beside the same bytes in one phase and the card's
copy rate. What it says: how far below today's steps a design could go on bytes and ordering alone. Needs a Hopper
GPU; `python3 benchmarks/step_floor.py --out results.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_floor.cu")
THREADS, UNROLL = 512, 4
# Nemotron-3-Nano-30B-A3B's layers (benchmarks/gpu_suite.py's shape) and the bytes of each kernel of a layer's decode
# step, by the weights it reads (bytes a weight `w`; the router float32 and the head bf16 in both layouts).
PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
HIDDEN, INNER, EXPERT, SLOTS, CHOICES, EXPERTS, VOCAB = 2688, 4096, 1856, 2, 6, 128, 131072
MAMBA_IN = 2 * INNER + 2 * 8 * 128 + 64  # z, x | B | C, dt
STATE = 64 * 64 * 128 * 4  # a Mamba-2 layer's SSM state, float32


def nemotron_phases(w: float) -> list[tuple[str, int]]:
    """Nemotron-3-Nano's (kernel, bytes it reads) for each kernel of a step, in order; w: bytes a projection or expert
    weight."""
    steps = []
    for kind in PATTERN:
        steps.append(("norm", 0))
        if kind == "M":
            steps += [("in_proj", int(MAMBA_IN * HIDDEN * w)), ("Mamba-2 step", 2 * STATE),
                      ("out_proj", int(HIDDEN * INNER * w))]
        elif kind == "E":
            rows = (CHOICES + SLOTS) * EXPERT
            steps += [("router", EXPERTS * HIDDEN * 4), ("route", 0), ("experts up", int(rows * HIDDEN * w)),
                      ("experts down", int(rows * HIDDEN * w))]
        else:
            steps += [("q|k|v", int((INNER + 2 * 256) * HIDDEN * w)), ("attention", 0), ("combine", 0),
                      ("o_proj", int(HIDDEN * INNER * w))]
    return steps + [("norm", 0), ("head", VOCAB * HIDDEN * 2)]


# Qwen3-Next-80B-A3B: 12 times three Gated DeltaNet layers then a gated attention layer, each before a mixture of 512
# experts (10 chosen and the shared expert as an 11th, 512 features each).
QN_HIDDEN, QN_EXPERT, QN_CHOICES, QN_VOCAB = 2048, 512, 11, 151936
QN_QKVZ, QN_BA, QN_VALUE = 12288, 64, 4096  # DeltaNet's in_proj_qkvz and in_proj_ba rows, its value width
QN_STATE = 32 * 128 * 128 * 4  # a DeltaNet layer's state, float32
QN_QKV, QN_O = 2 * 16 * 256 + 2 * 2 * 256, 16 * 256  # gated attention's q (with its gate) | k | v rows, o's columns


def qwen3_next_phases(w: float) -> list[tuple[str, int]]:
    """Qwen3-Next-80B-A3B's (kernel, bytes it reads) for each kernel of a step, in order; w: bytes a projection or
    expert weight (the router bf16, the head bf16)."""
    steps = []
    for layer in range(48):
        if layer % 4 < 3:
            steps += [("norm + in_proj_qkvz | in_proj_ba", int((QN_QKVZ + QN_BA) * QN_HIDDEN * w)),
                      ("DeltaNet step", 2 * QN_STATE), ("out_proj", int(QN_HIDDEN * QN_VALUE * w))]
        else:
            steps += [("norm + q|k|v", int(QN_QKV * QN_HIDDEN * w)), ("attention", 0), ("combine", 0),
                      ("o_proj", int(QN_HIDDEN * QN_O * w))]
        rows = QN_CHOICES * QN_EXPERT
        steps += [("norm + router", 513 * QN_HIDDEN * 2), ("route", 0), ("experts w13", int(2 * rows * QN_HIDDEN * w)),
                  ("experts w2", int(rows * QN_HIDDEN * w))]
    return steps + [("norm", 0), ("head", QN_VOCAB * QN_HIDDEN * 2)]


# (model, layout): the phases, and the bytes a projection or expert weight takes.
LAYOUTS = {("nemotron3-nano-30b-a3b", "bf16"): (nemotron_phases, 2.0),
           ("nemotron3-nano-30b-a3b", "NVFP4"): (nemotron_phases, 0.5 + 1 / 16),
           ("qwen3-next-80b-a3b", "bf16"): (qwen3_next_phases, 2.0),
           ("qwen3-next-80b-a3b", "FP8 blocks"): (qwen3_next_phases, 1 + 4 / 128)}  # a float32 scale a row and 128
# columns once loaded, as the engine holds them


def by_kernel(steps: list[tuple[str, int]], ends: list[int]) -> dict:
    """Each kernel's time in the chain (its launch's end less the one before's), summed by kernel name: {name: [us,
    launches]}; the first phase, with nothing before it, left out."""
    out: dict[str, list] = {}
    for (name, _), before, end in zip(steps[1:], ends, ends[1:]):
        row = out.setdefault(name, [0.0, 0])
        row[0] += (end - before) / 1000.0
        row[1] += 1
    return {name: [round(us, 1), n] for name, (us, n) in out.items()}


def floors(steps: list[tuple[str, int]], device) -> dict:
    from benchmarks.moe_kernels import graph_time_us
    from shardserve.kernels.cuda import fp4_products, runtime

    source = runtime._source(fp4_products.SOURCE) + open(SOURCE).read()

    def compiled(expression):
        return runtime.Kernel(*runtime.compile_cubin(source, "step_floor.cu", "sm_90a", expression))

    chunks = [-(-nbytes // 16) for _, nbytes in steps]
    firsts = [sum(chunks[:i]) for i in range(len(chunks))]
    weights = torch.empty(16 * max(sum(chunks), 1), dtype=torch.uint8, device=device)
    table = torch.tensor([v for pair in zip(firsts, chunks) for v in pair], dtype=torch.int64, device=device)
    count = torch.zeros(1, dtype=torch.int32, device=device)
    sink = torch.zeros(1, dtype=torch.int32, device=device)
    one = compiled(f"step_floor_one_launch<{THREADS}, {UNROLL}>")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    grid = sms * one.blocks_per_sm(THREADS, 0)
    out = {"bytes": sum(n for _, n in steps), "phases": len(steps), "blocks of the one launch": grid}
    out["one launch, a grid barrier after each phase, us"] = round(graph_time_us(
        lambda: one.launch((grid,), THREADS, [weights, table, len(steps), count, sink]), 10, 3), 1)
    for wait_first, name in ((1, "waiting first"), (0, "streaming before the wait")):
        kernel = compiled(f"phase_stream<{THREADS}, {UNROLL}, {wait_first}>")
        blocks = sms * kernel.blocks_per_sm(THREADS, 0)

        def chain(ends=None):
            for p, (first, n) in enumerate(zip(firsts, chunks)):
                kernel.launch((blocks,), THREADS, [weights, first, n, sink, ends, p], pdl=True)
        out[f"a launch a phase, {name}, us"] = round(graph_time_us(chain, 10, 3), 1)
        ends = torch.zeros(len(steps), dtype=torch.int64, device=device)
        graph_time_us(lambda: chain(ends), 3, 1)  # the last replay's ends are the largest
        out[f"a launch a phase, {name}: us by kernel (sum, launches)"] = by_kernel(steps, ends.cpu().tolist())
    # the same bytes as one phase: the stream alone
    whole = torch.tensor([0, sum(chunks)], dtype=torch.int64, device=device)
    out["the bytes in one phase, one launch, us"] = round(graph_time_us(
        lambda: one.launch((grid,), THREADS, [weights, whole, 1, count, sink]), 10, 3), 1)
    return out


def main() -> None:
    from benchmarks.gpu_suite import copy_rate_GBps

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    args = p.parse_args()
    device = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(), "copy GB/s": round(copy_rate_GBps())}
    for (model, layout), (phases, w) in LAYOUTS.items():
        row = floors(phases(w), device)
        row["bytes at the copy rate, us"] = round(row["bytes"] / result["copy GB/s"] / 1e3, 1)
        result[f"{model}, {layout}"] = row
        print(model, layout, row, flush=True)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
