"""Every environment variable shardserve reads, declared once: its type, default, accepted values and help.

Code reads a variable through its declaration (`envs.PDL.get()`), at call time, so a test or a launch can set
it at any point before the code runs. A bad value raises a ValueError naming the variable, the value and what
is accepted. Variables marked `plan` force a choice the kernel plan would otherwise make itself; each one in
effect is shown in the plan (kernels/plan.py). docs/environment.md holds the table of all of them, written by
`python -m shardserve.envs --write-docs` (tests/test_envs.py fails when it drifts from this module).

Tests set variables with `envs.override(SHARDSERVE_PDL="off")`: os.environ itself changes for the duration, so
ranks started inside it inherit the values.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

CHOICE, BOOL, INT, FLOAT, STR = "choice", "bool", "int", "float", "str"


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: str  # CHOICE, BOOL ("0" or "1"), INT, FLOAT (finite and positive), STR
    default: Any  # what get() returns where the variable is unset or empty; None: the code decides
    help: str
    choices: tuple[str, ...] = ()  # CHOICE's accepted values
    plan: bool = False  # overrides a kernel-plan choice, and is shown in the plan where set

    def raw(self) -> str | None:
        """The value as set, or None where unset or empty."""
        return os.environ.get(self.name) or None

    def is_set(self) -> bool:
        return self.raw() is not None

    def get(self) -> Any:
        """The typed value (the default where unset or empty); a ValueError naming the variable otherwise."""
        value = self.raw()
        if value is None:
            return self.default
        if self.kind == CHOICE:
            if value not in self.choices:
                raise self._bad(value, "one of " + ", ".join(self.choices))
            return value
        if self.kind == BOOL:
            if value not in ("0", "1"):
                raise self._bad(value, "1 or 0")
            return value == "1"
        if self.kind == INT:
            try:
                return int(value)
            except ValueError:
                raise self._bad(value, "an integer") from None
        if self.kind == FLOAT:
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if not (math.isfinite(number) and number > 0):
                raise self._bad(value, "a positive number of seconds")
            return number
        return value

    def _bad(self, value: str, expected: str) -> ValueError:
        return ValueError(f"{self.name}={value!r}: expected {expected}")

    def values_text(self) -> str:
        """The accepted values, for the docs table."""
        return {CHOICE: ", ".join(self.choices), BOOL: "1, 0", INT: "integer", FLOAT: "seconds (> 0)",
                STR: "text"}[self.kind]


REGISTRY: dict[str, EnvVar] = {}


def _declare(name: str, kind: str, default: Any, help: str, choices: tuple[str, ...] = (),
             plan: bool = False) -> EnvVar:
    assert name not in REGISTRY, name
    assert (kind == CHOICE) == bool(choices), name
    var = EnvVar(name, kind, default, help, choices, plan)
    REGISTRY[name] = var
    return var


# Kernel-plan overrides, in the order the plan lists those in effect.
LINEAR_KERNEL = _declare(
    "SHARDSERVE_LINEAR_KERNEL", CHOICE, None, "CPU linear kernel (GPUs: torch only); default: chosen by the plan",
    ("bf16-decode", "blockq-decode", "onednn-packed", "torch"), plan=True)
ALL_REDUCE = _declare(
    "SHARDSERVE_ALL_REDUCE", CHOICE, None,
    "all-reduce method (GPUs: nccl, nccl-eager, symm-*, ipc-one-shot; CPUs: gloo, shm); default: timed at start-up",
    ("nccl", "nccl-eager", "symm-one-shot", "symm-two-shot", "ipc-one-shot", "gloo", "shm"), plan=True)
GEMV = _declare("SHARDSERVE_GEMV", CHOICE, "auto", "cublas: no batch-1 Triton GEMVs on GPUs",
                ("auto", "cublas"), plan=True)
DISABLE_TRITON = _declare("SHARDSERVE_DISABLE_TRITON", BOOL, False, "1: CUDA models run on plain torch ops",
                          plan=True)
MIN_SHARD_WIDTH = _declare("SHARDSERVE_MIN_SHARD_WIDTH", INT, 16,
                           "narrowest slice a layer is split into across ranks; narrower layers are replicated",
                           plan=True)
ONEDNN_MAX_CPU_ISA = _declare("ONEDNN_MAX_CPU_ISA", STR, None, "oneDNN's instruction-set cap (read by oneDNN too)",
                              plan=True)
DNNL_MAX_CPU_ISA = _declare("DNNL_MAX_CPU_ISA", STR, None, "older name of ONEDNN_MAX_CPU_ISA", plan=True)
ATEN_CPU_CAPABILITY = _declare("ATEN_CPU_CAPABILITY", STR, None, "PyTorch's CPU kernel level (read by PyTorch)",
                               plan=True)
QUANTIZED_LAYERS = _declare(
    "SHARDSERVE_QUANTIZED_LAYERS", CHOICE, "auto",
    "quantized checkpoints' layers: auto (packed on GPUs, dequantized on CPUs), packed, dequantized",
    ("auto", "packed", "dequantized"), plan=True)
FP8_MATMUL = _declare("SHARDSERVE_FP8_MATMUL", CHOICE, "scaled_mm",
                      "batches' FP8 matmul (row-scaled weights, GPUs with FP8 tensor cores)",
                      ("scaled_mm", "triton"), plan=True)
PDL = _declare("SHARDSERVE_PDL", CHOICE, "auto", "programmatic dependent launch of Triton kernels",
               ("auto", "on", "off"), plan=True)
GEMV_PRELOAD = _declare("SHARDSERVE_GEMV_PRELOAD", CHOICE, "1",
                        "weight tiles a GEMV loads before its dependent-launch wait", ("0", "1", "2"), plan=True)
TOKEN_BROADCAST = _declare("SHARDSERVE_TOKEN_BROADCAST", CHOICE, "peer",
                           "how sampled tokens reach the other ranks on GPUs", ("peer", "nccl"), plan=True)
DECODE_COMBINE = _declare("SHARDSERVE_DECODE_COMBINE", CHOICE, "fused",
                          "paged decode's split combine: in the kernel or a second one", ("fused", "separate"),
                          plan=True)
DECODE_ROTARY = _declare("SHARDSERVE_DECODE_ROTARY", CHOICE, "fused",
                         "decode's rotary embedding: in the attention kernel or apart", ("fused", "separate"),
                         plan=True)
MOE_ONE_TOKEN = _declare("SHARDSERVE_MOE_ONE_TOKEN", CHOICE, "gemv",
                         "a single token's experts: matrix-vector products or the grouped GEMMs",
                         ("gemv", "gemm"), plan=True)
MOE_ONE_TOKEN_TILES = _declare("SHARDSERVE_MOE_ONE_TOKEN_TILES", STR, None,
                               "one-token expert tiles \"up/down\", each \"block_n,block_k,num_warps,num_stages\"",
                               plan=True)
MOE_ONE_TOKEN_PACKED_TILES = _declare("SHARDSERVE_MOE_ONE_TOKEN_PACKED_TILES", STR, None,
                                      "the same for packed (FP8, 4-bit) experts", plan=True)
MOE_ROUTE = _declare("SHARDSERVE_MOE_ROUTE", CHOICE, "separate",
                     "gemv: a single token's router choice runs in the router's GEMV launch",
                     ("gemv", "separate"), plan=True)
FOLD_SHARED_EXPERT = _declare("SHARDSERVE_FOLD_SHARED_EXPERT", BOOL, True,
                              "0: shared experts computed apart from the routed ones", plan=True)
GEMV_SWIGLU_OUT = _declare("SHARDSERVE_GEMV_SWIGLU_OUT", CHOICE, "auto",
                           "off: start-up does not time the SwiGLU-out GEMV forms", ("auto", "off"), plan=True)
ATTENTION_OVERLAP = _declare("SHARDSERVE_ATTENTION_OVERLAP", CHOICE, "on",
                             "the o projection's GEMV may launch to overlap attention", ("on", "off"), plan=True)
NEXT_EARLY = _declare("SHARDSERVE_NEXT_EARLY", CHOICE, "on",
                      "off: norms, routers' choices, state-mixer steps and fp4 GEMVs let the next kernel launch only "
                      "after their wait", ("on", "off"), plan=True)
MOE_PREFETCH_DOWN = _declare("SHARDSERVE_MOE_PREFETCH_DOWN", CHOICE, "on",
                             "off: a single token's FP8 w13 expert programs do not ask L2 for the chosen experts' "
                             "w2 rows", ("on", "off"), plan=True)
FP8_GEMV_SUMS = _declare("SHARDSERVE_FP8_GEMV_SUMS", CHOICE, "auto",
                         "sums the FP8 GEMVs timed at start-up may use (auto: both)",
                         ("auto", "float32", "float16"), plan=True)
INT4_GEMV_SUMS = _declare("SHARDSERVE_INT4_GEMV_SUMS", CHOICE, "auto",
                          "sums the 4-bit GEMVs timed at start-up may use (auto: both)",
                          ("auto", "float32", "float16"), plan=True)
CUDA_KERNELS = _declare("SHARDSERVE_CUDA_KERNELS", CHOICE, "auto",
                        "kernels in CUDA C compiled by NVRTC (kernels/cuda: fp4 GEMVs and experts on Hopper): auto "
                        "(timed or taken where they run), off", ("auto", "off"), plan=True)
MOE_FOUR_BIT_SUMS = _declare("SHARDSERVE_MOE_FOUR_BIT_SUMS", CHOICE, "float16",
                             "float32: a single token's 4-bit experts dequantize each weight in float32, not "
                             "float16 pair sums", ("float16", "float32"), plan=True)
MOE_FOUR_BIT_TILES = _declare("SHARDSERVE_MOE_FOUR_BIT_TILES", STR, None,
                              "tiles 'up/down' of a single token's 4-bit experts with float16 pair sums, each "
                              "'block_n,chunk,num_warps,num_stages'", plan=True)

# Everything else.
GEMV_ALL_REDUCE = _declare("SHARDSERVE_GEMV_ALL_REDUCE", CHOICE, "separate",
                           "fused: a row-parallel GEMV all-reduces in its own launch where it can",
                           ("separate", "fused"))
DEVICE_EXPERTS = _declare("SHARDSERVE_DEVICE_EXPERTS", BOOL, True,
                          "0: MoE experts grouped on the host on GPUs too (no CUDA graphs)")
FUSED_PENALTIES = _declare("SHARDSERVE_FUSED_PENALTIES", BOOL, True, "0: the dense sampling penalties on GPUs too")
OVERLAP_STEPS = _declare("SHARDSERVE_OVERLAP_STEPS", CHOICE, None,
                         "overlapped decoding: 1 forces it (CPUs too), 0 turns it off; default: with CUDA graphs",
                         ("0", "1"))
GRAPH_TIMING = _declare("SHARDSERVE_GRAPH_TIMING", BOOL, False,
                        "1: CUDA events around every graph replay, mean step time logged at close")
STABLE_MEMORY = _declare("SHARDSERVE_STABLE_MEMORY", BOOL, True,
                         "0: sleep frees tensors and wake allocates them again, instead of arenas")
LOCKSTEP_EVERY = _declare("SHARDSERVE_LOCKSTEP_EVERY", INT, None,
                          "steps between lockstep checks of the ranks (at least 1); default: 32 on GPUs, 1 on CPUs")
PLAN_TRANSPORT = _declare("SHARDSERVE_PLAN_TRANSPORT", CHOICE, "tcp", "how step plans reach the other ranks",
                          ("tcp", "gloo"))
COLLECTIVE_TIMEOUT_S = _declare("SHARDSERVE_COLLECTIVE_TIMEOUT_S", FLOAT, 120.0,
                                "timeout of the process groups' collectives")
SETUP_TIMEOUT_S = _declare("SHARDSERVE_SETUP_TIMEOUT_S", FLOAT, 300.0,
                           "a start-up step that takes longer stops its rank")
RAY_RESERVE_TIMEOUT_S = _declare("SHARDSERVE_RAY_RESERVE_TIMEOUT_S", FLOAT, 20.0,
                                 "a Ray backend waits this long for the cluster to free and grant the ranks' resources "
                                 "before it refuses start-up naming what is short")
STALL_RESTART_S = _declare("SHARDSERVE_STALL_RESTART_S", FLOAT, 30.0,
                           "an engine loop without progress this long counts as hung and its ranks restart")
CONTROL_TOKEN = _declare("SHARDSERVE_CONTROL_TOKEN", STR, None,
                         "shared secret of the ranks' control plane (same on every node; required with --nnodes)")
API_KEY = _declare("SHARDSERVE_API_KEY", STR, None,
                   "Bearer token required on every endpoint but /health (default of --api-key)")


def get(name: str) -> Any:
    """The typed value of the declared variable `name`."""
    return REGISTRY[name].get()


def plan_override_names() -> tuple[str, ...]:
    return tuple(var.name for var in REGISTRY.values() if var.plan)


@contextlib.contextmanager
def override(values: Mapping[str, str | None] | None = None, /, **more: str | None) -> Iterator[None]:
    """Set declared variables in os.environ for the duration (None: unset), and restore them after. Values are
    not checked here, so a test can set a bad one and see it refused where it is read."""
    values = {**(values or {}), **more}
    unknown = [name for name in values if name not in REGISTRY]
    if unknown:
        raise KeyError(f"not declared in shardserve/envs.py: {', '.join(unknown)}")
    before = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            _put(name, value)
        yield
    finally:
        for name, value in before.items():
            _put(name, value)


def _put(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def markdown_table() -> str:
    rows = ["| Variable | Values | Default | Shown in the kernel plan | What it does |", "|---|---|---|---|---|"]
    for var in REGISTRY.values():
        default = "unset" if var.default is None else _text(var.default)
        rows.append(f"| `{var.name}` | {var.values_text()} | {default} | {'yes' if var.plan else ''} | "
                    f"{var.help.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


DOCS = Path(__file__).resolve().parent.parent / "docs" / "environment.md"
TABLE_START, TABLE_END = "<!-- envs table: start -->\n", "<!-- envs table: end -->\n"


def docs_with_table(text: str) -> str:
    """`text` (docs/environment.md) with the table between its markers made from the registry."""
    head, rest = text.split(TABLE_START)
    _, tail = rest.split(TABLE_END)
    return head + TABLE_START + markdown_table() + TABLE_END + tail


def main(argv: list[str]) -> int:
    if argv == ["--markdown"]:
        print(markdown_table(), end="")
        return 0
    if argv == ["--write-docs"]:
        DOCS.write_text(docs_with_table(DOCS.read_text()))
        print(f"wrote {DOCS}")
        return 0
    print("usage: python -m shardserve.envs --markdown | --write-docs", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
