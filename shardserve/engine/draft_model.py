"""Speculative decoding with a draft model (`{"method": "draft_model", "model": PATH, ...}`): a smaller model of the
target's vocabulary proposes its greedy tokens, which the target verifies (engine/speculative.py).

Where it runs: on rank 0 only, where the scheduler asks for proposals, on rank 0's device, as one rank (no tensor
parallelism, whatever the target's), in the target's dtype. The other ranks never see it: the step plan carries the
proposals to them as it carries n-gram ones. It is built from the engine's own pieces: a ModelRunner of one rank
(DraftRunner) with its own paged KV cache, whose blocks a BlockManager of its own hands out (no prefix caching).

Exactness: a proposal is the draft's argmax, so the proposal distribution q is a point mass on it. Rejection
sampling with such a q accepts d with probability min(1, p(d) / q(d)) = p(d) and otherwise draws from (p - q)+
normalised, which is p without d: what Sampler.verify does. Sampled requests keep the target's distribution and
greedy ones its tokens, whatever the draft proposes.

Per sequence the draft keeps (DraftCache) how many of the sequence's tokens are in its cache, and the proposals it
computed after them. Proposing for the decoding sequences of a step:
1. of its last proposals, those the sequence now holds (the accepted ones) count as cached; its entries for the others
   are forgotten (they sit past the cached length and are overwritten when those positions are computed, as the
   target's rejected proposals' are). This is done here, by comparing tokens, rather than told by the verification:
   it needs no hook there and also covers proposals the scheduler cut to its token budget. The sequence's last token
   never counts as cached: its row gives proposal 1.
2. the tokens not in its cache (the prompt and first token the first time; after a verified step the last one or
   two) are computed for every sequence together, in forward passes of at most max_num_batched_tokens tokens;
3. then k - 1 passes of one token a sequence, each position of every sequence in one pass, each taking the
   argmaxes of the pass before on the device (decode steps, replayed as CUDA graphs on GPUs); the proposals reach
   the host once, at the end. A step of k proposals so costs k draft passes.
A sequence needs blocks for its tokens and k - 1 proposals; where the draft's pool has none left it proposes nothing
that step (the request goes on one token a step). Its blocks go back when it stops running (Proposer.release: it
finished, was aborted or preempted), not when it stops proposing (stops_paying), which is rare and may be undone by a
preemption.

Memory: the draft's KV cache, and on GPUs without --kv-cache-memory (where the budget is what the device has left)
its weights and working memory, are set aside from rank 0's KV-cache budget before the target's cache is sized
(ModelRunner's kv_set_aside); the other ranks take rank 0's block count, as they always agree on the smallest. What
is left after the weights is split so that both caches hold the same number of tokens (the draft never needs more
than the target holds), the draft's capped at max_num_seqs sequences of max_model_len. A draft whose positions end
before the target's max_model_len serves that much: longer sequences propose nothing. With --load-format dummy a
draft other than the target's own path draws its weights with seed + 1: a different random model even of the
target's shape (the target's own path gives the target's weights).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from shardserve.attention import kv_quant
from shardserve.config import EngineConfig, ModelConfig, SpeculativeConfig
from shardserve.distributed.communicator import Communicator
from shardserve.distributed.process_group import RankContext
from shardserve.engine.block_manager import BlockManager
from shardserve.engine.kv_cache import bytes_per_block
from shardserve.engine.model_runner import ModelRunner
from shardserve.engine.sequence import Sequence
from shardserve.engine.speculative import Proposer
from shardserve.models import model_class
from shardserve.planner import draft_cache_blocks
from shardserve.transfers import on_device
from shardserve.wire.step_plan import FROM_DEVICE, PlanKind, SeqChunk, StepPlan

logger = logging.getLogger(__name__)


def check_draft_model(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft's config; a ValueError naming --speculative-config's "model" where it cannot serve as the target's
    draft: a path that is not there, an architecture shardserve cannot load, another vocabulary, a cache other than
    keys and values (recurrent state, latent attention)."""
    where = f'--speculative-config: "model" {spec.model!r}'
    if not os.path.exists(spec.model):
        raise ValueError(f"{where} does not exist: give the draft model's directory or GGUF file")
    try:
        draft = ModelConfig.from_model_path(spec.model)
        model_class(draft.architecture)
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"{where} cannot be loaded as a draft model: {e}") from None
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{where} has a vocabulary of {draft.vocab_size} tokens but the target "
                         f"{target.architecture} has {target.vocab_size}: a draft model must share the target's "
                         "vocabulary (the same tokenizer)")
    if draft.linear_attention_layers or draft.latent_attention:
        raise ValueError(f"{where} is a {draft.architecture}, whose cache is not keys and values (recurrent state or "
                         "latent attention): draft models are attention decoders such as Llama, Qwen2/3 or Mistral")
    return draft


