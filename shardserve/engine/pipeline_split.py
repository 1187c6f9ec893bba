"""Which decoder layers each pipeline stage holds: split evenly by the bytes the planner counts per layer (by count
where it cannot describe the model), the embedding on the first stage, the final norm and LM head on the last.
Every rank computes the same split from the same config, so no rank needs to be told it."""

from __future__ import annotations

import logging

from shardserve.config import EngineConfig, ModelConfig, PipelineStage, refuse_stages_without_attention, split_layers
from shardserve.distributed.process_group import RankContext
from shardserve.models import model_class

logger = logging.getLogger(__name__)

# A stage holding this many times the bytes of the lightest is worth a warning: the pipeline runs at the pace of
# its slowest stage, and the heaviest stage's memory bounds every stage's KV cache.
IMBALANCE_WARNING = 1.5


def refuse_unsupported(model_config: ModelConfig, stages: int) -> None:
    """Pipeline stages serve the models built in stages (builds_in_stages: Llama's family with dense or
    mixture-of-experts MLPs, DeepSeek's, the Gated DeltaNet hybrids Qwen3-Next and Qwen3.5, and NemotronH, each
    stage keeping the KV cache and state pools of its own layers); others are refused by name rather than
    half-served."""
    arch = model_config.architecture
    if not getattr(model_class(arch), "builds_in_stages", False):
        raise ValueError(f"--pipeline-parallel-size {stages}: {arch} cannot be served in pipeline stages (its "
                         "layers are not built in stages); serve it with --tensor-parallel-size alone")


def layer_bytes(config: EngineConfig, model_config: ModelConfig, tp: int) -> tuple[list[int], tuple[int, int]]:
    """(Each decoder layer's bytes on a rank, (the first stage's extra bytes, the last's)) in elements as the
    planner counts them (a GGUF file or a config it cannot read: 1 per layer and no ends)."""
    from shardserve.planner import end_elements_per_rank, layer_elements_per_rank, load_hf_config

    try:
        cfg = load_hf_config(config.model)
        per_layer = layer_elements_per_rank(cfg, tp, [])
        if len(per_layer) == model_config.num_layers:
            return per_layer, end_elements_per_rank(cfg, tp)
    except (OSError, KeyError, ValueError) as e:
        logger.debug("pipeline split: no per-layer sizes for %s (%s): splitting by count", config.model, e)
    return [1] * model_config.num_layers, (0, 0)


def stage_blocks(config: EngineConfig, model_config: ModelConfig) -> tuple[list[range], list[int], tuple[int, int]]:
    """(Each stage's layers, each layer's bytes, the ends' bytes) of config's -pp stages at its -tp size; ValueError
    for a model not built in stages or a stage without an attention layer."""
    stages = config.pipeline_parallel_size
    refuse_unsupported(model_config, stages)
    per_layer, ends = layer_bytes(config, model_config, config.tensor_parallel_size)
    blocks = split_layers(per_layer, stages)
    refuse_stages_without_attention(blocks, model_config.kv_layers, model_config.architecture)
    return blocks, per_layer, ends


def check_stages(config: EngineConfig) -> None:
    """Before any rank starts: the ValueError stage_blocks would raise on every rank, once (nothing without -pp)."""
    if config.pipeline_parallel_size > 1:
        stage_blocks(config, ModelConfig.from_model_path(config.model))


def stage_of(config: EngineConfig, model_config: ModelConfig, ctx: RankContext, itemsize: int) -> PipelineStage | None:
    """This rank's stage, None without pipeline stages. Rank 0 logs every stage's layers and bytes (`itemsize`:
    bytes of a weight)."""
    stages = config.pipeline_parallel_size
    if stages == 1:
        return None
    blocks, per_layer, (first, last) = stage_blocks(config, model_config)
    if ctx.is_driver:
        log_split(blocks, per_layer, first, last, ctx.tp_size, itemsize)
    mine = blocks[ctx.stage]
    return PipelineStage(ctx.stage, stages, mine.start, mine.stop)


def log_split(blocks: list[range], per_layer: list[int], first: int, last: int, tp: int, itemsize: int) -> None:
    """One line per stage (its layers and weight bytes per rank), and a warning where stages differ much."""
    totals = []
    for s, block in enumerate(blocks):
        elements = sum(per_layer[i] for i in block) + (first if s == 0 else 0) + (last if s == len(blocks) - 1
                                                                                   else 0)
        totals.append(elements)
        ends = " + embedding" * (s == 0) + " + final norm and LM head" * (s == len(blocks) - 1)
        logger.info("pipeline stage %d (ranks %d-%d): layers %d-%d%s, %.3f GiB of weights a rank", s, s * tp,
                    s * tp + tp - 1, block.start, block.stop - 1, ends, elements * itemsize / 2**30)
    if min(totals) and max(totals) > IMBALANCE_WARNING * min(totals):
        heavy, light = totals.index(max(totals)), totals.index(min(totals))
        logger.warning("pipeline stage %d holds %.1fx the weights of stage %d: the pipeline runs at its slowest "
                       "stage's pace, and the heaviest stage's memory limits every stage's KV cache", heavy,
                       max(totals) / min(totals), light)
