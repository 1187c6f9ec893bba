"""Start-up of one rank's kernels: check each chosen kernel on this model's shapes, agree with the other
ranks, attach them, and compare the finished kernel plan (kernels/plan.py) across ranks. The model runner calls
set_up_linear_layers for every linear layer's kernels (dense, packed quantized, the batch-1 GEMVs),
set_up_token_mixers for the attention, Gated DeltaNet and Mamba-2 kernels, and the all-reduce check below.

Every function here that takes a RankContext is a collective: all ranks call it in the same order. A kernel
that fails its check on any rank is dropped on every rank (with a WARNING naming the rank and the error),
so the ranks never run one model two ways; if no candidate is left, start-up stops on every rank.
"""

from __future__ import annotations

import logging
import math
import socket
import time

import torch
from torch import nn

from shardserve.attention import StepBatch, create_attention_backend, kv_quant
from shardserve.distributed.all_reduce import message_shape
from shardserve.distributed.control_plane import all_gather_msgpack
from shardserve.distributed.handshake import StartupMismatch
from shardserve.distributed.process_group import RankContext
from shardserve.distributed.setup_watchdog import setup_step
from shardserve.engine.kv_cache import allocate_kv_cache
from shardserve.wire.step_plan import SeqChunk
from shardserve.kernels import cpu_extensions
from shardserve.kernels.plan import KernelPlan, KernelPlanError
from shardserve.kernels.self_check import (TOLERANCE, CheckResult, attention_reference, attention_tolerance,
                                           check_delta_net, check_linear, check_mamba2, head_norm_reference,
                                           relative_error, rotate_reference)
from shardserve.layers.attention import overlap_with_o_projection
from shardserve.layers.cuda_gemv import use_batch1_gemv
from shardserve.layers.linear import KernelLinear
from shardserve.layers.linear_kernels import build_linear_kernel
from shardserve.layers.quantization import check as packed_check
from shardserve.layers.quantization import gemm_choice, gemv_choice, selection
from shardserve.layers.quantization.packed import quantized_layers_mode

logger = logging.getLogger(__name__)


def _gather(value, ctx: RankContext) -> list:
    if ctx.world_size == 1:
        return [value]
    return all_gather_msgpack(value, ctx.control_group, ctx.world_size)


def _from_stage_leader(value, ctx: RankContext):
    """The value of the first rank of this rank's pipeline stage (rank 0 with one stage), on each rank: choices
    timed on a stage's own layers (which differ between stages) are agreed within the stage."""
    return _gather(value, ctx)[ctx.rank_of(ctx.stage, 0)]


def _by_rank(value, ctx: RankContext) -> list[tuple[str, object]]:
    """Every rank's `value` (plain data), as ('rank R (host)', value) in rank order, on every rank."""
    gathered = _gather([ctx.rank, socket.gethostname(), value], ctx)
    return [(f"rank {rank} ({host})", v) for rank, host, v in gathered]


def _failures(local: CheckResult | None, ctx: RankContext) -> list[str]:
    """Every rank's failed check (None: passed), as 'rank R (host): what failed', agreed on all ranks."""
    mine = None if local is None else local.describe()
    return [f"{who}: {failure}" for who, failure in _by_rank(mine, ctx) if failure is not None]


def linear_layers_by_shape(model: nn.Module) -> dict[tuple, KernelLinear]:
    """One layer of each distinct (weight shape, with bias) among the model's linear layers, in model order:
    what this rank's kernels must be right on (sharded, replicated and the vocabulary-parallel head)."""
    found: dict[tuple, KernelLinear] = {}
    for module in model.modules():
        if isinstance(module, KernelLinear) and module.prepared is None and module.packed is None:
            found.setdefault((tuple(module.weight.shape), _bias(module) is not None), module)
    return found


def _bias(layer: KernelLinear) -> torch.Tensor | None:
    bias = getattr(layer, "bias", None)
    return None if bias is None else bias.data


