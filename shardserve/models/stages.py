"""What a model built in pipeline stages (config.PipelineStage) keeps at its ends: the embedding where a stage needs
it, the LM head on the last stage, and the checkpoint's tensors the other stages hold, passed over when this stage loads. Shared by the families whose
layers are built in stages (LlamaForCausalLM and those built as it is, NemotronH)."""

from __future__ import annotations

import torch

from shardserve.config import ModelConfig, PipelineStage
from shardserve.distributed.communicator import Communicator
from shardserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding


def stage_embedding(cfg: ModelConfig, comm: Communicator, dtype: torch.dtype,
                    stage: PipelineStage) -> VocabParallelEmbedding | None:
    """The token embedding on the first stage, and on the last where the head is tied to it; None elsewhere."""
    if stage.is_first or (stage.is_last and cfg.tie_word_embeddings):
        return VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, comm)
    return None


def last_stage_head(cfg: ModelConfig, comm: Communicator, dtype: torch.dtype, stage: PipelineStage,
                    embedding: VocabParallelEmbedding | None) -> ParallelLMHead | None:
    """The LM head on the last stage (None on the others). A tied head is the stage's embedding; an untied one
    takes its vocabulary rows from an embedding of the same shape where this stage keeps none."""
    if not stage.is_last:
        return None
    if embedding is None:
        embedding = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, comm)
    return ParallelLMHead(embedding, cfg.tie_word_embeddings)


def other_stages_prefixes(cfg: ModelConfig, stage: PipelineStage, embedding_prefix: str | None,
                          final_norm_prefix: str) -> tuple[str, ...]:
    """The checkpoint names (after its renames) of what other stages hold: their layers, the embedding
    (`embedding_prefix`, None where this stage keeps it) and, before the last stage, the final norm and the head."""
    if stage.count == 1:
        return ()
    return tuple(f"model.layers.{i}." for i in range(cfg.num_layers) if not stage.holds(i)) + (
        (embedding_prefix,) if embedding_prefix is not None else ()) + (
        () if stage.is_last else (final_norm_prefix, "lm_head."))
