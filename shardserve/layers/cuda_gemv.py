"""Single-token linear layers on GPUs: Triton GEMVs where they measured no slower than cuBLAS, per shape.

A batch-1 decode step is bound by how fast it streams the weights, and at 32 layers every extra kernel
launch costs a few microseconds more. cuBLAS reaches the bandwidth on large matrices but not on the
attention projections of 8B-class models (it splits K and adds a second kernel); the Triton kernels of
shardserve/kernels/triton/gemv.py do each product in one launch, and can fold in what comes before it
(the residual add and RMSNorm before the QKV and gate/up projections, SwiGLU before the down projection) or
after it (SwiGLU on the gate/up projection's own output).
Which is faster depends on the shape and the GPU, so at start-up every distinct weight shape is timed
both ways (inside a CUDA graph, over the model's own layers so nothing comes from L2) and the winner is
kept. Batches of more than one row always take the unfused path with cuBLAS. SHARDSERVE_GEMV=cublas turns
the Triton path off.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from shardserve import envs
from shardserve.layers.activation import silu_and_mul
from shardserve.layers.linear_kernels import LinearKernel

logger = logging.getLogger(__name__)

# (block_n, block_k, num_warps, num_stages): the three that won some Llama-3-8B shape on H200, out of a grid
# of 24 (benchmarks/gemv_shapes.py).
CANDIDATES = ((8, 512, 4, 1), (4, 1024, 8, 4), (8, 512, 8, 4))
NORMED_CANDIDATES = ((16, 512, 8, 1), (32, 512, 8, 1))
# Layers that preload their rows (KernelLinear.preloads_rows: the o projection, placed while decode attention runs)
# time the candidates, and these, whose whole row block fits in ROW_PRELOAD_MAX_BYTES of registers a thread, with
# every tile loaded before the wait (a fifth element of the configuration: the tiles preloaded); only where every
# program of the launch is placed at once, ROW_PRELOAD_THREADS_PER_SM threads an SM (64 registers a thread), so that
# all of the weight loads while attention runs. On one H100, graph replay of a batch-1 step: Qwen3-30B-A3B's
# 2048x4096 o projection (512 programs) 2.783 -> 2.704 ms; Llama-3-8B's 4096x4096 (1,024 programs, half of them
# placed) 5.195 -> 5.225 ms, its FP8 form 3.050 -> 3.094: those keep their timed forms and attention its order.
ROW_PRELOAD_CANDIDATES = ((2, 1024, 8, 1), (4, 2048, 8, 1))
ROW_PRELOAD_MAX_BYTES = 128
ROW_PRELOAD_THREADS_PER_SM = 1024
# What a program of a layer that loads its whole rows (KernelLinear.loads_whole_rows: a router's, whose programs are
# few) may hold of them before its wait, a thread: 64 registers. Qwen3-Next-80B-A3B FP8 on an H200, graph replay of a
# batch-1 step with its 48 norm-fused routers (512 x 2048) loading one tile first: 2.269 ms; whole: 2.262.
WHOLE_ROWS_MAX_BYTES = 256
# A plain Triton GEMV is kept unless cuBLAS is faster by more than TIE: on ties the Triton kernel wins, since
# its time is the steadier of the two (cuBLAS's in-graph time for the 28672 x 4096 gate/up GEMV on H200 was
# 54.5 us in one process and 61.8 us in another, the Triton kernel's 54.0 in both). A fused form replaces
# two launches that already use the plain winner, so it must be faster by FUSED_MIN_GAIN.
TIE = 0.01
FUSED_MIN_GAIN = 0.03
# The norm inside a GEMV is kept unless the norm kernel and the plain GEMV are faster by 3%: with dependent launch
# the pair times within about 1% of the fused form in isolation, and in whole batch-1 steps on one H100 the fused
# q/k/v was 0.9% faster at Qwen3-30B-A3B's shape (2.780 against 2.804 ms) and 0.4% slower at Llama-3-8B's: one
# launch fewer where timing cannot tell them apart.
NORM_FUSED_MIN_GAIN = -0.03
# A SwiGLU-out form computes nothing twice (each program's gate and up rows give its features' activations): it
# is kept wherever it is faster at all than the product followed by the SwiGLU kernel.
SWIGLU_OUT_MIN_GAIN = 0.0
# The weights' dtypes whose shapes are timed (16-bit: what models are served in; the kernels take float32 too).
GEMV_DTYPES = (torch.bfloat16, torch.float16)


Config = tuple[int, ...]  # (block_n, block_k, num_warps, num_stages[, tiles preloaded])


class Batch1GemvKernel(LinearKernel):
    """F.linear, except one-row inputs on weights whose shape has a chosen Triton configuration. `swiglu` is
    the same for a layer whose input is silu(gate) * up (the MLP's down projection), `normed` for one whose
    input is RMSNorm(x + residual): each fused into one launch. `swiglu_out` and `normed_swiglu_out` are the plain
    and norm-fused forms for a [gate | up] projection that return silu(gate) * up in place of the product, so
    no SwiGLU launch follows (the MLP's gate/up projection)."""

    name = "cuda-gemv"

    def __init__(self, configs: dict[tuple[int, int], Config], swiglu_configs: dict[tuple[int, int], Config],
                 normed_configs: dict[tuple[int, int], Config],
                 swiglu_out_configs: dict[tuple[int, int], Config] | None = None,
                 normed_swiglu_out_configs: dict[tuple[int, int], Config] | None = None) -> None:
        self.configs = configs
        self.swiglu_configs = swiglu_configs
        self.normed_configs = normed_configs
        self.swiglu_out_configs = swiglu_out_configs or {}
        self.normed_swiglu_out_configs = normed_swiglu_out_configs or {}

    def summary(self) -> str:
        """For the kernel plan: how many weight shapes take each Triton form."""
        return (f"triton on {len(self.configs)} shapes, SwiGLU-fused on {len(self.swiglu_configs)}, "
                f"norm-fused on {len(self.normed_configs)}, SwiGLU-out on {len(self.swiglu_out_configs)} "
                f"({len(self.normed_swiglu_out_configs)} with the norm)")

    def as_lists(self) -> list:
        return [[[list(shape), list(c)] for shape, c in configs.items()]
                for configs in (self.configs, self.swiglu_configs, self.normed_configs, self.swiglu_out_configs,
                                self.normed_swiglu_out_configs)]

    @classmethod
    def from_lists(cls, lists: list) -> "Batch1GemvKernel":
        return cls(*({tuple(shape): tuple(c) for shape, c in configs} for configs in lists))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        config = _one_row_config(self.configs, x, weight)
        if config is None:
            return F.linear(x, weight, bias)
        from shardserve.kernels.triton.gemv import gemv

        out = gemv(x, weight, *config)
        return out if bias is None else out + bias

    def swiglu(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        config = _one_row_config(self.swiglu_configs, gate_up, weight)
        if config is None:  # the two launches the fused form was timed against: SwiGLU, then the plain winner
            return self(silu_and_mul(gate_up), weight, None)
        from shardserve.kernels.triton.gemv import gemv_swiglu

        return gemv_swiglu(gate_up, weight, *config)

    def swiglu_out(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of x @ weight^T for a [gate | up] weight, in the GEMV's launch; None where not chosen."""
        config = _one_row_config(self.swiglu_out_configs, x, weight)
        if config is None:
            return None
        from shardserve.kernels.triton.gemv import gemv

        return gemv(x, weight, *config, swiglu_out=True)

    def reduce_add_norm(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, comm, swiglu: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(RMSNorm(s) * norm_weight, s) with s = residual + x @ weight^T summed over comm's group (x = silu(gate)
        * up with `swiglu`), in the GEMV's own launch (Communicator.gemv_add), with the configuration chosen for
        the plain or SwiGLU-fused product; None where there is no such form and the caller reduces after a plain
        product."""
        config = _one_row_config(self.swiglu_configs if swiglu else self.configs, x, weight)
        # Without a SwiGLU-fused form: SwiGLU first, then the plain winner's form (what the fused one was timed
        # against).
        activate_first = config is None and swiglu
        if activate_first:
            config = _one_row_config(self.configs, x, weight)
        fused = comm.gemv_add(residual, config[0]) if config is not None else None
        if fused is None:
            return None
        if activate_first:
            x, swiglu = silu_and_mul(x), False
        return fused(x, weight, residual, norm_weight, eps, swiglu, config)

    def normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
               weight: torch.Tensor, keep_normed: bool = False,
               whole_rows: bool = False) -> tuple[torch.Tensor, ...] | None:
        """(RMSNorm(x + residual) @ weight^T, x + residual) in one launch, or None where not chosen; with
        `keep_normed`, RMSNorm(x + residual) third. `whole_rows`: a program loads all of its rows before the
        dependent-launch wait where they fit (whole_row_tiles; KernelLinear.loads_whole_rows)."""
        config = _one_row_config(self.normed_configs, x, weight)
        if config is None:
            return None
        from shardserve.kernels.triton.gemv import gemv_rmsnorm

        preload = whole_row_tiles(config, weight) if whole_rows else None
        return gemv_rmsnorm(x, residual, norm_weight, eps, weight, *config, keep_normed=keep_normed, preload=preload)

    def normed_swiglu_out(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                          eps: float, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(silu(gate) * up of RMSNorm(x + residual) @ weight^T, x + residual) in one launch for a [gate | up]
        weight, or None where not chosen."""
        config = _one_row_config(self.normed_swiglu_out_configs, x, weight)
        if config is None:
            return None
        from shardserve.kernels.triton.gemv import gemv_rmsnorm

        return gemv_rmsnorm(x, residual, norm_weight, eps, weight, *config, swiglu_out=True)


def _row_preload_forms(shape: tuple[int, int], sms: int) -> list[tuple[int, ...]]:
    """The configurations (with their tiles preloaded: all of them) that preload rows of a 16-bit weight of
    `shape` on a GPU of `sms` SMs (holds_rows)."""
    from shardserve.kernels.triton.gemv import row_tiles

    n, k = shape
    return [(bn, bk, warps, stages, row_tiles(k, bk)) for bn, bk, warps, stages in CANDIDATES + ROW_PRELOAD_CANDIDATES
            if holds_rows(n, k, 2, bn, row_tiles(k, bk) * bk, warps, sms)]


def whole_row_tiles(config: Config, weight: torch.Tensor) -> int:
    """The weight tiles a one-row GEMV program of `config` loads before its wait (KernelLinear.loads_whole_rows):
    all of its rows where they fit in WHOLE_ROWS_MAX_BYTES a thread, else as many tiles as do, never fewer than
    preload_tiles(). A router's 512 x 2048 bf16 rows, 16 a program of 8 warps, take 256 bytes a thread."""
    from shardserve.kernels.triton.gemv import preload_tiles, row_tiles

    block_n, block_k, num_warps = config[:3]
    fitting = WHOLE_ROWS_MAX_BYTES * num_warps * 32 // (block_n * block_k * weight.element_size())
    return min(row_tiles(weight.shape[1], block_k), max(fitting, preload_tiles()))


def holds_rows(n: int, k: int, element_size: int, block_n: int, loaded_k: int, num_warps: int, sms: int) -> bool:
    """Whether a one-row GEMV over an [n, k] weight whose programs each load block_n rows of loaded_k (>= k) columns
    before their wait holds them in ROW_PRELOAD_MAX_BYTES a thread, and all of its programs are placed at once."""
    threads = num_warps * 32
    return (loaded_k >= k and block_n * loaded_k * element_size <= ROW_PRELOAD_MAX_BYTES * threads
            and -(-n // block_n) <= sms * (ROW_PRELOAD_THREADS_PER_SM // threads))


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def rows_preloaded(layer: nn.Module) -> bool:
    """Whether start-up gave `layer` (flagged preloads_rows) a single-row form that loads all its weight rows
    before the dependent-launch wait: the attention before it then lets it launch at its start (pdl.py)."""
    if not getattr(layer, "preloads_rows", False):
        return False
    if layer.packed is not None:
        return layer.packed.preloads_rows(layer)
    configs = getattr(layer.kernel, "configs", None)
    return configs is not None and len(configs.get(tuple(layer.weight.shape), ())) == 5


def _one_row_config(configs: dict[tuple[int, int], Config], x: torch.Tensor, weight: torch.Tensor) -> Config | None:
    """The chosen configuration for a one-row input x on `weight`'s shape, or None (batches, other shapes)."""
    if x.dim() != 2 or x.shape[0] != 1:
        return None
    return configs.get(tuple(weight.shape))


def time_in_graph_us(fn, weights: list[torch.Tensor], x: torch.Tensor, replays: int = 10,
                     stream: torch.cuda.Stream | None = None) -> float:
    """Microseconds per call of fn(x, w) over `weights`, replayed from a CUDA graph (captured on `stream` where
    given: a green context's stream runs the graph on that context's SMs)."""
    for w in weights:
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for w in weights:
            fn(x, w)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(weights))


@torch.inference_mode()
def use_batch1_gemv(model: nn.Module, log: bool = True, agree=None) -> Batch1GemvKernel | None:
    """Time cuBLAS against the Triton candidates for each 16-bit weight shape of the model's linear layers;
    give every linear layer a kernel that uses the winners. Returns it, or None where nothing won.

    A candidate is timed only once it matched a float64 reference on that shape (kernels/self_check.py).
    `agree` (several ranks) maps this rank's choice to the one every rank uses (rank 0's timings decide)."""
    if envs.GEMV.get() == "cublas":
        return None
    from shardserve.kernels.triton import pdl
    from shardserve.kernels.triton.gemv import gemv, gemv_rmsnorm, gemv_swiglu

    layers = [m for m in model.modules() if hasattr(m, "matmul") and getattr(m, "prepared", None) is None]
    by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    swiglu_by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    normed_by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    swiglu_out_by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    preloading: dict[tuple[int, int], list[Config]] = {}  # shapes whose rows load during attention, their forms
    for layer in layers:
        w = layer.weight
        if w.dim() == 2 and w.is_cuda and w.dtype in GEMV_DTYPES and w.stride(1) == 1:
            by_shape.setdefault(tuple(w.shape), []).append(w.data)
            if getattr(layer, "preloads_rows", False) and pdl.attention_overlap():
                forms = _row_preload_forms(tuple(w.shape), sm_count(w.device))
                if forms:
                    preloading[tuple(w.shape)] = forms
            if getattr(layer, "takes_swiglu_input", False):
                swiglu_by_shape.setdefault(tuple(w.shape), []).append(w.data)
            if hasattr(layer, "forward_normed"):
                normed_by_shape.setdefault(tuple(w.shape), []).append(w.data)
            if getattr(layer, "makes_swiglu_output", False) and w.shape[0] % 2 == 0 and layer.bias is None \
                    and swiglu_out_allowed():
                swiglu_out_by_shape.setdefault(tuple(w.shape), []).append(w.data)
    configs, report = _choose({shape: ws for shape, ws in by_shape.items() if shape not in preloading}, 1, F.linear,
                              gemv, "", CANDIDATES, -TIE, _plain_reference)
    for shape, forms in preloading.items():
        row_configs, row_report = _choose({shape: by_shape[shape]}, 1, F.linear, gemv, "", forms, -TIE,
                                          _plain_reference)
        if shape in row_configs:
            row_report = [f"{line} (rows preloaded)" for line in row_report]
        else:  # no preloading form passed its check and beat cuBLAS: the shape is timed as any other
            row_configs, row_report = _choose({shape: by_shape[shape]}, 1, F.linear, gemv, "", CANDIDATES, -TIE,
                                              _plain_reference)
        configs.update(row_configs)
        report += row_report
    plain = Batch1GemvKernel(configs, {}, {})  # the winner for each plain product, the baseline of the fused ones
    swiglu_configs, swiglu_report = _choose(swiglu_by_shape, 2, lambda x, w: plain(silu_and_mul(x), w, None),
                                            gemv_swiglu, "SwiGLU+", CANDIDATES, FUSED_MIN_GAIN,
                                            lambda x, w, o: F.linear(silu_and_mul(x.double()), w[o].double()))
    # Fused: the residual add and the norm in the GEMV (every program recomputes the row's statistics, so
    # wider row blocks are tried too). Unfused: the norm kernel, then the plain winner (conservative: the
    # unfused side skips the residual add).
    normed_configs, normed_report = _choose(
        normed_by_shape, 1, lambda x, w: plain(_unit_norm(x), w, None),
        lambda x, w, *c: gemv_rmsnorm(x, x, torch.ones_like(x[0]), 1e-5, w, *c)[0], "RMSNorm+",
        CANDIDATES + NORMED_CANDIDATES, NORM_FUSED_MIN_GAIN, _normed_reference)
    # SwiGLU out of a [gate | up] projection, against the product and the SwiGLU kernel; then with the norm inside,
    # against what the layer would run without that form (ColumnParallelLinear.forward_normed_swiglu).
    swiglu_out_configs, swiglu_out_report = _choose(
        swiglu_out_by_shape, 1, lambda x, w: silu_and_mul(plain(x, w, None)),
        lambda x, w, *c: gemv(x, w, *c, swiglu_out=True), "SwiGLU-out ", CANDIDATES, SWIGLU_OUT_MIN_GAIN,
        lambda x, w, o: _swiglu_reference(x.double(), w, o), outputs_of=lambda shape: shape[0] // 2)
    unfused = Batch1GemvKernel(configs, {}, normed_configs, swiglu_out_configs)
    normed_swiglu_out_configs, normed_swiglu_out_report = _choose(
        {shape: ws for shape, ws in swiglu_out_by_shape.items() if shape in normed_by_shape}, 1,
        lambda x, w: _normed_then_swiglu(unfused, x, w),
        lambda x, w, *c: gemv_rmsnorm(x, x, torch.ones_like(x[0]), 1e-5, w, *c, swiglu_out=True)[0],
        "RMSNorm+SwiGLU-out ", CANDIDATES + NORMED_CANDIDATES, SWIGLU_OUT_MIN_GAIN,
        lambda x, w, o: _swiglu_reference(_normed_input(x).double(), w, o), outputs_of=lambda shape: shape[0] // 2)
    if log and report:
        logger.info("batch-1 linear layers: %s", ", ".join(report + swiglu_report + normed_report + swiglu_out_report
                                                           + normed_swiglu_out_report))
    kernel = Batch1GemvKernel(configs, swiglu_configs, normed_configs, swiglu_out_configs, normed_swiglu_out_configs)
    if agree is not None:
        kernel = agree(kernel)
    if not any(kernel.as_lists()):
        return None
    for layer in layers:
        layer.kernel = kernel
    return kernel


SWIGLU_OUT_ENV = envs.GEMV_SWIGLU_OUT.name


def swiglu_out_allowed() -> bool:
    """Whether start-up times the SwiGLU-out forms of gate/up projections (SHARDSERVE_GEMV_SWIGLU_OUT=auto, the
    default) or leaves SwiGLU to the down projection or its own launch (off)."""
    return envs.GEMV_SWIGLU_OUT.get() == "auto"


def _unit_norm(x: torch.Tensor) -> torch.Tensor:
    from shardserve.kernels.triton.fused_ops import rms_norm

    return rms_norm(x, torch.ones_like(x[0]), 1e-5)


def _normed_then_swiglu(kernel: Batch1GemvKernel, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of RMSNorm(x + x) @ w^T as a layer without the norm-fused SwiGLU-out form runs it: the
    norm-fused GEMV then SwiGLU where that form was chosen, else the norm, then the SwiGLU-out GEMV (or the
    plain winner and SwiGLU)."""
    normed = kernel.normed(x, x, torch.ones_like(x[0]), 1e-5, w)
    if normed is not None:
        return silu_and_mul(normed[0])
    h = _unit_norm(x)
    out = kernel.swiglu_out(h, w)
    return out if out is not None else silu_and_mul(kernel(h, w, None))


def _swiglu_reference(x: torch.Tensor, w: torch.Tensor, outputs) -> torch.Tensor:
    """float64 silu(gate) * up of x @ w^T at the features `outputs` of a [gate | up] weight w."""
    half = w.shape[0] // 2
    gate, up = F.linear(x, w[:half][outputs].double()), F.linear(x, w[half:][outputs].double())
    return F.silu(gate) * up


def _plain_reference(x: torch.Tensor, w: torch.Tensor, outputs) -> torch.Tensor:
    """float64 x @ w^T at the rows `outputs`."""
    return F.linear(x.double(), w[outputs].double())


def _normed_input(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm(x + x) (unit weight, eps 1e-5) computed in float64, rounded to x's dtype as the model does."""
    h = 2 * x.double()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def _normed_reference(x: torch.Tensor, w: torch.Tensor, outputs) -> torch.Tensor:
    """float64 RMSNorm(x + x) (unit weight, eps 1e-5), rounded to x's dtype as the model does, then @ w^T at the
    rows `outputs`."""
    return F.linear(_normed_input(x).double(), w[outputs].double())


def _choose(by_shape, inputs_per_column: int, baseline_fn, triton_fn, label: str, candidates, min_gain: float,
            reference_fn, outputs_of=lambda shape: shape[0]):
    """Per weight shape, the fastest Triton candidate that matches `reference_fn(x, w, outputs)` (float64, at
    sampled outputs of the outputs_of(shape) a product has) where it beats `baseline_fn` by `min_gain` (a
    fraction of the baseline's time; negative: where it is at most that much slower); and a report."""
    from shardserve.kernels.self_check import TOLERANCE, relative_error, sampled_outputs

    configs, report = {}, []
    for shape, weights in by_shape.items():
        weights = weights[:32]
        x = torch.randn(1, inputs_per_column * shape[1], dtype=weights[0].dtype, device=weights[0].device)
        outputs = sampled_outputs(outputs_of(shape))
        outputs = slice(None) if outputs is None else outputs.to(x.device)
        reference = reference_fn(x, weights[0], outputs).cpu()
        correct = []
        for c in candidates:
            error = relative_error(triton_fn(x, weights[0], *c)[:, outputs], reference)
            if error <= TOLERANCE[weights[0].dtype]:
                correct.append(c)
            else:
                logger.warning("Triton %sGEMV %s on %dx%d failed its start-up check (error %.2g against float64); "
                               "not used", label, c, shape[0], shape[1], error)
        baseline = time_in_graph_us(baseline_fn, weights, x)
        timed = [(time_in_graph_us(lambda x, w, c=c: triton_fn(x, w, *c), weights, x), c) for c in correct]
        if not timed:
            report.append(f"{label}{shape[0]}x{shape[1]} no Triton candidate passed its check")
            continue
        best_us, best = min(timed)
        if best_us < baseline * (1 - min_gain):
            configs[shape] = best
        report.append(f"{label}{shape[0]}x{shape[1]} {'fused' if label else 'triton'} "
                      f"{'chosen' if shape in configs else 'not chosen'} ({best_us:.1f} vs {baseline:.1f} us)")
    return configs, report