def set_up_linear_layers(model: nn.Module, plan: KernelPlan, ctx: RankContext, linear_kernel=None, *,
                         packed: bool = False, stopwatch: "Stopwatch | None" = None):
    """Every linear layer's kernels, checked and agreed on every rank, attached: the packed quantized layers'
    (their single-row and batch kernels: setup_packed_layers), the dense layers' LinearKernel (chosen at the first
    load; `linear_kernel`, the one chosen before, on a reload), and on GPUs the batch-1 GEMVs and the o projection
    launched during attention. Returns (the plan with what was chosen, the linear kernel). `stopwatch` times the
    checks."""
    timed = stopwatch if stopwatch is not None else Stopwatch()
    device = ctx.device
    if linear_kernel is None:  # the first load, whose checks choose the kernels
        prepare_checks(plan, ctx)
    if packed:
        with timed, setup_step("check the quantized layers' kernels", ctx.rank):
            plan = plan.with_results(quantized=setup_packed_layers(model, ctx, device))
    if linear_kernel is None:
        with timed, setup_step("choose and check the linear kernel", ctx.rank):
            linear_kernel = choose_linear_kernel(model, plan, ctx)
        plan = plan.with_results(linear=linear_kernel.name)
    prepared, compact = attach_linear_kernel(model, linear_kernel)
    if prepared and ctx.is_driver:
        logger.info("linear layers: %s kernels (%d layers prepared%s)", linear_kernel.name, prepared,
                    f", {compact} with a compact copy for decode steps" if compact else "")
    if device.type == "cuda":
        with setup_step("choose the batch-1 GEMVs", ctx.rank):
            gemv = use_batch1_gemv(model, log=ctx.is_driver, agree=lambda chosen: agree_on_gemv(chosen, ctx))
        from shardserve.kernels.triton import pdl

        overlapped = overlap_with_o_projection(model)  # after every rank agreed on the GEMVs' forms
        plan = plan.with_results(
            gemv=gemv.summary() if gemv is not None else "cublas",
            dependent_launch=pdl.describe(device) + (
                ", early launches after norms, routers' choices, state steps and fp4 GEMVs"
                if pdl.launches_next_early(device) else "") + (
                f", the o projection's rows loaded during attention in {overlapped} layers" if overlapped else ""))
    return plan, linear_kernel


def set_up_token_mixers(model: nn.Module, plan: KernelPlan, ctx: RankContext, block_size: int,
                        kv_dtype: torch.dtype, ssm_dtype: torch.dtype, stopwatch: "Stopwatch | None" = None):
    """The kernels that mix tokens, each past its start-up check on every rank: attention (the model's own backend
    where it declares one, attention_backend: DeepSeek's latent attention; else the paged one for its head layout),
    and the Gated DeltaNet and Mamba-2 layers' kernels of hybrid models. Returns (the attention backend, the plan
    with what was chosen). `stopwatch` times the checks."""
    timed = stopwatch if stopwatch is not None else Stopwatch()
    device, dtype = ctx.device, plan.dtype
    with timed, setup_step("check the attention kernel", ctx.rank):
        own = getattr(model, "attention_backend", None)
        if own is not None:
            attention = checked_latent_attention(own(device, block_size), model, dtype, device, block_size, ctx)
        else:
            attn = model.paged_attention()
            backend = create_attention_backend(device, block_size, attn.num_heads, attn.num_kv_heads,
                                               attn.kv_index_tuple)
            attention = checked_attention(backend, attn, model.model.rotary, dtype, device, block_size, ctx,
                                          kv_dtype=kv_dtype)
    plan = plan.with_results(attention=attention.name)
    with timed, setup_step("check the Gated DeltaNet kernels", ctx.rank):
        plan = plan.with_results(delta_net=checked_delta_net(model, dtype, device, ctx))
    with timed, setup_step("check the Mamba-2 kernels", ctx.rank):
        plan = plan.with_results(mamba2=checked_mamba2(model, dtype, ssm_dtype, device, ctx))
    return attention, plan


def prepare_checks(plan: KernelPlan, ctx: RankContext) -> None:
    """Before a launch's first checks: build the CPU extensions the linear candidates need (a first start's build is
    logged: it takes about a minute; later starts load them from the cache), so the checks' time is their own; then
    say that the checks begin."""
    cpu_extensions.build_for(plan.linear_candidates)
    if ctx.is_driver:
        logger.info("checking each kernel against float64 on this model's shapes before serving")


