"""What a batch-1 decode step's bytes cost to stream with nothing computed (step_floor.cu), phase by phase (a
phase: the bytes one of the step's kernels reads, in the engine's order): Nemotron-3-Nano in bf16 and NVFP4 (every
projection and expert, the head bf16; 239 phases), Qwen3-Next-80B-A3B in bf16 and FP8 blocks (350 phases). Each as one
launch with a grid-wide barrier after each phase (a persistent step kernel's floor), and as one launch a phase chained
by dependent launch (waiting first, or streaming before the wait), beside the same bytes in one phase and the card's
copy rate. What it says: how far below today's steps a design could go on bytes and ordering alone. Needs a Hopper
GPU; `python3 benchmarks/step_floor.py --out results.json`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.result_file import report  # noqa: E402

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_floor.cu")
THREADS, UNROLL = 512, 4


def nemotron_phases(w: float) -> list[tuple[str, int]]:
    """Nemotron-3-Nano's (kernel, bytes it reads) for each kernel of a step, in order (gpu_suite's shape); w: bytes a
    projection or expert weight (the routers float32, the head bf16)."""
    from benchmarks.gpu_suite import NEMOTRON_3_NANO_30B_A3B as c

    hidden, heads, state = c["hidden_size"], c["mamba_num_heads"], c["ssm_state_size"]
    inner = heads * c["mamba_head_dim"]
    mamba_in = 2 * inner + 2 * c["n_groups"] * state + heads  # z, x | B | C, dt
    ssm_state = inner * state * 4  # float32
    # the routed choices and the shared expert as slots of the experts' width, as the engine runs them at batch 1
    expert_rows = c["num_experts_per_tok"] * c["moe_intermediate_size"] + c["moe_shared_expert_intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    steps = []
    for kind in c["hybrid_override_pattern"]:
        steps.append(("norm", 0))
        if kind == "M":
            steps += [("in_proj", int(mamba_in * hidden * w)), ("Mamba-2 step", 2 * ssm_state),
                      ("out_proj", int(hidden * inner * w))]
        elif kind == "E":
            steps += [("router", c["n_routed_experts"] * hidden * 4), ("route", 0),
                      ("experts up", int(expert_rows * hidden * w)), ("experts down", int(expert_rows * hidden * w))]
        else:
            steps += [("q|k|v", int((q + 2 * kv) * hidden * w)), ("attention", 0), ("combine", 0),
                      ("o_proj", int(hidden * q * w))]
    return steps + [("norm", 0), ("head", c["vocab_size"] * hidden * 2)]


def qwen3_next_phases(w: float) -> list[tuple[str, int]]:
    """Qwen3-Next-80B-A3B's (kernel, bytes it reads) for each kernel of a step, in order (gpu_suite's shape); w: bytes
    a projection or expert weight (the routers and the head bf16)."""
    from benchmarks.gpu_suite import QWEN3_NEXT_80B_A3B as c

    hidden = c["hidden_size"]
    keys = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    values = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    qkvz, ba = 2 * keys + 2 * values, 2 * c["linear_num_value_heads"]
    state = c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"] * 4
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    # the chosen experts and the shared expert as one more, each gate and up rows then down rows
    expert_rows = c["num_experts_per_tok"] * c["moe_intermediate_size"] + c["shared_expert_intermediate_size"]
    router = (c["num_experts"] + 1) * hidden * 2  # its row 513 the shared expert's gate
    steps = []
    for kind in c["layer_types"]:
        if kind == "linear_attention":
            steps += [("norm + in_proj_qkvz | in_proj_ba", int((qkvz + ba) * hidden * w)), ("DeltaNet step", 2 * state),
                      ("out_proj", int(hidden * values * w))]
        else:  # q with its output gate
            steps += [("norm + q|k|v", int((2 * q + 2 * kv) * hidden * w)), ("attention", 0), ("combine", 0),
                      ("o_proj", int(hidden * q * w))]
        steps += [("norm + router", router), ("route", 0), ("experts w13", int(2 * expert_rows * hidden * w)),
                  ("experts w2", int(expert_rows * hidden * w))]
    return steps + [("norm", 0), ("head", c["vocab_size"] * hidden * 2)]


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
    from benchmarks.cuda_probes import compiled, probe_source
    from benchmarks.moe_kernels import graph_time_us

    source = probe_source(os.path.basename(SOURCE))

    chunks = [-(-nbytes // 16) for _, nbytes in steps]
    firsts = [sum(chunks[:i]) for i in range(len(chunks))]
    weights = torch.empty(16 * max(sum(chunks), 1), dtype=torch.uint8, device=device)
    table = torch.tensor([v for pair in zip(firsts, chunks) for v in pair], dtype=torch.int64, device=device)
    count = torch.zeros(1, dtype=torch.int32, device=device)
    sink = torch.zeros(1, dtype=torch.int32, device=device)
    one = compiled(source, os.path.basename(SOURCE), f"step_floor_one_launch<{THREADS}, {UNROLL}>")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    grid = sms * one.blocks_per_sm(THREADS, 0)
    out = {"bytes": sum(n for _, n in steps), "phases": len(steps), "blocks of the one launch": grid}
    out["one launch, a grid barrier after each phase, us"] = round(graph_time_us(
        lambda: one.launch((grid,), THREADS, [weights, table, len(steps), count, sink]), 10, 3), 1)
    for wait_first, name in ((1, "waiting first"), (0, "streaming before the wait")):
        kernel = compiled(source, os.path.basename(SOURCE), f"phase_stream<{THREADS}, {UNROLL}, {wait_first}>")
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
    report(result, args.out, print_indent=1)


if __name__ == "__main__":
    main()