@dataclass
class DraftPlan:
    """The draft model before anything loads: its config, context, and what it takes of rank 0's KV budget."""

    path: str
    model_config: ModelConfig
    max_model_len: int  # the target's, or the draft's own position limit where that is shorter
    block_size: int
    max_blocks: int  # max_num_seqs full contexts
    bytes_per_token: int  # its KV cache's
    # Its weights and working memory (the planner's estimate) where rank 0's KV budget is what its GPU has left; 0
    # where the budget is --kv-cache-memory (CPUs, or GPUs given it), which weights do not come out of.
    outside_cache_bytes: int
    cost: float  # one draft pass in target steps: its weights over one target rank's (each pass reads them once)
    cache_bytes: int = 0  # its KV cache, chosen by set_aside
    what: str = "draft model"  # what proposes, in the log and errors ("MTP layer of": engine/mtp.py)

    @classmethod
    def for_engine(cls, config: EngineConfig, target: ModelConfig, dtype: torch.dtype,
                   max_model_len: int) -> "DraftPlan":
        from shardserve.planner import (GPU_FIXED_OVERHEAD, PlanRequest, load_hf_config, plan,
                                        weight_elements_per_rank)

        spec = config.speculative_config
        draft = check_draft_model(spec, target)
        length = min(max_model_len, draft.position_limit)
        kv_dtype = kv_quant.cache_dtype(config.kv_cache_dtype, dtype)
        per_token = bytes_per_block(len(draft.kv_layers), 1, draft.num_kv_heads, draft.head_dim, kv_dtype)
        cfg = dict(load_hf_config(spec.model), torch_dtype=str(dtype).removeprefix("torch."))
        outside = 0
        if config.device != "cpu" and config.kv_cache_memory_gb is None:  # the budget is what the device has left
            p = plan(cfg, PlanRequest(1, length, config.max_num_seqs, config.max_num_batched_tokens,
                                      kv_cache_dtype=config.kv_cache_dtype))
            outside = p.weight_bytes + p.overhead_bytes - GPU_FIXED_OVERHEAD  # the device's context is the target's
        target_rank = weight_elements_per_rank(load_hf_config(config.model), config.tensor_parallel_size, [])
        cost = weight_elements_per_rank(cfg, 1, []) / target_rank
        blocks_per_seq = -(-length // config.block_size)
        return cls(spec.model, draft, length, config.block_size, config.max_num_seqs * blocks_per_seq, per_token,
                   outside, cost)

    def set_aside(self, budget: int, target_bytes_per_token: int) -> int:
        """ModelRunner's kv_set_aside: of rank 0's KV budget, the draft's weights and working memory
        (outside_cache_bytes) and a cache of as many tokens as the target's keeps, at most max_num_seqs full contexts
        (planner.draft_cache_blocks); records cache_bytes."""
        per_block = self.bytes_per_token * self.block_size
        blocks = draft_cache_blocks(budget, self.outside_cache_bytes, target_bytes_per_token, self.bytes_per_token,
                                    self.block_size, self.max_blocks)
        if blocks * self.block_size < self.max_model_len:
            raise ValueError(f"the {self.what} {self.path!r} takes {self.outside_cache_bytes / 2**30:.2f} GiB of the "
                             f"KV-cache budget of {budget / 2**30:.2f} GiB on rank 0, and what is left holds "
                             f"{blocks * self.block_size} tokens each of its cache and the target's, under "
                             f"--max-model-len {self.max_model_len}: raise --kv-cache-memory or "
                             "--gpu-memory-utilization, or lower --max-model-len")
        self.cache_bytes = blocks * per_block
        logger.info("%s %s: %.2f GiB set aside from rank 0's KV-cache budget of %.2f GiB: its KV cache of "
                    "%d tokens (%.2f GiB)%s", self.what, self.path,
                    (self.outside_cache_bytes + self.cache_bytes) / 2**30, budget / 2**30, blocks * self.block_size,
                    self.cache_bytes / 2**30,
                    f" and its weights and working memory ({self.outside_cache_bytes / 2**30:.2f} GiB, planned)"
                    if self.outside_cache_bytes else "")
        return self.outside_cache_bytes + self.cache_bytes


class DraftRunner(ModelRunner):
    """A ModelRunner of the draft: one rank on rank 0's device, a KV cache of exactly --kv-cache-memory (its
    DraftPlan.cache_bytes, set aside from the target's)."""

    # After a verified step a sequence's draft cache lacks at most its last proposal and the target's token: those
    # two rows a sequence replay a graph (StepBatch.decode_rows), as the target's rows to verify do.
    rows_per_sequence = 2

    def _size_kv_cache(self) -> int:
        per_block = self._kv_bytes_per_block()
        num_blocks = int(self.config.kv_cache_memory_gb * 2**30) // per_block
        logger.info("draft model KV cache: %d blocks of %d tokens (%.2f GiB of %s)", num_blocks, self.block_size,
                    num_blocks * per_block / 2**30, kv_quant.describe(self.kv_dtype))
        return num_blocks

    def _log_memory_against_plan(self) -> None:
        loaded = sum(p.numel() * p.element_size() for p in self.model.parameters())
        free, total = torch.cuda.mem_get_info(self.device)
        logger.info("draft model memory: weights %.2f GiB, KV cache %.2f GiB; %.2f GiB in use on the device with the "
                    "target's", loaded / 2**30, self.num_blocks * self._kv_bytes_per_block() / 2**30,
                    (total - free) / 2**30)


def draft_engine_config(config: EngineConfig, plan: DraftPlan, dtype: torch.dtype) -> EngineConfig:
    """The draft's own engine settings: the target's batch limits, block size, device and cache dtype; one rank, the
    target's dtype, its own context and cache; dummy weights of its own seed unless it is the target's path."""
    same = os.path.realpath(plan.path) == os.path.realpath(config.model)
    return dataclasses.replace(
        config, model=plan.path, tensor_parallel_size=1, pipeline_parallel_size=1,
        dtype=str(dtype).removeprefix("torch."), max_model_len=plan.max_model_len,
        kv_cache_memory_gb=plan.cache_bytes / 2**30, enable_prefix_caching=False, seed=config.seed + (not same),
        forward_env=(), enable_expert_parallel=False, quantization=None, speculative_config=None)


@dataclass
class DraftCache:
    """A sequence in the draft's cache. Invariant: its first num_computed_tokens tokens have their keys and values in
    the blocks of block_table, and `proposed` (the proposals of its last step but the last) follow them at the next
    positions, kept until the next step checks them against the tokens the sequence then holds. (The MTP layer keeps
    its rows so, without `proposed`: engine/mtp.py.)"""

    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0  # BlockManager's field; the draft caches no prefixes
    proposed: list[int] = field(default_factory=list)

    def settle(self, token_ids: list[int]) -> None:
        """Count the proposals the sequence now holds as computed, forget the others; the last token stays
        uncomputed (its row gives the next proposal)."""
        n = self.num_computed_tokens
        for proposal in self.proposed:
            if n >= len(token_ids) or token_ids[n] != proposal:
                break
            n += 1
        self.num_computed_tokens = min(n, len(token_ids) - 1)
        self.proposed = []


class ReadySeq(NamedTuple):
    """A sequence the draft proposes for this step: k proposals, blocks for its tokens and the first k - 1 of them."""

    seq: Sequence
    cache: DraftCache
    k: int


def proposals_by_sequence(columns: list[tuple[list[int], torch.Tensor]]) -> dict[int, list[int]]:
    """Each sequence's proposals from the passes' (seq ids, argmaxes on the device) columns, in pass order, with one
    copy to the host."""
    values = iter(torch.cat([tokens for _, tokens in columns]).tolist())
    made: dict[int, list[int]] = {}
    for ids, _ in columns:
        for seq_id in ids:
            made.setdefault(seq_id, []).append(next(values))
    return made


class DraftModelProposer(Proposer):
    """Proposals from a draft model on rank 0 (the module docstring says how)."""

    runner_class = DraftRunner

    def __init__(self, config: EngineConfig, plan: DraftPlan, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, break_even: float) -> None:
        super().__init__(config.speculative_config, max_model_len, break_even)
        ctx = RankContext(0, 1, device, Communicator(None, 0, 1), None)
        self.runner = self.runner_class(draft_engine_config(config, plan, dtype), plan.model_config, ctx)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, enable_prefix_caching=False)
        self.max_batched_tokens = config.max_num_batched_tokens
        self.draft_len = plan.max_model_len
        self.caches: dict[int, DraftCache] = {}
        self._step_id = 0

    @torch.inference_mode()
    def propose_all(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        ready: dict[int, ReadySeq] = {}
        for seq, room in requests:
            cache = self.caches.setdefault(seq.seq_id, DraftCache())
            cache.settle(seq.token_ids)
            k = min(room, self.draft_len + 1 - seq.num_tokens)  # its last proposal fed at draft_len - 1 at most
            if k > 0 and self.blocks.can_allocate(cache, seq.num_tokens + k - 1):
                self.blocks.allocate(cache, seq.num_tokens + k - 1)
                ready[seq.seq_id] = ReadySeq(seq, cache, k)
        if not ready:
            return [[] for _ in requests]
        made = self._extend(ready, *self._catch_up(ready))
        for seq_id, proposals in made.items():
            self.caches[seq_id].proposed = proposals[:-1]
        return [made.get(seq.seq_id, []) for seq, _ in requests]

    def _catch_up(self, ready: dict[int, ReadySeq]) -> tuple[list[int], torch.Tensor]:
        """Compute every ready sequence's tokens not in the cache, in passes of at most max_num_batched_tokens;
        returns the seq ids in the order their last rows came out, and those rows' argmaxes (proposal 1) on the
        device."""
        order, firsts = [], []
        pending = [(r.seq, r.cache) for r in ready.values()]
        while pending:
            budget, chunks, left = self.max_batched_tokens, [], []
            for seq, cache in pending:
                start = cache.num_computed_tokens
                n = min(seq.num_tokens - start, budget)
                if n > 0:
                    chunks.append(SeqChunk(seq.seq_id, start, seq.token_ids[start:start + n], cache.block_table,
                                           start + n == seq.num_tokens))
                    cache.num_computed_tokens += n
                    budget -= n
                if cache.num_computed_tokens < seq.num_tokens:
                    left.append((seq, cache))
            seq_ids, logits = self._run(chunks)
            if seq_ids:
                order += seq_ids
                firsts.append(logits.argmax(dim=-1))
            pending = left
        return order, torch.cat(firsts)

    def _extend(self, ready: dict[int, ReadySeq], ids: list[int], tokens: torch.Tensor) -> dict[int, list[int]]:
        """From proposal 1 of each of `ids` (`tokens`, on the device), one pass a further proposal for those that want
        it, each taking the argmaxes of the pass before as its input; returns every sequence's proposals (one copy to
        the host)."""
        columns = [(ids, tokens)]
        for step in range(1, max(r.k for r in ready.values())):
            keep = [i for i, seq_id in enumerate(ids) if ready[seq_id].k > step]
            if len(keep) < len(ids):
                ids, tokens = [ids[i] for i in keep], tokens[on_device(keep, tokens.device)]
            chunks = [SeqChunk(seq_id, ready[seq_id].seq.num_tokens + step - 1, [FROM_DEVICE],
                               ready[seq_id].cache.block_table, True) for seq_id in ids]
            _, logits = self._run(chunks, tokens)
            tokens = logits.argmax(dim=-1)
            columns.append((ids, tokens))
        return proposals_by_sequence(columns)

    def _run(self, chunks: list[SeqChunk], device_tokens: torch.Tensor | None = None):
        """One forward pass of the draft: (seq ids of the rows that sample, their logits)."""
        self._step_id += 1
        plan = StepPlan(self._step_id, PlanKind.RUN, chunks, tokens_from_device=device_tokens is not None)
        return self.runner.execute(plan, device_tokens)

    def release(self, seq: Sequence) -> None:
        cache = self.caches.pop(seq.seq_id, None)
        if cache is not None:
            self.blocks.free_sequence(cache)

    def reset(self) -> None:
        self.caches.clear()
        self.blocks = BlockManager(self.runner.num_blocks, self.blocks.block_size, enable_prefix_caching=False)

    def sleep(self, level: int) -> None:
        self.runner.sleep(level)

    def wake(self, weights: bool, kv_cache: bool) -> None:
        self.runner.wake(weights, kv_cache)

    def close(self) -> None:
        self.runner.close()