def choose_linear_kernel(model: nn.Module, plan: KernelPlan, ctx: RankContext):
    """The first of the plan's linear candidates that passes its check on every distinct shape on every rank.

    A candidate that cannot run on some ranks but can on others (an extension that did not build on one node)
    stops start-up, naming the ranks: their setups differ. One that runs everywhere but computes wrong numbers
    on any rank is dropped on every rank for the next candidate."""
    layers = linear_layers_by_shape(model)
    failed: list[str] = []
    for name in plan.linear_candidates:
        kernel, unavailable = build_linear_kernel(name)
        worst = None if kernel is None else _worst_linear_check(name, kernel, layers, plan.dtype)
        # One exchange per candidate: [why it cannot run here, what failed its check], each None when fine.
        verdicts = _by_rank([unavailable or None, None if worst is None else worst.describe()], ctx)
        missing = [f"{who}: {why}" for who, (why, _) in verdicts if why]
        if missing and len(missing) < len(verdicts):
            raise StartupMismatch(f"linear kernel {name} runs on some ranks but not on others, so start-up stops "
                                  f"here (make the nodes alike, or set SHARDSERVE_LINEAR_KERNEL on every rank):\n  "
                                  + "\n  ".join(missing))
        problems = missing or [f"{who}: {bad}" for who, (_, bad) in verdicts if bad]
        if not problems:
            return kernel
        failed += problems
        rest = plan.linear_candidates[plan.linear_candidates.index(name) + 1:]
        if ctx.is_driver:
            logger.warning("linear kernel %s failed its start-up check, %s: %s", name,
                           f"using {rest[0]} instead" if rest else "and no other candidate is left",
                           "; ".join(problems))
    raise KernelPlanError("no linear kernel passed its start-up check against a float64 reference, so start-up "
                          "stops here:\n  " + "\n  ".join(failed))


def _worst_linear_check(name: str, kernel, layers: dict[tuple, KernelLinear],
                        dtype: torch.dtype) -> CheckResult | None:
    """The first failed check of candidate `name` over the layers' shapes, or None when all pass."""
    for (shape, _), layer in layers.items():
        result = check_linear(kernel, layer.weight.data, _bias(layer), dtype, f"{name} {shape[0]}x{shape[1]}")
        if not result.passed:
            return result
    return None


def attach_linear_kernel(model: nn.Module, kernel) -> tuple[int, int]:
    """Give every linear layer the kernel (preparing its weights). Returns how many layers were prepared and how
    many of them keep a compact copy for decode steps beside the float32 one (bf16-decode, blockq-decode)."""
    if kernel.name == "torch":
        return 0, 0
    count = compact = 0
    for module in model.modules():
        # Packed layers run their own kernels; layers that keep a dense weight (DeepSeek's kv_b_proj, whose weight
        # the absorbed decode reads) stay plain F.linear.
        if isinstance(module, KernelLinear) and module.packed is None and not getattr(module, "keeps_dense_weight",
                                                                                      False):
            module.use_kernel(kernel)
            count += 1
            compact += isinstance(module.prepared, tuple) and len(module.prepared) > 1
    return count, compact


def setup_packed_layers(model: nn.Module, ctx: RankContext, device: torch.device) -> str:
    """After loading: the packed (quantized) layers' kernels checked against float64 on every rank and, on GPUs,
    their single-row configurations and their batches' kernels timed (rank 0's choice used everywhere, batch
    kernels checked again once chosen: choose_batch_kernels); a failure of the first check anywhere unpacks every
    packed layer on every rank (the values they encode, in the compute dtype). Off GPUs they are unpacked: CPUs
    compute with the dequantized values (unless SHARDSERVE_QUANTIZED_LAYERS=packed). Returns what the kernel plan
    records."""
    layers = selection.packed_layers(model)
    if not layers:
        return ""
    layout = layers[0][1].packed.layout.describe()
    if device.type != "cuda" and quantized_layers_mode() != "packed":
        selection.unpack_all(model)
        return f"{layout} dequantized to the compute dtype"
    problems = _packed_failures_by_rank(model, (1, 5), ctx)
    if problems:
        if ctx.is_driver:
            logger.warning("packed %s layers failed their start-up check, so every rank computes with the values "
                           "they encode in the compute dtype instead: %s", layout, "; ".join(problems))
        selection.unpack_all(model)
        return f"{layout} dequantized (packed kernels failed their check)"
    chosen = []
    if device.type == "cuda":
        chosen = [choose_gemv_configs(model, ctx), choose_batch_kernels(model, ctx)]
    return ", ".join([f"{layout} packed on {len(layers)} layers", *filter(None, chosen)])


def _packed_failures_by_rank(model: nn.Module, rows, ctx: RankContext) -> list[str]:
    """The packed layers' check (layers/quantization/check.py) at `rows` on every rank, each failure named by the
    rank that saw it; the same on every rank."""
    failed = packed_check.check_packed(model, rows) if rows else []
    return [f"{who}: {failure}" for who, failures in _by_rank(failed, ctx) for failure in failures]


