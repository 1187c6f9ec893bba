"""Runs the model for a step plan on one rank: builds the batch tensors, then one forward pass.

Every rank runs the same plan, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import logging
import time

import torch

from shardserve.config import EngineConfig, ModelConfig
from shardserve.distributed.process_group import RankContext
from shardserve.engine.kv_cache import (agree_on_num_blocks, allocate_kv_cache, bytes_per_block,
                                        kv_cache_budget_bytes)
from shardserve.engine.step_plan import SeqChunk, StepPlan
from shardserve.layers.attention import AttentionMetadata, PrefillChunk
from shardserve.layers.linear_kernels import choose_linear_kernel, pack_linear_weights
from shardserve.models import MODEL_CLASSES
from shardserve.weights.loader import load_weights

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, ctx: RankContext) -> None:
        self.config = config
        self.model_config = model_config
        self.ctx = ctx
        self.device = ctx.device
        self.dtype = config.resolve_dtype(model_config)
        self.max_model_len = config.resolve_max_model_len(model_config)
        self.block_size = config.block_size
        self.model = self._load_model()
        self.num_blocks = self._size_kv_cache()
        self.kv_caches = allocate_kv_cache(model_config.num_layers, self.num_blocks, self.block_size,
                                           self.model.kv_heads_per_rank(), model_config.head_dim, self.dtype,
                                           self.device)

    def _load_model(self):
        started = time.perf_counter()
        cls = MODEL_CLASSES[self.model_config.family]
        torch.manual_seed(0)
        with torch.device(self.device):
            model = cls(self.model_config, self.ctx.comm, self.dtype, self.max_model_len)
        load_weights(model, self.config.model, self.model_config.tie_word_embeddings)
        checkpoint_dtype = self.model_config.checkpoint_dtype()
        keep_bf16 = self.config.dtype == "auto" and checkpoint_dtype in (torch.bfloat16, torch.float16)
        kernel = choose_linear_kernel(self.device, self.dtype, keep_bf16_weights=keep_bf16)
        if kernel.name != "torch":
            packed = pack_linear_weights(model, kernel)
            if self.ctx.is_driver:
                logger.info("linear layers: %s kernels (%d layers prepared)", kernel.name, packed)
        model.eval()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info("rank %d loaded %s in %.1f s: %.2f GiB of %s weights on %s", self.ctx.rank, self.config.model,
                    time.perf_counter() - started, weight_bytes / 2**30, self.dtype, self.device)
        return model

    def _size_kv_cache(self) -> int:
        cfg = self.model_config
        per_block = bytes_per_block(cfg.num_layers, self.block_size, self.model.kv_heads_per_rank(), cfg.head_dim,
                                    self.dtype)
        budget = kv_cache_budget_bytes(self.device, self.config.kv_cache_memory_gb, self.config.gpu_memory_utilization)
        num_blocks = agree_on_num_blocks(budget // per_block, self.ctx.control_group, self.ctx.world_size)
        needed = -(-self.max_model_len // self.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks * self.block_size} tokens ({num_blocks} blocks of {self.block_size}) "
                f"but --max-model-len is {self.max_model_len}: lower --max-model-len or raise --kv-cache-memory"
            )
        logger.info("rank %d KV cache: %d blocks of %d tokens (%.2f GiB)", self.ctx.rank, num_blocks,
                    self.block_size, num_blocks * per_block / 2**30)
        return num_blocks

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[list[int], torch.Tensor | None]:
        """Run the plan; returns the seq ids that sampled and, on rank 0, their logits (float32, on the CPU)."""
        chunks = sorted(plan.chunks, key=lambda c: len(c.token_ids) > 1)  # single-token chunks first
        token_ids, positions, meta, sample_rows, sample_ids = self._prepare(chunks)
        hidden = self.model(token_ids, positions, self.kv_caches, meta)
        if not sample_rows:
            return [], None
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        return sample_ids, None if logits is None else logits.float().cpu()

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _prepare(self, chunks: list[SeqChunk]):
        token_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[int] = []
        singles: list[SeqChunk] = []
        prefills: list[PrefillChunk] = []
        for chunk in chunks:
            n, start = len(chunk.token_ids), chunk.start_position
            row = len(token_ids)
            token_ids.extend(chunk.token_ids)
            positions.extend(range(start, start + n))
            slot_mapping.extend(self._slots(chunk.block_table, start, start + n))
            if n == 1:
                singles.append(chunk)
            else:
                context = torch.tensor(self._slots(chunk.block_table, 0, start + n), device=self.device)
                prefills.append(PrefillChunk(row, row + n, context, start))
            if chunk.sample:
                sample_rows.append(row + n - 1)
                sample_ids.append(chunk.seq_id)
        single_slots, single_mask = self._single_tables(singles)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            num_single=len(singles), single_slots=single_slots, single_mask=single_mask, prefills=prefills,
        )
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(token_ids), as_tensor(positions), meta, sample_rows, sample_ids

    def _single_tables(self, singles: list[SeqChunk]):
        """Padded [n, max_context] slot table and validity mask for the single-token chunks."""
        if not singles:
            return None, None
        bs = self.block_size
        context_lens = torch.tensor([c.start_position + 1 for c in singles])
        max_context = int(context_lens.max())
        max_blocks = -(-max_context // bs)
        tables = torch.zeros(len(singles), max_blocks, dtype=torch.long)
        for i, c in enumerate(singles):
            used = c.block_table[:max_blocks]
            tables[i, : len(used)] = torch.tensor(used, dtype=torch.long)
        pos = torch.arange(max_context)
        valid = pos.unsqueeze(0) < context_lens.unsqueeze(1)
        # Padding past a sequence's context reads slot 0 (block 0 is zeroed, never NaN), not the unwritten
        # rest of its own last block: the cache is uninitialised, and a masked-out NaN still poisons the sum.
        slots = torch.where(valid, tables[:, pos // bs] * bs + pos % bs, 0)
        return slots.to(self.device), valid[:, None, None, :].to(self.device)
