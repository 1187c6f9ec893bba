"""Runs the model for a step plan on one rank: builds the batch tensors, then one forward pass.

Every rank runs the same plan, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import Callable, NamedTuple

import torch

from shardserve.attention import StepBatch, kv_quant
from shardserve.config import CacheLayout, EngineConfig, ModelConfig, PipelineStage
from shardserve.distributed import all_reduce, token_broadcast
from shardserve.distributed.pipeline import PipelineLinks
from shardserve.distributed.process_group import RankContext
from shardserve.distributed.setup_watchdog import setup_step
from shardserve.engine.kv_cache import (agree_on_num_blocks, allocate_kv_cache, bytes_per_block,
                                        kv_cache_layers, kv_cache_budget_bytes)
from shardserve.engine.cuda_graphs import (CudaGraphRunner, all_reduce_token_counts, graph_rows, graph_unsafe_reason,
                                           layer_caches)
from shardserve.wire.step_plan import FROM_DEVICE, StepPlan
from shardserve.engine import kernel_setup, pipeline_split
from shardserve.kernels import cpu_features
from shardserve.kernels import plan as kernel_plan
from shardserve.layers.moe_shared import fold_shared_experts
from shardserve.layers.attention import kv_scales_summary
from shardserve.layers.linear import deferred_weights, weight_bytes
from shardserve.layers.moe_packed import pack_experts
from shardserve.layers.quantization.packed import PackedLayout, quantized_layers_mode
from shardserve.layers.quantization.selection import pack_layers
from shardserve.models import model_class
from shardserve.transfers import on_device
from shardserve.weights import stable_memory
from shardserve.weights.consistency import verify_replicated_weights
from shardserve.weights.loader import (configured_quantized_modules, load_synthetic_weights, load_weights,
                                       quantized_module_names)
from shardserve.weights.offload import HostCopy, offload, restore

logger = logging.getLogger(__name__)


class HiddenStep(NamedTuple):
    """ModelRunner.execute_hidden's result: execute's seq ids and logits, and every row's hidden state before the
    final norm in the batch's row order (`batch`'s chunks and row_start say whose)."""

    seq_ids: list[int]
    logits: torch.Tensor | None
    hidden: torch.Tensor
    batch: StepBatch


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, ctx: RankContext,
                 kv_set_aside: Callable[[int, int], int] | None = None) -> None:
        """kv_set_aside: for this rank's KV-cache budget and KV bytes a token, the bytes of the budget kept for
        something else (rank 0's draft model: engine/draft_model.py)."""
        self.config = config
        self.kv_set_aside = kv_set_aside
        self.model_config = model_config
        self.ctx = ctx
        self.device = ctx.device
        # Every numeric choice of this launch (kernels/plan.py); each kernel is checked before it is used.
        self.plan = kernel_plan.decide(config, model_config,
                                       cpu_features.detect() if self.device.type == "cpu" else None)
        self.dtype = self.plan.dtype
        self.kv_dtype = kv_quant.cache_dtype(config.kv_cache_dtype, self.dtype)  # what the cache's slots hold
        self.linear_kernel = None  # chosen at the first load, kept for reloads
        self.self_check = kernel_setup.Stopwatch()
        self.max_model_len = config.resolve_max_model_len(model_config)
        self.block_size = config.block_size
        # This rank's pipeline stage (None: the whole model), and its links to the stages before and after.
        self.stage: PipelineStage | None = pipeline_split.stage_of(config, model_config, ctx,
                                                                                     self.dtype.itemsize)
        self.pipe = PipelineLinks(ctx) if self.stage is not None else None
        self.memory_plan = self._plan_memory()  # None where the planner cannot describe the model
        self.model = self._load_model()
        if kv_quant.is_fp8(self.kv_dtype) and ctx.is_driver:
            logger.info("FP8 KV cache (e4m3): %s", "the latent cache's entries stored with scale 1.0"
                        if model_config.latent_attention else kv_scales_summary(self.model))
        # On GPUs, weights and KV cache live at fixed addresses whose memory sleep gives back and wake takes
        # again (weights/stable_memory.py), so the CUDA graphs survive a sleep and waking costs one copy.
        self.weight_arena = self.kv_arena = None
        self.host_image: torch.Tensor | None = None  # pinned copy of the weight arena, made at the first sleep
        if self.device.type == "cuda" and stable_memory.enabled(self.device):
            self.weight_arena = stable_memory.move_model_into_arena(self.model, self.device)
        if ctx.world_size > 1:
            with setup_step("compare replicated weights", ctx.rank):
                checked = verify_replicated_weights(self.model, ctx.control_group, ctx.rank, ctx.world_size,
                                                    ctx.tp_size)
            if ctx.is_driver:
                logger.info("replicated weights identical on all %d ranks (%d tensors compared)%s", ctx.world_size,
                            checked, "; compared within each pipeline stage"
                            if ctx.pp_size > 1 else "")
        with setup_step("size the KV cache", ctx.rank):
            self.num_blocks = self._size_kv_cache()
        self.state_pools: dict = {}  # layer -> its recurrent-state pool (linear-attention layers), with the KV cache
        self.kv_caches = self._allocate_kv_cache()
        self.attention, self.plan = kernel_setup.set_up_token_mixers(
            self.model, self.plan, ctx, self.block_size, self.kv_dtype, self.config.ssm_state_dtype, self.self_check)
        self.all_reduce_choice: all_reduce.AllReduceChoice | None = None
        self.graphs: CudaGraphRunner | None = None
        self.host_weights: HostCopy | None = None  # while the weights sleep at level 1
        self.weights_asleep = self.kv_asleep = False
        with setup_step("choose and check the all-reduce", ctx.rank):
            self._choose_all_reduce()
        with setup_step("compare kernel plans", ctx.rank):
            kernel_setup.agree_on_plan(self.plan, ctx)
        if ctx.is_driver:
            logger.info("kernel plan: %s; every kernel checked against float64 on this model's shapes in %.2f s",
                        self.plan.describe(), self.self_check.seconds)
        if self.pipe is not None:
            self.pipe.agree_logits_dtype(self._logits_dtype())
        with setup_step("capture CUDA graphs", ctx.rank):
            self._capture_graphs()
        if self.device.type == "cuda":
            self._log_memory_against_plan()

    def _allocate_kv_cache(self):
        """The KV cache of the attention layers (returned) and, beside it, a zeroed recurrent-state pool of
        max_num_seqs slots per linear-attention layer (self.state_pools; Scheduler hands out the slots). In the
        stable arena both keep their addresses across sleep and wake, so the decode graphs stay valid."""
        cache = self._cache_layout()
        shape = (self._kv_layer_count(), self.num_blocks, self.block_size, cache.heads, cache.dim)
        if self.weight_arena is None:
            self.state_pools = self._new_state_pools(self.device)
            return allocate_kv_cache(*shape, self.kv_dtype, self.device, planes=cache.planes)
        if self.kv_arena is None:
            layout = self._new_state_pools(torch.device("meta"))
            self.kv_arena, self._kv_tensor, views = stable_memory.kv_cache_in_arena(
                shape[0], shape[1] * shape[2], shape[3], shape[4], self.kv_dtype, self.device,
                [t for pool in layout.values() for t in pool], planes=cache.planes)
            views = iter(views)
            self._arena_pools = {i: type(pool)(*(next(views) for _ in pool)) for i, pool in layout.items()}
        self.kv_arena.map()
        self.state_pools = self._arena_pools
        for pool in self.state_pools.values():
            for t in pool:
                t.zero_()
        return kv_cache_layers(self._kv_tensor, self.block_size)

    def _new_state_pools(self, device: torch.device) -> dict:
        """The model's zeroed recurrent-state pools, max_num_seqs slots a layer, on `device`; Mamba-2 layers' SSM
        states in --mamba-ssm-cache-dtype, which a model without them refuses unless it is "auto"."""
        if self.config.mamba_ssm_cache_dtype == "auto":
            return self.model.state_pools(self.config.max_num_seqs, device)
        if not getattr(self.model, "keeps_ssm_states", False):
            raise ValueError(f"--mamba-ssm-cache-dtype {self.config.mamba_ssm_cache_dtype}: "
                             f"{self.model_config.architecture} has no Mamba-2 layers; leave it at auto")
        return self.model.state_pools(self.config.max_num_seqs, device, ssm_dtype=self.config.ssm_state_dtype)

    @torch.inference_mode()
    def _logits_dtype(self) -> torch.dtype | None:
        """On the last pipeline stage, the dtype its LM head's logits come in (one row computed, every rank of the
        stage taking part in its gather); None on the other stages and on the stage's other ranks."""
        if not self.stage.is_last:
            return None
        row = torch.zeros(1, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
        logits = self.model.compute_logits(row)
        return None if logits is None else logits.dtype

    def _capture_graphs(self) -> None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        spec = self.config.speculative_config
        if spec is not None and spec.method == "mtp":
            if self.ctx.is_driver:
                logger.info("no CUDA graphs: with MTP proposals every step also returns its last hidden states "
                            "(engine/mtp.py), which the decode graphs do not")
            return
        if not hasattr(self.attention, "static_decode_metadata"):
            if getattr(self.model, "attention_backend", None) is not None and self.ctx.is_driver:
                logger.warning("no CUDA graphs: %s's attention backend %s keeps no static decode metadata; decode "
                               "runs eagerly", self.model_config.architecture, self.attention.name)
            return
        unsafe = [(name, module) for name, module in self.model.named_modules()
                  if getattr(module, "graph_safe", True) is False]
        if unsafe:
            name, module = unsafe[0]
            logger.warning("no CUDA graphs: %s (and %d more) cannot be captured: %s; decode runs eagerly", name,
                           len(unsafe) - 1, graph_unsafe_reason(module))
            return
        split_sizes = self.all_reduce_choice.split_sizes if self.all_reduce_choice else frozenset()
        shared_rows = self._graph_rows() if self.rows_per_sequence > 1 and not self.state_pools else 0
        self.graphs = CudaGraphRunner(self.model, self.kv_caches, self.attention, self.ctx.comm,
                                      self.config.max_num_seqs, self.max_model_len, split_sizes,
                                      self._hidden_bytes_per_token(), self.state_pools, shared_rows, self.stage,
                                      self.dtype)
        self.graphs.capture_all()

    # -- sleep / wake -----------------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Level 1: weights to host memory, KV cache freed. Level 2: weights dropped as well (waking
        reloads them from the checkpoint). Device memory goes back to the driver either way."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.weight_arena is not None:
            return self._sleep_in_place(level)
        self.graphs = None  # they hold the cache's and the weights' addresses
        if not self.weights_asleep:
            host = offload(self.model, keep_host_copy=level == 1)
            self.host_weights = host if level == 1 else None  # None: waking reloads the checkpoint
            self.weights_asleep = True
        self.kv_caches, self.state_pools, self.kv_asleep = None, {}, True
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _sleep_in_place(self, level: int) -> None:
        """Sleep keeping every address: copy the weights out (once: they never change while serving, so
        the pinned image made at the first level-1 sleep serves every later wake), then release the arenas."""
        if not self.weights_asleep:
            if level == 1 and self.host_image is None:
                self.host_image = torch.empty(self.weight_arena.nbytes, dtype=torch.uint8, pin_memory=True)
                self.host_image.copy_(self.weight_arena.bytes)
            elif level == 2:
                self.host_image = None
            self.weight_arena.release()
            self.weights_asleep = True
        self.kv_arena.release()
        self.kv_caches, self.state_pools, self.kv_asleep = None, {}, True

    def _wake_in_place(self, weights: bool, kv_cache: bool) -> None:
        if weights and self.weights_asleep:
            self.weight_arena.map_and_fill(self.host_image)  # asynchronous copies from the pinned image
            if self.host_image is None:
                self._fill_weights(self.model)  # level 2: from the checkpoint, into the same addresses
            self.weights_asleep = False
        if kv_cache and self.kv_asleep:
            self.kv_caches, self.kv_asleep = self._allocate_kv_cache(), False
        torch.cuda.synchronize(self.device)

    def wake(self, weights: bool = True, kv_cache: bool = True) -> None:
        if self.weight_arena is not None:
            return self._wake_in_place(weights, kv_cache)
        if weights and self.weights_asleep:
            if self.host_weights is None:
                self.model = self._load_model()
            else:
                restore(self.model, self.host_weights, self.device)
            self.host_weights, self.weights_asleep = None, False
        if kv_cache and self.kv_asleep:
            self.kv_caches, self.kv_asleep = self._allocate_kv_cache(), False
        if not (self.weights_asleep or self.kv_asleep):
            self._capture_graphs()

    def reload_weights(self) -> None:
        """Replace the working weights by a fresh load of the checkpoint (after a failed canary)."""
        if self.weight_arena is not None:
            self.host_image = None  # it may be what went wrong
            self._fill_weights(self.model)
            torch.cuda.synchronize(self.device)
            return
        self.graphs = None
        self.model = self._load_model()
        gc.collect()
        self._capture_graphs()

    def close(self) -> None:
        """Free the CUDA graphs before the process group goes: captured graphs hold NCCL collectives and
        symmetric-memory buffers, and the communicators must not be torn down under them."""
        if self.graphs is not None and self.graphs.timer is not None:
            self.graphs.timer.report()
        self.graphs = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.ctx.comm.close()
        for arena in (self.weight_arena, self.kv_arena):
            if arena is not None:
                arena.release()

    @property
    def rows_per_sequence(self) -> int:
        """The most rows a sequence brings to a step the graphs replay: its last token and the k proposals to verify
        with a proposer of k (StepBatch.decode_rows), else 1. (Recurrent-state models step their state once a
        chunk, so their steps with proposals run eagerly.)"""
        spec = self.config.speculative_config
        return 1 + spec.num_speculative_tokens if spec is not None else 1

    def _graph_rows(self) -> int:
        return graph_rows(self.config.max_num_seqs, self.config.max_num_batched_tokens, self.rows_per_sequence)

    def _hidden_bytes_per_token(self) -> int:
        return self.model_config.hidden_size * self.dtype.itemsize

    def _choose_all_reduce(self) -> None:
        """Time the all-reduce methods on this group at the message sizes the model sends; use the fastest."""
        comm = self.ctx.comm
        if comm.world_size == 1:
            return
        per_token = self._hidden_bytes_per_token()
        tokens = all_reduce_token_counts(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                         self.rows_per_sequence)
        sizes = [t * per_token for t in tokens]
        started = time.perf_counter()
        if self.device.type == "cuda":
            # Peer-memory methods exchange their handles over the control plane, which spans every stage: under
            # pipeline stages a stage's group has NCCL and torch's symmetric memory only.
            choice = all_reduce.calibrate(comm.group, self.device, self.dtype, sizes,
                                          graph_slots=2 * self.model_config.num_layers + 4,
                                          control_group=self.ctx.control_group if self.stage is None else None,
                                          row_bytes=per_token)
        else:
            choice = all_reduce.calibrate_cpu(comm.group, comm.rank, comm.world_size, self.dtype, sizes)
        comm.use(choice)
        self.all_reduce_choice = choice
        with self.self_check:
            if kernel_setup.verify_all_reduce(comm, self.dtype, self.device, sizes, self.ctx, per_token):
                self.all_reduce_choice = None
        described = choice.describe() if self.device.type == "cuda" else choice.eager.describe()
        if self.device.type == "cuda" and token_broadcast.wanted() and self.stage is None:
            comm.tokens = token_broadcast.build(comm.group, self.ctx.control_group, comm.rank, comm.world_size,
                                                self.device, self._graph_rows())
            if comm.tokens is not None:
                described += "; sampled tokens: peer memory, inside the decode graphs"
        self.plan = self.plan.with_results(all_reduce=described if self.all_reduce_choice else "process group's own")
        if self.ctx.is_driver:
            small = tokens[0] * per_token
            at_small = ", ".join(f"{key} {t[small]:.1f} us" for key, t in sorted(choice.timings_us.items())
                                 if small in t and t[small] != float("inf"))
            logger.info("all-reduce over %d ranks: %s (at %d bytes: %s; measured in %.1f s)", comm.world_size,
                        described, small, at_small, time.perf_counter() - started)

    def _load_model(self):
        started = time.perf_counter()
        cls = model_class(self.model_config.architecture)
        torch.manual_seed(0)
        packing = self._packed_layout()
        staged = {} if self.stage is None else {"stage": self.stage}
        with torch.device(self.device), (deferred_weights() if packing else contextlib.nullcontext()):
            model = cls(self.model_config, self.ctx.comm, self.dtype, self.max_model_len,
                        expert_parallel=self.config.enable_expert_parallel, **staged)
        spec = self.config.speculative_config
        if spec is not None and spec.method == "mtp":  # rank 0's MTP runner reads them: no "left unread" line
            model.unused_checkpoint_prefixes = (*getattr(model, "unused_checkpoint_prefixes", ()),
                                                *model.skipped_checkpoint_prefixes)
            model.skipped_checkpoint_prefixes = {}
        if packing:
            layout, names = packing
            scheme = self.model_config.quantization
            if names is None and scheme is not None:  # dummy weights: the config's 16-bit modules stay so
                names = configured_quantized_modules(model, scheme)
            pack_layers(model, names, layout, self.device, log=self.ctx.is_driver,
                        head=scheme is not None and scheme.lm_head)
            # --quantization fp8 quantizes the projections only: experts keep the compute dtype (as planned).
            experts = set() if self.config.quantization == "fp8" else names
            pack_experts(model, experts, layout, self.device, log=self.ctx.is_driver)
        self._fill_weights(model)
        fold_shared_experts(model, log=self.ctx.is_driver)
        self._log_planned_weights(model)
        self.plan, self.linear_kernel = kernel_setup.set_up_linear_layers(
            model, self.plan, self.ctx, self.linear_kernel, packed=bool(packing), stopwatch=self.self_check)
        model.eval()
        loaded, copies = weight_bytes(model)
        quantization = self.model_config.quantization
        logger.info("rank %d loaded %s in %.1f s: %.2f GiB of %s weights on %s%s%s", self.ctx.rank, self.config.model,
                    time.perf_counter() - started, loaded / 2**30, self.dtype, self.device,
                    f" (+{copies / 2**30:.2f} GiB of compact copies for decode steps)" if copies else "",
                    f" (quantized layers: {self.plan.quantized})" if self.plan.quantized else
                    f" (a {quantization.describe()} checkpoint, held as the values it encodes)"
                    if quantization is not None and self.config.load_format != "dummy" else "")
        return model

    def _packed_layout(self) -> tuple[PackedLayout, set[str] | None] | None:
        """How this model's linear layers are kept packed, and which (None: every quantizable layer), or None.

        --quantization fp8 packs every layer (quantized at load; CPUs then compute with the rounded values). A
        quantized checkpoint's layers are packed on GPUs, and on CPUs only with SHARDSERVE_QUANTIZED_LAYERS=packed
        (else read as the values they encode); SHARDSERVE_QUANTIZED_LAYERS=dequantized reads them so anywhere."""
        scheme = self.model_config.quantization
        if self.config.quantization == "fp8":
            if scheme is not None:
                raise ValueError(f"--quantization fp8 quantizes a float checkpoint, but {self.config.model!r} is already "
                                 f"quantized ({scheme.describe()}); leave --quantization out")
            return PackedLayout("fp8", 0), None
        mode = quantized_layers_mode()
        if scheme is None or mode == "dequantized" or (mode == "auto" and self.device.type != "cuda"):
            return None
        layout = PackedLayout.of_checkpoint(scheme)
        if self.config.load_format == "dummy":
            return layout, None
        names = quantized_module_names(self.config.model, scheme, model_class(self.model_config.architecture))
        return layout, names

    def _fill_weights(self, model) -> None:
        """Copy the checkpoint's values (this rank's shards) into the model's existing parameters."""
        if self.config.load_format == "dummy":
            load_synthetic_weights(model, self.model_config, self.device, self.dtype, seed=self.config.seed)
        else:
            load_weights(model, self.config.model, self.model_config.tie_word_embeddings,
                         self.model_config.quantization)

    def _log_planned_weights(self, model) -> None:
        """Log the planner's per-rank weight bytes next to what was loaded (they should agree)."""
        if self.memory_plan is None:
            return
        loaded = sum(p.numel() * p.element_size() for p in model.parameters())
        predicted = self.memory_plan.weight_bytes
        logger.info("rank %d weights: planner predicted %.3f GiB, loaded %.3f GiB (%+.1f%%)", self.ctx.rank,
                    predicted / 2**30, loaded / 2**30, 100 * (loaded - predicted) / max(predicted, 1))

    def _plan_memory(self):
        """The planner's per-rank arithmetic for this engine's settings (shardserve plan), or None when it
        cannot describe the model (a GGUF file, say). On GPUs it also budgets the KV cache: what it leaves of
        the device after weights and overhead."""
        from shardserve.planner import PlanRequest, load_hf_config, plan

        try:
            cfg = dict(load_hf_config(self.config.model), torch_dtype=str(self.dtype).removeprefix("torch."))
            device_gb = torch.cuda.mem_get_info(self.device)[1] / 2**30 if self.device.type == "cuda" else None
            return plan(cfg, PlanRequest(self.ctx.tp_size, self.max_model_len, self.config.max_num_seqs,
                                         self.config.max_num_batched_tokens, device_gb,
                                         self.config.gpu_memory_utilization,
                                         quantization=self.config.quantization,
                                         kv_cache_dtype=self.config.kv_cache_dtype,
                                         pipeline_parallel_size=self.ctx.pp_size,
                                         pipeline_stage=self.ctx.stage if self.stage is not None else None))
        except (OSError, KeyError, ValueError) as e:
            logger.debug("planner: no prediction for %s: %s", self.config.model, e)
            return None

    def _log_memory_against_plan(self) -> None:
        """After start-up: the device memory in use against the planner's weights + KV cache + recurrent states
        (hybrid models) + overhead."""
        if self.memory_plan is None:
            return
        p = self.memory_plan
        free, total = torch.cuda.mem_get_info(self.device)
        measured, kv = total - free, self.num_blocks * self._kv_bytes_per_block()
        states = p.state_bytes_per_seq * self.config.max_num_seqs
        predicted = p.weight_bytes + kv + states + p.overhead_bytes
        logger.info("rank %d memory: planner predicted %.2f GiB (weights %.2f, KV cache %.2f in %s,%s overhead %.2f), "
                    "%.2f GiB in use on the device after start-up (%+.1f%%)", self.ctx.rank, predicted / 2**30,
                    p.weight_bytes / 2**30, kv / 2**30, kv_quant.describe(self.kv_dtype), f" recurrent states {states / 2**30:.2f}," if states else "",
                    p.overhead_bytes / 2**30, measured / 2**30, 100 * (measured - predicted) / predicted)

    def _cache_layout(self) -> CacheLayout:
        """One KV layer's cache on this rank: the model's own layout where it declares one (cache_layout: DeepSeek's
        latent cache), else keys and values of its KV heads."""
        declared = getattr(self.model, "cache_layout", None)
        if declared is not None:
            return declared()
        return CacheLayout.keys_and_values(self.model.kv_heads_per_rank(), self.model_config.head_dim)

    def _kv_layer_count(self) -> int:
        """The KV cache's layers on this rank: the model's KV layers, or those of this rank's pipeline stage."""
        if self.stage is None:
            return len(self.model_config.kv_layers)
        return sum(self.stage.holds(i) for i in self.model_config.kv_layers)

    def _kv_bytes_per_block(self) -> int:
        cache = self._cache_layout()
        return bytes_per_block(self._kv_layer_count(), self.block_size, cache.heads, cache.dim,
                               self.kv_dtype, planes=cache.planes)

    def _state_bytes(self) -> int:
        """Bytes of the recurrent-state pools (max_num_seqs slots per linear-attention layer) on this rank."""
        pools = self._new_state_pools(torch.device("meta"))
        return sum(t.numel() * t.element_size() for pool in pools.values() for t in pool)

    def _size_kv_cache(self) -> int:
        per_block = self._kv_bytes_per_block()
        budget = kv_cache_budget_bytes(self.device, self.config.kv_cache_memory_gb, self.config.gpu_memory_utilization)
        state_bytes = self._state_bytes()
        if state_bytes:
            # The state pools are allocated with the KV cache, out of the same budget.
            budget = max(0, budget - state_bytes)
            logger.info("rank %d recurrent state: %d slots (%.2f GiB), from the KV cache's budget", self.ctx.rank,
                        self.config.max_num_seqs, state_bytes / 2**30)
        if self.memory_plan is not None and self.memory_plan.kv_budget_bytes is not None \
                and self.config.kv_cache_memory_gb is None:
            # The planner's budget, never more than is actually free (its overhead is an estimate, and other
            # processes may hold memory on this GPU).
            planned = max(0, self.memory_plan.kv_budget_bytes)
            if planned > budget:
                log = logger.warning if planned > 1.1 * budget else logger.info
                log("rank %d: the planner budgets %.2f GiB for the KV cache, %.2f GiB are free; using the free "
                    "memory", self.ctx.rank, planned / 2**30, budget / 2**30)
            budget = min(planned, budget)
        if self.kv_set_aside is not None:
            budget = max(0, budget - self.kv_set_aside(budget, per_block // self.block_size))
        num_blocks = agree_on_num_blocks(budget // per_block, self.ctx.control_group, self.ctx.world_size)
        needed = -(-self.max_model_len // self.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks * self.block_size} tokens ({num_blocks} blocks of {self.block_size}) "
                f"but --max-model-len is {self.max_model_len}: lower --max-model-len or raise --kv-cache-memory"
            )
        logger.info("rank %d KV cache: %d blocks of %d tokens (%.2f GiB of %s)", self.ctx.rank, num_blocks,
                    self.block_size, num_blocks * per_block / 2**30, kv_quant.describe(self.kv_dtype))
        return num_blocks

    @torch.inference_mode()
    def execute(self, plan: StepPlan, device_tokens: torch.Tensor | None = None
                ) -> tuple[list[int], torch.Tensor | None]:
        """Run the plan; returns the seq ids that sampled and, on rank 0, their logits (on the model's device).

        For a plan with tokens_from_device, `device_tokens` holds the input tokens of its first
        num_device_tokens chunks (one each), sampled by the previous step and still on the device: the step
        is queued without the host knowing them. Only rank 0 has them; the others pass None and receive them
        here (eagerly, or inside the decode graph where it shares tokens).
        """
        if self.graphs is not None and self.graphs.takes_as_rows(plan.chunks, self.rows_per_sequence):
            batch = StepBatch.decode_rows(plan.chunks, self.block_size)
        else:
            batch = StepBatch.from_chunks(plan.chunks, self.block_size)
        graphed = self.graphs is not None and self.graphs.can_run(batch)
        if plan.tokens_from_device:
            if not (graphed and self.graphs.shares_tokens):
                device_tokens = self._shared_tokens(plan, device_tokens)
            if device_tokens is not None:  # None: a later rank whose graph receives every token itself
                device_tokens = self._input_tokens(plan, batch, device_tokens)
        if graphed:
            self._zero_fresh_slots(batch)
            if self.stage is not None:
                return self._replay_stage(batch, device_tokens)
            logits = self.graphs.run(batch, device_tokens)
            if logits is not None and len(batch.sample_rows) < batch.num_tokens:
                logits = logits[self._long(batch.sample_rows)]
            return batch.sample_seq_ids, logits
        meta = self.attention.build_metadata(batch)
        token_ids = device_tokens if device_tokens is not None else self._long(batch.token_ids)
        if self.stage is not None:
            return self._execute_stage(batch, token_ids, meta)
        hidden = self.model(token_ids, self._long(batch.positions), self._layer_caches(batch), meta)
        if not batch.sample_rows:
            return [], None
        logits = self.model.compute_logits(hidden[self._long(batch.sample_rows)])
        return batch.sample_seq_ids, logits

    @torch.inference_mode()
    def execute_hidden(self, plan: StepPlan, hidden: torch.Tensor | None = None,
                       device_tokens: torch.Tensor | None = None) -> HiddenStep:
        """Run the plan eagerly as execute does, also returning every row's last hidden state before the final norm
        (replicated on every rank after the all-reduce): what MTP proposals read (engine/mtp.py). `hidden`: a model
        that takes hidden states (the MTP layer) gets them, one a row in the batch's row order. No pipeline stages;
        device_tokens on one rank only (they are not shared)."""
        batch = StepBatch.from_chunks(plan.chunks, self.block_size)
        meta = self.attention.build_metadata(batch)
        token_ids = self._input_tokens(plan, batch, device_tokens) if plan.tokens_from_device \
            else self._long(batch.token_ids)
        extra = {} if hidden is None else {"hidden": hidden}
        normed, stream = self.model(token_ids, self._long(batch.positions), self._layer_caches(batch), meta,
                                    keep_stream=True, **extra)
        logits = self.model.compute_logits(normed[self._long(batch.sample_rows)]) if batch.sample_rows else None
        return HiddenStep(batch.sample_seq_ids, logits, stream, batch)

    def _execute_stage(self, batch: StepBatch, token_ids: torch.Tensor, meta
                       ) -> tuple[list[int], torch.Tensor | None]:
        """One pipeline stage's part of a step: the residual stream from the stage before (none on the first), this
        stage's layers, then the stream on to the next stage, or on the last the logits to rank 0, which returns
        them as execute does (the other ranks return none)."""
        hidden = None
        if not self.stage.is_first:
            hidden = self.pipe.receive_hidden(batch.num_tokens, self.model_config.hidden_size, self.dtype)
        out = self.model(token_ids, self._long(batch.positions), self._layer_caches(batch), meta, hidden)
        if self.stage.is_last and batch.sample_rows:
            out = self.model.compute_logits(out[self._long(batch.sample_rows)])
        return self._stage_result(batch, out)

    def _replay_stage(self, batch: StepBatch, device_tokens: torch.Tensor | None
                      ) -> tuple[list[int], torch.Tensor | None]:
        """_execute_stage with this stage's layers replayed from its decode graph (engine/cuda_graphs.py): the
        stream received into the graph's input buffer, and the graph's stream or logits passed on."""
        if not self.stage.is_first:
            self.pipe.receive_hidden_into(self.graphs.stage_input(batch.num_decode))
        out = self.graphs.run(batch, device_tokens)  # every row samples: logits for each on the last stage
        if out is not None and self.stage.is_last and len(batch.sample_rows) < batch.num_tokens:
            out = out[self._long(batch.sample_rows)]
        return self._stage_result(batch, out)

    def _stage_result(self, batch: StepBatch, out: torch.Tensor | None) -> tuple[list[int], torch.Tensor | None]:
        """A stage's step after its layers: `out` (the residual stream) sent on to the next stage, or on the last
        stage `out` (the sampled rows' logits, where this rank holds them) sent to rank 0, which returns them as
        execute does (the other ranks return none)."""
        stage, pipe = self.stage, self.pipe
        if not stage.is_last:
            pipe.send_hidden(out)
        elif batch.sample_rows and pipe.sends_logits:
            pipe.send_logits(out)
        if not batch.sample_rows:
            return [], None
        if self.ctx.is_driver:
            return batch.sample_seq_ids, pipe.receive_logits(len(batch.sample_rows), self.model_config.vocab_size)
        return batch.sample_seq_ids, None

    def _layer_caches(self, batch: StepBatch) -> list:
        """Every layer's cache for this step, in layer order: the KV cache's layers, for each linear-attention
        layer (pool, the chunks' slots, batch.row_start, or None where every chunk is one token), and None for a
        layer with neither (NemotronH's MLP blocks). Slots of chunks that start a sequence are zeroed first."""
        cfg = self.model_config
        if not self.state_pools and len(cfg.kv_layers) == cfg.num_layers:
            return self.kv_caches
        slots = starts = None
        if self.state_pools:
            self._zero_fresh_slots(batch)
            slots = self._long(batch.state_slots)
            starts = None if batch.decode_only else batch.row_start
        return layer_caches(cfg, self.kv_caches, self.state_pools, slots, starts, self.stage)

    def _zero_fresh_slots(self, batch: StepBatch) -> None:
        """Zero the state slots of the chunks that start a sequence (a one-token prompt is one in a decode step)."""
        fresh = [c.state_slot for c in batch.chunks if c.start_position == 0 and c.state_slot >= 0]
        if fresh:
            fresh_slots = self._long(fresh)
            for pool in self.state_pools.values():
                for t in pool:
                    t.index_fill_(0, fresh_slots, 0)

    def _shared_tokens(self, plan: StepPlan, device_tokens: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's tokens from the device, on every rank (rank 0 sends them; the others pass None)."""
        if not self.ctx.is_driver:
            device_tokens = torch.empty(plan.num_device_tokens, dtype=torch.long, device=self.device)
        self.ctx.comm.broadcast_from_first(device_tokens)
        return device_tokens

    def _input_tokens(self, plan: StepPlan, batch: StepBatch, device_tokens: torch.Tensor | None) -> torch.Tensor:
        """Every row's input token on the device: the FROM_DEVICE rows (the batch's first rows: single-token
        chunks come first, in plan order) from `device_tokens`, the others from the plan."""
        n = plan.num_device_tokens
        if device_tokens is None or device_tokens.shape[0] != n or FROM_DEVICE in batch.token_ids[n:]:
            raise ValueError(f"a plan with {n} tokens from the device needs them first and one per row, got "
                             f"{None if device_tokens is None else device_tokens.shape[0]}")
        if n == batch.num_tokens:
            return device_tokens
        return torch.cat([device_tokens, self._long(batch.token_ids[n:])])

    def _long(self, values: list[int]) -> torch.Tensor:
        return on_device(values, self.device, torch.long)