def choose_gemv_configs(model: nn.Module, ctx: RankContext) -> str:
    """Rank 0's timed single-row configurations (and where the norm runs inside the GEMV), used on every rank and
    checked there against float64; a failure on any rank puts every rank back on the default configuration
    without the norm inside (checked already). Returns what the kernel plan records ("" without norm-fused or
    split-K GEMVs)."""
    gemv_choice.use_gemv_configs(model, _from_stage_leader(gemv_choice.time_gemv_configs(model), ctx))
    problems = _packed_failures_by_rank(model, (1,), ctx)
    if problems:
        if ctx.is_driver:
            logger.warning("the packed layers' timed single-row GEMVs failed their start-up check, so every rank "
                           "uses the default: %s", "; ".join(problems))
        gemv_choice.use_gemv_configs(model, {})
    shapes = [layers[0].packed for layers in packed_check.distinct_packed(model).values()]
    fused, split = sum(p.norm_fused for p in shapes), sum(p.gemv_split is not None for p in shapes)
    return ", ".join(([f"the norm inside the single-row GEMV on {fused} shapes"] if fused else []) +
                     ([f"the split-K 4-bit GEMV on {split} shapes"] if split else []))


def choose_batch_kernels(model: nn.Module, ctx: RankContext) -> str:
    """Rank 0's timed choice between the fused GEMM and dequantize + cuBLAS for the packed layers' batches, used
    on every rank and checked against float64 there in every bucket that runs the GEMM; a failure on any rank
    puts every batch back on dequantize + cuBLAS (checked already). Returns what the kernel plan records ("" where
    no layer can take the GEMM)."""
    gemm_choice.use_batch_kernels(model, _from_stage_leader(gemm_choice.time_batch_kernels(model), ctx))
    problems = _packed_failures_by_rank(model, gemm_choice.gemm_check_rows(model), ctx)
    if problems:
        if ctx.is_driver:
            logger.warning("the packed layers' fused GEMM failed its start-up check, so every rank dequantizes for "
                           "batches instead: %s", "; ".join(problems))
        gemm_choice.use_batch_kernels(model, {})
        return "batches dequantized (the fused GEMM failed its check)"
    return gemm_choice.summary(model)


# -- attention ------------------------------------------------------------------------------------------


