"""Speculative decoding with a DeepSeek checkpoint's own multi-token-prediction layer (`{"method": "mtp", ...}`, alias
"deepseek_mtp"): the MTP layer (models/deepseek_mtp.py) proposes its greedy tokens, which the target verifies
(engine/speculative.py).

It is the draft model's mechanism (engine/draft_model.py) with another model and one more input: a DraftRunner of
one rank on rank 0 (MtpRunner: eager, weights read as the values they encode) with its own paged latent cache of one
layer, whose blocks its own BlockManager hands out, set aside from rank 0's KV-cache budget (DraftPlan, built here by
mtp_plan); proposals are argmaxes, point masses, so verification stays exact for greedy and sampled requests.

The extra input is the target's last hidden state before its final norm. With MTP on, every target step runs through
ModelRunner.execute_hidden (CUDA graphs are off on every rank), which returns every row's; under tensor parallelism
they are the same on every rank after the all-reduce, so rank 0 has them. The proposer keeps them per sequence
(observe; _Hiddens), by position, for the sequences that speculate: a step that computes position p again (the
position of a rejected proposal, recomputed with its true token) replaces what was kept from p on.

Positions. Row i of the MTP layer takes (t_{i+1}, h_i), the target's hidden state at i, at rotary position i, and
proposes t_{i+2} (row 0 takes a zero embedding, as in vLLM: models/deepseek_mtp.py). For a decoding sequence of n
tokens (the last, t_{n-1}, not yet computed by the target), the target has computed positions 0 .. n-2 with their
true context (after a verified step: the last token and the accepted proposals; the rows of rejected proposals
sit at n-1 and after), so h_0 .. h_{n-2} are valid and so are the MTP rows 0 .. n-2. Proposing for a step:
1. catch up: the rows from the sequence's num_computed_tokens to n - 2 are computed for every sequence together
   (passes of at most max_num_batched_tokens rows); row n - 2, whose token is the last one, gives proposal 1 and
   never counts as computed (it is computed again next step, as the draft model's last token is);
2. then k - 1 passes of one row a sequence: row n - 2 + j takes proposal j and the MTP layer's own output at the row
   before (its hidden state before shared_head.norm) in place of h, and proposes j + 1 (vLLM applies its one MTP
   layer so, k times). These rows' cache entries sit past num_computed_tokens and are overwritten by the next catch
   up, which computes them from the target's hidden states: an entry is counted as computed only when it was made
   from the target's h and the sequence's own token.
The cache entry of row i reads h_i, which is valid only once position i is accepted; the invariant above (rows
counted as computed stop at n - 2, where the target's valid states stop) keeps rejected positions' states out.
A sequence needs blocks for n - 2 + k rows; where the pool has none left it proposes nothing that step. Where a
sequence's kept states do not reach back to its first uncomputed row (it did not speculate for a while:
Proposer.speculates) it proposes nothing. Its blocks and states go back when it stops running (Proposer.release).

Prefix caching is off with MTP (a cached prefix's hidden states are not kept). --load-format dummy draws the layer's
weights as the target's are drawn (synthetic_mtp_shapes). Not yet: more than one MTP layer (num_nextn_predict_layers
> 1: the first serves), pipeline stages, CUDA graphs for the MTP passes and the target's steps, a quantized
checkpoint's MTP layer kept packed (it is read as the values it encodes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

import torch

from shardserve.attention import kv_quant
from shardserve.config import EngineConfig, ModelConfig
from shardserve.distributed.communicator import Communicator
from shardserve.engine.draft_model import (DraftCache, DraftModelProposer, DraftPlan, DraftRunner, ReadySeq,
                                           proposals_by_sequence)
from shardserve.engine.kv_cache import bytes_per_block
from shardserve.engine.model_runner import HiddenStep
from shardserve.engine.sequence import Sequence
from shardserve.transfers import on_device
from shardserve.wire.step_plan import FROM_DEVICE, PlanKind, SeqChunk, StepPlan

MTP_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_OTHER_MTP = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
              "Qwen3_5MoeForConditionalGeneration", "NemotronHForCausalLM")


def check_mtp(model: str, target: ModelConfig, pipeline_parallel_size: int = 1) -> None:
    """A ValueError naming what is missing where method "mtp" cannot serve the target `model` (of config `target`):
    another architecture, a checkpoint without an MTP layer (num_nextn_predict_layers), pipeline stages."""
    where = "--speculative-config: method 'mtp'"
    if target.architecture in _OTHER_MTP:
        raise ValueError(f"{where}: the MTP layers of {target.architecture} are not supported yet; shardserve serves "
                         f"those of {' and '.join(MTP_ARCHITECTURES)} checkpoints")
    if target.architecture not in MTP_ARCHITECTURES:
        raise ValueError(f"{where} needs a DeepSeek-V2/V3 checkpoint with a multi-token-prediction layer "
                         f"({', '.join(MTP_ARCHITECTURES)}); {model!r} is a {target.architecture}: use method "
                         "'draft_model' or 'ngram'")
    if target.num_nextn_predict_layers < 1:
        raise ValueError(f"{where} needs the checkpoint's multi-token-prediction layer, but {model!r} has "
                         "none: its config.json has no num_nextn_predict_layers, or 0 (DeepSeek-V3 and R1 have 1); "
                         "use method 'draft_model' or 'ngram'")
    if pipeline_parallel_size > 1:
        raise ValueError(f"{where} runs on one pipeline stage only: leave --pipeline-parallel-size at 1")


def mtp_model_config(target: ModelConfig) -> ModelConfig:
    """DeepseekMTP's config: the target's, as a model of one layer (its cache's), with num_nextn_predict_layers
    holding the checkpoint index of that layer (models/deepseek_mtp.py). DeepSeek's sparse layers are every one from
    first_k_dense_replace on, so the MTP layer is sparse where the last decoder layer is."""
    sparse = target.num_layers - 1 in target.moe_layers
    return dataclasses.replace(target, architecture="DeepseekMTP", num_layers=1, moe_layers=(0,) if sparse else (),
                               num_nextn_predict_layers=target.num_layers)


def mtp_plan(config: EngineConfig, target: ModelConfig, dtype: torch.dtype, max_model_len: int) -> DraftPlan:
    """The MTP layer before anything loads, as a DraftPlan: a latent cache of one layer, and on GPUs without
    --kv-cache-memory its weights (counted on a model built on the meta device) out of rank 0's KV budget."""
    from shardserve.models.deepseek_mtp import DeepseekMTP
    from shardserve.planner import load_hf_config, weight_elements_per_rank

    check_mtp(config.model, target, config.pipeline_parallel_size)
    cfg = mtp_model_config(target)
    with torch.device("meta"):
        model = DeepseekMTP(cfg, Communicator(None, 0, 1), dtype, max_model_len)
    elements = sum(p.numel() for p in model.parameters())
    kv_dtype = kv_quant.cache_dtype(config.kv_cache_dtype, dtype)
    per_token = bytes_per_block(1, 1, 1, target.kv_lora_rank + target.qk_rope_head_dim, kv_dtype, planes=1)
    outside = elements * dtype.itemsize if config.device != "cpu" and config.kv_cache_memory_gb is None else 0
    target_rank = weight_elements_per_rank(load_hf_config(config.model), config.tensor_parallel_size, [])
    blocks_per_seq = -(-max_model_len // config.block_size)
    return DraftPlan(config.model, cfg, max_model_len, config.block_size, config.max_num_seqs * blocks_per_seq,
                     per_token, outside, elements / target_rank, what="MTP layer of")


def synthetic_mtp_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of the MTP layer's tensors for --load-format dummy, given DeepseekMTP's config: its
    decoder layer's as synthetic_checkpoint_shapes names layer 0's, under model.layers.{L}., the embedding, and the
    MTP layer's own tensors (their values then follow from the seed and the name, as the target's do)."""
    from shardserve.weights.synthetic import synthetic_checkpoint_shapes

    layer, h = f"model.layers.{cfg.num_nextn_predict_layers}.", cfg.hidden_size
    for name, shape in synthetic_checkpoint_shapes(cfg):
        if name.startswith("model.layers.0."):
            yield layer + name.removeprefix("model.layers.0."), shape
        elif name == "model.embed_tokens.weight":
            yield name, shape
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        yield f"{layer}{norm}.weight", (h,)
    yield f"{layer}eh_proj.weight", (h, 2 * h)
    yield f"{layer}shared_head.head.weight", (cfg.vocab_size, h)


class MtpRunner(DraftRunner):
    """The MTP layer's runner: eager (its passes take hidden states the decode graphs do not), no planner (it is one
    layer of the target's checkpoint), quantized layers read as the values they encode, dummy weights of its own
    names (synthetic_mtp_shapes)."""

    def _capture_graphs(self) -> None:
        pass

    def _plan_memory(self):
        return None

    def _packed_layout(self):
        return None

    def _fill_weights(self, model) -> None:
        if self.config.load_format != "dummy":
            return super()._fill_weights(model)
        from shardserve.weights.loader import load_tensors
        from shardserve.weights.synthetic import synthetic_tensor

        tensors = ((name, synthetic_tensor(name, shape, self.device, self.dtype, self.config.seed))
                   for name, shape in synthetic_mtp_shapes(self.model_config))
        load_tensors(model, tensors, False, "synthetic weights for the MTP layer")


@dataclass
class _Hiddens:
    """The target's last hidden states (before its final norm) of a sequence's positions start, start + 1, ...:
    `rows`, the latest computed of each position."""

    start: int
    rows: torch.Tensor

    def write(self, position: int, rows: torch.Tensor) -> None:
        """The states of positions position, position + 1, ... replace those kept from `position` on."""
        if not self.start <= position <= self.start + len(self.rows):
            self.start, self.rows = position, rows
            return
        self.rows = torch.cat((self.rows[:position - self.start], rows))

    def covers(self, first: int, last: int) -> bool:
        return self.start <= first and last < self.start + len(self.rows)

    def take(self, first: int, count: int) -> torch.Tensor:
        return self.rows[first - self.start:first - self.start + count]

    def drop_before(self, position: int) -> None:
        self.rows, self.start = self.rows[position - self.start:], position


class MtpProposer(DraftModelProposer):
    """Proposals from the MTP layer on rank 0, fed the target's hidden states (the module docstring says how)."""

    runner_class = MtpRunner
    takes_hidden = True

    def __init__(self, config: EngineConfig, plan: DraftPlan, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, break_even: float) -> None:
        super().__init__(config, plan, device, dtype, max_model_len, break_even)
        self.hiddens: dict[int, _Hiddens] = {}

    def observe(self, step: HiddenStep, seqs: dict[int, Sequence]) -> None:
        """Keep the hidden states of a target step's rows, by position, for the sequences that speculate."""
        batch = step.batch
        for i, chunk in enumerate(batch.chunks):
            seq = seqs.get(chunk.seq_id)
            if seq is None or not self.speculates(seq):
                continue
            rows = step.hidden[batch.row_start[i]:batch.row_start[i + 1]]
            kept = self.hiddens.get(seq.seq_id)
            if kept is None:
                self.hiddens[seq.seq_id] = _Hiddens(chunk.start_position, rows)
            else:
                kept.write(chunk.start_position, rows)

    @torch.inference_mode()
    def propose_all(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        ready: dict[int, ReadySeq] = {}
        for seq, room in requests:
            cache = self.caches.setdefault(seq.seq_id, DraftCache())
            kept, last_row = self.hiddens.get(seq.seq_id), seq.num_tokens - 2
            if last_row < 0 or kept is None or not kept.covers(cache.num_computed_tokens, last_row):
                continue
            if self.blocks.can_allocate(cache, last_row + room):
                self.blocks.allocate(cache, last_row + room)
                ready[seq.seq_id] = ReadySeq(seq, cache, room)
        if not ready:
            return [[] for _ in requests]
        made = self._extend(ready, *self._catch_up(ready))
        return [made.get(seq.seq_id, []) for seq, _ in requests]

    def _catch_up(self, ready: dict[int, ReadySeq]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Compute every ready sequence's rows from num_computed_tokens to n - 2 in passes of at most
        max_num_batched_tokens rows; returns the seq ids in the order their rows n - 2 came out, those rows'
        argmaxes (proposal 1) and their hidden states, on the device."""
        order, firsts, states = [], [], []
        pending = list(ready.values())
        while pending:
            budget, chunks, inputs, left = self.max_batched_tokens, [], [], []
            for r in pending:
                seq, cache, kept = r.seq, r.cache, self.hiddens[r.seq.seq_id]
                start, last_row = cache.num_computed_tokens, seq.num_tokens - 2
                n = min(last_row + 1 - start, budget)
                if n > 0:
                    # Row i's token is t_{i+1}.
                    chunks.append(SeqChunk(seq.seq_id, start, seq.token_ids[start + 1:start + 1 + n],
                                           cache.block_table, start + n == last_row + 1))
                    inputs.append(kept.take(start, n))
                    cache.num_computed_tokens += n
                    budget -= n
                if cache.num_computed_tokens <= last_row:
                    left.append(r)
                else:
                    cache.num_computed_tokens = last_row  # row n - 2 is computed again next step
                    kept.drop_before(last_row)
            by_rows = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) > 1)  # StepBatch's order
            step = self._run([chunks[i] for i in by_rows], torch.cat([inputs[i] for i in by_rows]))
            if step.seq_ids:
                order += step.seq_ids
                firsts.append(step.logits.argmax(dim=-1))
                states.append(step.hidden[on_device(step.batch.sample_rows, step.hidden.device)])
            pending = left
        return order, torch.cat(firsts), torch.cat(states)

    def _extend(self, ready: dict[int, ReadySeq], ids: list[int], tokens: torch.Tensor,
                states: torch.Tensor) -> dict[int, list[int]]:
        """From proposal 1 of each of `ids` (`tokens`, and the MTP layer's hidden states of their rows, on the
        device), one pass a further proposal for those that want it, each row taking the proposal and hidden state
        of the row before; returns every sequence's proposals (one copy to the host)."""
        columns = [(ids, tokens)]
        for step in range(1, max(r.k for r in ready.values())):
            keep = [i for i, seq_id in enumerate(ids) if ready[seq_id].k > step]
            if len(keep) < len(ids):
                rows = on_device(keep, tokens.device)
                ids, tokens, states = [ids[i] for i in keep], tokens[rows], states[rows]
            chunks = [SeqChunk(seq_id, ready[seq_id].seq.num_tokens - 2 + step, [FROM_DEVICE],
                               ready[seq_id].cache.block_table, True) for seq_id in ids]
            out = self._run(chunks, states, tokens)
            tokens, states = out.logits.argmax(dim=-1), out.hidden
            columns.append((ids, tokens))
        return proposals_by_sequence(columns)

    def _run(self, chunks: list[SeqChunk], hidden: torch.Tensor,
             device_tokens: torch.Tensor | None = None) -> HiddenStep:
        """One pass of the MTP layer. Invariant: `chunks` are in StepBatch's row order (single-token ones first),
        so `hidden`, the rows' input hidden states in chunk order, are in row order too."""
        self._step_id += 1
        plan = StepPlan(self._step_id, PlanKind.RUN, chunks, tokens_from_device=device_tokens is not None)
        return self.runner.execute_hidden(plan, hidden, device_tokens)

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        self.hiddens.pop(seq.seq_id, None)

    def reset(self) -> None:
        super().reset()
        self.hiddens.clear()