def _attention_steps(block_size: int) -> tuple[list[StepBatch], int]:
    """Four steps over a paged cache that exercise every path of a backend: two prompts (one of them longer
    than a 16-token block), then a decode beside a prompt continued in a chunk, then decoding only, then rows of
    the same sequences side by side (StepBatch.decode_rows, as proposals are verified). Returns the steps' batches
    and how many cache blocks they use (block 0 stays the zeroed padding block)."""
    def blocks(first: int, positions: int) -> list[int]:
        return list(range(first, first + -(-positions // block_size)))

    table0 = blocks(1, 12)
    table1 = blocks(1 + len(table0), 25)
    first = [SeqChunk(0, 0, [0] * 7, table0, True), SeqChunk(1, 0, [0] * 19, table1, True)]
    second = [SeqChunk(0, 7, [0], table0, True), SeqChunk(1, 19, [0] * 3, table1, True)]
    third = [SeqChunk(0, 8, [0], table0, True), SeqChunk(1, 22, [0], table1, True)]
    fourth = [SeqChunk(0, 9, [0] * 3, table0, True, draft=2), SeqChunk(1, 23, [0] * 2, table1, True, draft=1)]
    batches = [StepBatch.from_chunks(chunks, block_size) for chunks in (first, second, third)]
    return batches + [StepBatch.decode_rows(fourth, block_size)], 1 + len(table0) + len(table1)


@torch.inference_mode()
def check_attention(backend, attn, rotary, dtype: torch.dtype, device: torch.device, block_size: int,
                    seed: int = 0, kv_dtype: torch.dtype | None = None) -> CheckResult:
    """The backend on a small paged batch (prefill, chunked prefill beside decode, decode) against float64
    attention, with the model's own head layout, head norms (attn: a PagedAttention) and rotary tables. The
    batch goes through attn's own forward, as the model's does, so whatever the backend fuses is checked, and
    through forward_apart (the query heads a strided tensor of their own and an output gate, as gated attention
    passes them).

    kv_dtype: the cache's (default: dtype). The reference reads keys and values as that cache holds them (an FP8
    cache: rounded to e4m3 with attn's scales, attention/kv_quant.py), under the FP8 cache's own tolerance."""
    kv_dtype = kv_dtype or dtype
    name = (f"{backend.name} attention ({attn.num_heads} heads, {attn.num_kv_heads} KV heads, dim {attn.head_dim}"
            f"{', ' + kv_quant.describe(kv_dtype) + ' cache' if kv_dtype != dtype else ''})")
    tolerance = attention_tolerance(dtype, kv_dtype)
    try:
        generator = torch.Generator().manual_seed(seed)
        batches, num_blocks = _attention_steps(block_size)
        (k_cache, v_cache), = allocate_kv_cache(1, num_blocks, block_size, attn.num_kv_heads, attn.head_dim,
                                                kv_dtype, device)
        history: dict[int, tuple[list, list]] = {}  # seq -> rotated keys, values (float64, by position)
        worst = 0.0
        heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        for batch in batches:
            n = batch.num_tokens
            qk = torch.randn(n, heads + kv_heads, dim, generator=generator).to(dtype)
            v = torch.randn(n, kv_heads, dim, generator=generator).to(dtype)
            positions = torch.tensor(batch.positions, dtype=torch.long)
            rotated = _rotated_reference(qk, attn, rotary, positions)
            keys_read = _as_cached(rotated[:, heads:], dtype, attn.k_scale, kv_dtype)
            values_read = _as_cached(v.double(), dtype, attn.v_scale, kv_dtype)
            expected = torch.empty(n, heads * dim, dtype=torch.float64)
            for i, chunk in enumerate(batch.chunks):
                rows = slice(batch.row_start[i], batch.row_start[i + 1])
                keys, values = history.setdefault(chunk.seq_id, ([], []))
                keys.append(keys_read[rows])
                values.append(values_read[rows])
                expected[rows] = attention_reference(rotated[rows, :heads], torch.cat(keys), torch.cat(values),
                                                     list(attn.kv_index_tuple), attn.scale, chunk.start_position)
            meta = backend.build_metadata(batch)
            lookup = rotary.lookup(positions.to(device))
            out = attn(qk.to(device, copy=True), v.to(device), lookup, (k_cache, v_cache), meta)
            worst = max(worst, relative_error(out, expected))
            # Again with the query heads apart and an output gate, strided as a gated attention's q projection
            # leaves them (the same keys and values stored at the same slots again).
            gate = torch.randn(n, heads, dim, generator=generator).to(dtype)
            q_gate = torch.stack((qk[:, :heads], gate), dim=2).to(device)
            out = attn.forward_apart(q_gate[:, :, 0], qk[:, heads:].to(device, copy=True), v.to(device), lookup,
                                     (k_cache, v_cache), meta, q_gate[:, :, 1])
            gated = expected * torch.sigmoid(gate.double()).reshape(n, heads * dim)
            worst = max(worst, relative_error(out, gated))
        return CheckResult(name, worst, tolerance)
    except Exception as e:  # noqa: BLE001 - a backend that cannot run this batch fails its check
        return CheckResult(name, math.inf, tolerance, f"{type(e).__name__}: {e}")


def _rotated_reference(qk: torch.Tensor, attn, rotary, positions: torch.Tensor) -> torch.Tensor:
    """qk's heads normed (attn.head_norm) and rotated in float64, as attention sees them."""
    cos, sin = rotary.cos[positions].double().cpu(), rotary.signed_sin[positions].double().cpu()
    unrotated = qk.double()
    if attn.head_norm is not None:
        q_norm, k_norm = attn.head_norm
        unrotated = head_norm_reference(unrotated, attn.num_heads, q_norm.weight, k_norm.weight, q_norm.eps)
    return rotate_reference(unrotated, cos, sin)


def _as_cached(x: torch.Tensor, dtype: torch.dtype, scale: float, kv_dtype: torch.dtype) -> torch.Tensor:
    """float64 keys or values as a cache of kv_dtype holds them: computed in `dtype` (the backend's), then stored.
    Left exact for a cache of the compute dtype: the reference is float64 attention on the inputs."""
    if kv_dtype == dtype:
        return x
    return kv_quant.round_like_cache(x.to(dtype), scale, kv_dtype).double()


def checked_attention(backend, attn, rotary, dtype, device, block_size, ctx: RankContext,
                      kv_dtype: torch.dtype | None = None):
    """The backend if it passes its check on every rank (with a cache of kv_dtype, default dtype); otherwise, with
    a WARNING, torch SDPA (which runs on any device and layout) if that passes. Start-up stops when neither does."""
    from shardserve.attention.sdpa import SdpaBackend

    def check(candidate):
        return _failures(_only_failed(check_attention(candidate, attn, rotary, dtype, device, block_size,
                                                      kv_dtype=kv_dtype)), ctx)

    problems = check(backend)
    if not problems:
        return backend
    if not isinstance(backend, SdpaBackend):
        if ctx.is_driver:
            logger.warning("attention backend %s failed its start-up check, using torch-sdpa instead: %s",
                           backend.name, "; ".join(problems))
        fallback = SdpaBackend(device, block_size)
        more = check(fallback)
        if not more:
            return fallback
        problems += more
    raise KernelPlanError("no attention backend passed its start-up check against a float64 reference, so "
                          "start-up stops here:\n  " + "\n  ".join(problems))


def checked_latent_attention(backend, model: nn.Module, dtype: torch.dtype, device: torch.device, block_size: int,
                             ctx: RankContext):
    """The latent-attention backend (attention/mla.py) if, on every rank, its absorbed decode agrees with the
    expanded form in float64 on the model's first layer's sizes and this rank's heads, at a context of one token,
    of a block and a bit, and of several blocks; otherwise, with a WARNING, the backend with torch's decode if that
    agrees. Start-up stops when neither does."""
    problems = _latent_attention_failures(backend, model, dtype, device, block_size, ctx)
    if problems and backend.name != "mla-torch":
        if ctx.is_driver:
            logger.warning("latent attention %s failed its start-up check, using mla-torch instead: %s", backend.name,
                           "; ".join(problems))
        backend = backend.with_torch_decode()
        problems = _latent_attention_failures(backend, model, dtype, device, block_size, ctx)
    if problems:
        raise KernelPlanError("latent attention failed its start-up check against a float64 reference, so "
                              "start-up stops here:\n  " + "\n  ".join(problems))
    return backend


def _latent_attention_failures(backend, model: nn.Module, dtype: torch.dtype, device: torch.device, block_size: int,
                               ctx: RankContext) -> list[str]:
    """Every rank's failures of the latent attention's check (checked_latent_attention), agreed on all ranks."""
    from shardserve.layers.mla import check_reference

    layer = model.latent_attention_layers()[0]
    tolerance = TOLERANCE.get(dtype, 1e-2)
    problems = []
    for context in (1, block_size + 3, 4 * block_size - 1):
        try:
            error = check_reference(layer.dims, layer.num_heads, context, dtype, device, block_size, backend.decode)
        except Exception as exc:  # a kernel that cannot run here
            problems.append(f"{backend.name} does not run over {context} tokens: {type(exc).__name__}: {exc}")
            break
        if not error < tolerance:
            problems.append(f"{backend.name}: the absorbed decode is off the expanded form by {error:.3g} "
                            f"(tolerance {tolerance:g}) over {context} tokens of {layer.num_heads} heads")
    return [f"{who}: {failure}" for who, failure in _by_rank("; ".join(problems) or None, ctx) if failure is not None]


def checked_delta_net(model: nn.Module, dtype: torch.dtype, device: torch.device, ctx: RankContext) -> str:
    """The Gated DeltaNet layers' kernels if they pass their check on every rank (on the first layer's head
    sizes: every layer has the same); otherwise, with a WARNING, the next simpler ones that pass (their parent
    classes: fla-core prefill -> Triton fused decode -> Triton decode -> torch), set on every layer. Start-up
    stops when none does. Returns the kernels' name ("" for a model without such layers)."""
    from shardserve.layers.deltanet_kernels import TorchDeltaNetKernels, delta_net_kernels
    from shardserve.layers.gated_deltanet import GatedDeltaNet

    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    if not layers:
        if not _held_by_other_stages(model, mamba=False):
            return ""
        return _checked_layer_kernels("Gated DeltaNet", [], delta_net_kernels(device), TorchDeltaNetKernels,
                                      lambda kernels: None, ctx)
    first = layers[0]
    sizes = (first.key_heads, first.value_heads, first.dims.key_dim, first.dims.value_dim, first.dims.conv_kernel)
    return _checked_layer_kernels("Gated DeltaNet", layers, first.kernels or delta_net_kernels(device),
                                  TorchDeltaNetKernels,
                                  lambda kernels: check_delta_net(kernels, *sizes, dtype, device), ctx)


def checked_mamba2(model: nn.Module, dtype: torch.dtype, ssm_dtype: torch.dtype, device: torch.device,
                   ctx: RankContext) -> str:
    """The Mamba-2 layers' kernels if they pass their check on every rank (on the first layer's sizes, with SSM
    states kept in ssm_dtype as the pools keep them); otherwise, with a WARNING, the next simpler ones that pass
    (Triton decode -> torch), set on every layer. Start-up stops when none does. Returns the kernels' name (""
    for a model without such layers)."""
    from shardserve.layers.mamba2 import Mamba2Mixer
    from shardserve.layers.mamba2_kernels import TorchMamba2Kernels, mamba2_kernels

    layers = [m for m in model.modules() if isinstance(m, Mamba2Mixer)]
    if not layers:
        if not _held_by_other_stages(model, mamba=True):
            return ""
        return _checked_layer_kernels("Mamba-2", [], mamba2_kernels(device), TorchMamba2Kernels, lambda kernels: None,
                                      ctx)
    first, d = layers[0], layers[0].dims
    sizes = (first.heads, first.groups, d.head_dim, d.state_size, d.conv_kernel, d.chunk_size, d.time_step_limit,
             d.conv_bias)
    return _checked_layer_kernels("Mamba-2", layers, first.kernels or mamba2_kernels(device), TorchMamba2Kernels,
                                  lambda kernels: check_mamba2(kernels, *sizes, dtype, ssm_dtype, device), ctx)


def _held_by_other_stages(model: nn.Module, mamba: bool) -> bool:
    """Whether this rank, holding none of the model's Gated DeltaNet (mamba False) or Mamba-2 (mamba True) layers,
    is a pipeline stage of a model that has them (NemotronH's linear-attention layers are Mamba-2, keeps_ssm_states;
    the others' Gated DeltaNet). Such a stage takes part in every rank's rounds of checks of those kernels (the ranks
    exchange verdicts), checking nothing itself, and so arrives at the kernels the other stages serve."""
    stage = getattr(getattr(model, "model", None), "stage", None)
    return (stage is not None and stage.count > 1 and bool(model.config.linear_attention_layers)
            and getattr(model, "keeps_ssm_states", False) == mamba)


def _checked_layer_kernels(kind: str, layers: list[nn.Module], chosen, simplest: type, check,
                           ctx: RankContext) -> str:
    """The chosen kernels of `layers` if check(kernels) passes on every rank; otherwise, with a WARNING, the first
    simpler form they extend (a parent class, down to `simplest`) that passes, set as every layer's `kernels`.
    Start-up stops when none does. Returns the name of the kernels that serve."""
    candidates = [chosen] + [cls() for cls in type(chosen).__mro__[1:]
                             if isinstance(cls, type) and issubclass(cls, simplest)]
    problems: list[str] = []
    for kernels in candidates:
        failed = _failures(_only_failed(check(kernels)), ctx)
        if not failed:
            if kernels is not chosen:
                if ctx.is_driver:
                    logger.warning("%s kernels %s failed their start-up check, using %s instead: %s", kind,
                                   chosen.name, kernels.name, "; ".join(problems))
                for layer in layers:
                    layer.kernels = kernels
            return kernels.name
        problems += failed
    raise KernelPlanError(f"no {kind} kernels passed their start-up check against a float64 reference, so "
                          "start-up stops here:\n  " + "\n  ".join(problems))


def _only_failed(result: CheckResult | None) -> CheckResult | None:
    """The result where it failed; None where it passed or nothing was checked (None)."""
    return None if result is None or result.passed else result


# -- all-reduce -----------------------------------------------------------------------------------------


@torch.inference_mode()
def check_all_reduce(comm, dtype: torch.dtype, device: torch.device, message_bytes: list[int],
                     row_bytes: int | None = None) -> CheckResult:
    """The communicator's all-reduce at each message size on known values: rank r sends (r + 1) times small
    integers (exact in every dtype), so the sum is exact and must come back bit for bit on every rank.
    Messages are [tokens, hidden] with rows of `row_bytes` (the model's activations), or flat without it.
    Where the method for a size fuses the residual add and RMSNorm after the reduction, that form is checked
    too: the sum exactly, the normalised rows against float64."""
    world = comm.world_size
    name = "all-reduce"
    worst = 0.0
    for nbytes in message_bytes:
        shape = message_shape(nbytes, dtype, row_bytes)
        numel = math.prod(shape)
        base = (torch.arange(numel, device=device) % 7 - 3).to(dtype).view(shape)
        expected = base * (world * (world + 1) // 2)
        try:
            out = comm.all_reduce(base * (comm.rank + 1))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wrong = int((out != expected).sum())
            if not wrong and len(shape) == 2:
                error = _check_fused_norm(comm, base, expected)
                if error is not None:
                    wrong = int(error > TOLERANCE.get(dtype, 1e-2))
                    worst = max(worst, error)
                    name = "all-reduce (with the residual add and RMSNorm fused)"
        except Exception as e:  # noqa: BLE001
            return CheckResult(f"{name} at {nbytes} bytes", math.inf, 0.0, f"{type(e).__name__}: {e}")
        if wrong:
            return CheckResult(f"{name} at {nbytes} bytes", math.inf, 0.0,
                               f"{wrong} of {numel} sums wrong" if worst == 0 else f"error {worst:.2g} against float64")
    return CheckResult(name, worst, TOLERANCE.get(dtype, 1e-2))


def _check_fused_norm(comm, base: torch.Tensor, expected_sum: torch.Tensor) -> float | None:
    """Relative error of the fused all-reduce + residual add + RMSNorm against float64, or None where the
    communicator does not fuse at this size; a residual sum that is not exact counts as infinite error."""
    cols = base.shape[1]
    residual = (torch.arange(base.numel(), device=base.device).view(base.shape) % 5 - 2).to(base.dtype)
    weight = (1 + (torch.arange(cols, device=base.device) % 4) / 4).to(base.dtype)
    fused = comm.all_reduce_add_rms_norm(base * (comm.rank + 1), residual.clone(), weight, 1e-5)
    if fused is None:
        return None
    normed, summed = fused
    s = expected_sum.double() + residual.double()
    if not torch.equal(summed.double(), s):
        return math.inf
    h = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)).to(base.dtype)
    return relative_error(normed, (weight.double() * h.double()).to(base.dtype).double().cpu())


def verify_all_reduce(comm, dtype, device, message_bytes: list[int], ctx: RankContext,
                      row_bytes: int | None = None) -> bool:
    """Check the chosen all-reduce methods; if any rank sees a wrong sum, fall back to the process group's own
    all-reduce (gloo or NCCL) on every rank and check that. Returns whether the fallback was taken."""
    problems = _failures(_only_failed(check_all_reduce(comm, dtype, device, message_bytes, row_bytes)), ctx)
    if not problems:
        return False
    if comm.choice is not None:
        if ctx.is_driver:
            logger.warning("the chosen all-reduce failed its start-up check, using the process group's own "
                           "all-reduce instead: %s", "; ".join(problems))
        comm.close()
        problems = _failures(_only_failed(check_all_reduce(comm, dtype, device, message_bytes, row_bytes)), ctx)
        if not problems:
            return True
    raise KernelPlanError("the all-reduce gave wrong sums in its start-up check, so start-up stops here:\n  "
                          + "\n  ".join(problems))


# -- the plan across ranks ------------------------------------------------------------------------------


def agree_on_gemv(kernel, ctx: RankContext):
    """Rank 0's batch-1 GEMV choice, on every rank: timings differ a little between GPUs, and ranks that
    picked different kernels for one shape would round their shards differently."""
    if ctx.world_size == 1:
        return kernel
    chosen = _from_stage_leader(kernel.as_lists(), ctx)
    return type(kernel).from_lists(chosen)


def agree_on_plan(plan: KernelPlan, ctx: RankContext) -> None:
    """Every rank must have arrived at the same plan; otherwise stop, naming the ranks and their plans. With
    pipeline stages, what is timed or chosen on a stage's own group and layers (all-reduce, GEMVs) is compared
    within the stage; the rest across every rank."""
    per_stage = dict(all_reduce="", gemv="", dependent_launch="")
    shared = plan.with_results(**per_stage).describe() if ctx.pp_size > 1 else plan.describe()
    plans = _by_rank([ctx.stage, shared, plan.describe()], ctx)
    (first, (_, reference, _)), differing = plans[0], []
    leaders: dict[int, str] = {}
    for who, (stage, common, whole) in plans:
        if common != reference:
            differing.append(f"{who}: {whole}")
        elif whole != leaders.setdefault(stage, whole):
            differing.append(f"{who} (pipeline stage {stage}): {whole}")
    if differing:
        raise StartupMismatch(f"the ranks did not arrive at the same kernel plan, so start-up stops here:\n  "
                              f"{first}: {plans[0][1][2]}\n  " + "\n  ".join(differing))


class Stopwatch:
    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> "Stopwatch":
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds += time.perf_counter() - self._started
