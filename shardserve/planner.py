"""Memory arithmetic before loading anything: does a model fit at a tensor-parallel size and context?

Works from a Hugging Face config.json alone. Per rank: weight bytes after sharding (blocks the
engine replicates, such as attention whose heads do not split, count whole on every rank), KV cache
bytes per token (only full-attention layers grow with context; linear-attention and SSM layers keep a
fixed state per sequence), an estimate of activations, CUDA graphs and workspaces, and what is left
for the KV cache; plus host memory needed while loading.

Families: dense decoders (Llama, Qwen2/3, Mistral...), mixture-of-experts MLPs (num_experts /
num_local_experts / n_routed_experts with moe_intermediate_size, shared experts, dense layers via
mlp_only_layers or first_k_dense_replace; experts are split like dense MLPs, intermediate / tp), and
hybrids listing `layer_types` ("full_attention" vs "linear_attention" as Gated DeltaNet, or "mamba"); NemotronH's
Mamba-2, attention, MLP and mixture-of-experts blocks in planner_nemotron_h.py; DeepSeek's latent attention and
its latent cache (replicated on every rank) in planner_mla.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from shardserve import planner_mla as mla
from shardserve import planner_nemotron_h as nemotron_h
from shardserve.config import (architecture_of, attention_head_dim, expert_intermediate_size,
                               has_attention_output_gate, has_qk_norm, has_qkv_bias, hybrid_layer_types,
                               is_gated_deltanet_hybrid, routed_experts, shared_expert_size, sparse_layers)
from shardserve.layers.sharding import attention_shard, delta_net_shard, split_rows
from shardserve.models.registry import text_model_config

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1}
# Fixed per-rank costs on a GPU: CUDA context, cuBLAS/NCCL workspaces and buffers, allocator slack.
GPU_FIXED_OVERHEAD = int(1.0 * GIB)
# And per rank of a tensor-parallel group of GPUs: NCCL's communicator buffers, the peer-memory areas of the
# all-reduce and the token broadcast. On two H100s, one engine configuration (8 GiB of KV cache, 64 sequences)
# used 18.08-18.11 GiB a rank at TP=2 against 17.13 planned without this, where the same at TP=1 used 24.77
# against 24.69 planned.
GPU_COLLECTIVE_OVERHEAD = int(0.9 * GIB)
CPU_FIXED_OVERHEAD = int(0.5 * GIB)  # per CPU rank: the torch runtime and its thread pools
HOST_FLOOR_GB_DEFAULT = 6.0
# A sampling step's temporaries beyond the float32 logits, per logit (benchmarks/sampler_memory.py): for the rows
# drawn together (sampler.DRAW_CHUNK_ROWS at most), the drawn rows' copy, scaled logits, a top-p row's sorted
# values and int64 order, probabilities, running mass, mask and noise (36 to 37 bytes measured); for every row,
# a processed copy (penalties, logit bias, grammars) and the logprobs' copy and log-softmax.
SAMPLER_BYTES_PER_LOGIT = 40
SAMPLER_ALL_ROWS_BYTES_PER_LOGIT = 12


def sampling_bytes(rows: int, vocab: int) -> int:
    """A sampling step of `rows` sequences at its peak, beyond their float32 logits."""
    from shardserve.engine.sampler import DRAW_CHUNK_ROWS

    return vocab * (rows * SAMPLER_ALL_ROWS_BYTES_PER_LOGIT + min(rows, DRAW_CHUNK_ROWS) * SAMPLER_BYTES_PER_LOGIT)


@dataclass
class PlanRequest:
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    gpu_memory_gb: float | None = None  # per device
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    host_memory_gb: float | None = None
    host_floor_gb: float = HOST_FLOOR_GB_DEFAULT
    ranks_per_host: int | None = None  # default: all ranks on one host
    device: str = "cuda"  # "cpu": every rank in host memory, float32, no CUDA graphs
    kv_cache_memory_gb: float | None = None  # per rank; on CPUs the engine's default when None
    quantization: str | None = None  # "fp8": --quantization fp8 (a float checkpoint quantized at load)
    mamba_ssm_cache_dtype: str = "auto"  # --mamba-ssm-cache-dtype: Mamba-2 SSM states' dtype ("auto": float32)
    pipeline_parallel_size: int = 1  # stages of consecutive layers, each on tensor_parallel_size ranks
    pipeline_stage: int | None = None  # with stages: plan this stage's ranks (default: the stage that limits the others)


@dataclass
class Plan:
    weight_bytes: int  # per rank
    kv_bytes_per_token: int  # per rank, full-attention layers
    state_bytes_per_seq: int  # per rank, fixed-size layer state (linear attention / SSM)
    overhead_bytes: int  # per rank: activations, CUDA graphs, workspaces, fixed runtime cost
    max_model_len: int
    kv_bytes_for_context: int  # one sequence of max_model_len tokens
    usable_bytes: int | None  # per device: gpu_memory_gb * utilization
    kv_budget_bytes: int | None
    max_tokens_in_cache: int | None
    largest_context: int | None  # the largest max_model_len whose KV (and state) fits, capped by the model
    fits: bool | None
    host_needed_bytes: int
    host_left_bytes: int | None
    warnings: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    replicated: list[str] = field(default_factory=list)
    device: str = "cuda"
    active_weight_bytes: int = 0  # per rank, what one token reads (a mixture of experts: its chosen experts); 0: dense
    latent_cache: bool = False  # the KV cache is DeepSeek's latent cache, whole on every rank
    # With pipeline stages, one entry a stage: its layers, weights and KV cache per rank (PipelineStage's split);
    # the figures above are then of one stage (pipeline_stage, else the one whose KV cache holds the fewest tokens).
    stages: list[dict] = field(default_factory=list)
    # --speculative-config's draft model, on rank 0 (plan_draft): its weights and KV cache, out of rank 0's budget.
    draft_weight_bytes: int = 0
    draft_kv_bytes_per_token: int = 0
    draft_cache_tokens: int | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def load_hf_config(model: str) -> dict:
    """The Hugging Face config of a model directory, a config.json file, or a GGUF file's metadata."""
    if model.endswith(".gguf"):
        from shardserve.weights.gguf_loader import read_gguf_config

        return read_gguf_config(model)
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    with open(path) as f:
        cfg = json.load(f)
    return text_model_config(cfg)  # an image-text checkpoint's: its text model's


# -- the model's shapes --------------------------------------------------------------------------
def _dtype_bytes(cfg: dict) -> int:
    return DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), 2)


def layer_kinds(cfg: dict) -> list[str]:
    """'attention', 'linear_attention' or 'mamba' for each layer."""
    n = cfg["num_hidden_layers"]
    hybrid = is_gated_deltanet_hybrid(cfg)
    types = hybrid_layer_types(cfg) if hybrid else cfg.get("layer_types") or cfg.get("layers_block_type")
    if not types:
        return ["attention"] * n
    kinds = []
    for t in types[:n]:
        t = str(t).lower()
        kinds.append("attention" if t in ("full_attention", "attention", "sliding_attention")
                     else "mamba" if "mamba" in t else "linear_attention")
    return kinds


def _moe(cfg: dict) -> tuple[int, int, int]:
    """(experts, expert intermediate size, shared-expert intermediate size); experts 0 for dense."""
    experts = routed_experts(cfg)
    if not experts:
        return 0, 0, 0
    return experts, expert_intermediate_size(cfg), shared_expert_size(cfg)


def _moe_layers(cfg: dict) -> tuple[int, ...]:
    """The sparse layers (none for a dense model), by ModelConfig's rule."""
    return sparse_layers(cfg) if _moe(cfg)[0] else ()


def _rows(size: int, tp: int, name: str, replicated: list[str]) -> int:
    if not size:  # no such block (the dense MLP of a model whose every layer is sparse)
        return 0
    (start, end), sharded = split_rows(size, 0, tp, name)
    if tp > 1 and not sharded:
        replicated.append(name)
    return end - start


def _linear_attention_shapes(cfg: dict) -> tuple[int, int, int, int, int]:
    """Gated DeltaNet: (key heads, key dim, value heads, value dim, conv kernel)."""
    return (cfg.get("linear_num_key_heads", 16), cfg.get("linear_key_head_dim", 128),
            cfg.get("linear_num_value_heads", 32), cfg.get("linear_value_head_dim", 128),
            cfg.get("linear_conv_kernel_dim", 4))


def _shared_expert_rows(cfg: dict, tp: int, replicated: list[str]) -> int:
    """A shared expert's features one rank holds: split as the routed experts are, whole on every rank where they
    are not or its own size does not split (layers/moe.py); 0 without one."""
    _, inter, shared = _moe(cfg)
    if not shared:
        return 0
    if tp > 1 and not split_rows(inter, 0, tp, "experts")[1]:
        replicated.append("shared expert")
        return shared
    return _rows(shared, tp, "shared expert", replicated)


def _delta_net_heads(cfg: dict, tp: int, replicated: list[str]) -> tuple[int, int]:
    """(key heads, value heads) of a Gated DeltaNet layer one rank holds: all where they do not split."""
    kh, kd, vh, vd, _ = _linear_attention_shapes(cfg)
    shard = delta_net_shard(kh, vh, kd, vd, 0, tp)
    if tp > 1 and not shard.sharded:
        replicated.append("linear attention")
    return shard.num_key, shard.num_value


def _mamba_shapes(cfg: dict) -> tuple[int, int, int, int]:
    """(inner width, state size, conv kernel, dt rank)."""
    inner = cfg.get("mamba_expand", 2) * cfg["hidden_size"]
    d_state = cfg.get("mamba_d_state", 16)
    dt_rank = cfg.get("mamba_dt_rank") or -(-cfg["hidden_size"] // 16)
    return inner, d_state, cfg.get("mamba_d_conv", 4), dt_rank


def weight_elements_per_rank(cfg: dict, tp: int, replicated: list[str], active: bool = False) -> int:
    """Parameters one rank holds, sharded the way the engine shards them; `active`: those one token reads (of a
    mixture of experts' layers, the router and the num_experts_per_tok chosen experts)."""
    if nemotron_h.is_nemotron_h(cfg):
        return nemotron_h.weight_elements_per_rank(cfg, tp, replicated, active)
    first, last = end_elements_per_rank(cfg, tp)
    return sum(layer_elements_per_rank(cfg, tp, replicated, active)) + first + last


def end_elements_per_rank(cfg: dict, tp: int) -> tuple[int, int]:
    """(The embedding's, the final norm's and LM head's) parameters on one rank: the first and the last pipeline
    stage's beside their layers (an LM head tied to the embedding counted once, with the embedding)."""
    h = cfg["hidden_size"]
    vocab_rows = -(-cfg["vocab_size"] // tp)  # vocabulary-parallel
    return vocab_rows * h, h + (0 if cfg.get("tie_word_embeddings", False) else vocab_rows * h)


def layer_elements_per_rank(cfg: dict, tp: int, replicated: list[str], active: bool = False) -> list[int]:
    """Each decoder layer's parameters on one rank, as weight_elements_per_rank counts them."""
    if nemotron_h.is_nemotron_h(cfg):
        return nemotron_h.layer_elements_per_rank(cfg, tp, replicated, active)
    h = cfg["hidden_size"]
    hd = attention_head_dim(cfg)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    shard = attention_shard(heads, kv_heads, hd, 0, tp)
    if tp > 1 and not shard.sharded:
        replicated.append("attention")
    attn = h * (shard.num_q + 2 * shard.num_kv) * hd + shard.num_q * hd * h
    if has_qkv_bias(cfg):
        attn += (shard.num_q + 2 * shard.num_kv) * hd
    if has_qk_norm(cfg):
        attn += 2 * hd  # q_norm and k_norm
    if has_attention_output_gate(cfg):
        attn += h * shard.num_q * hd  # q_proj's output gate beside each query head
    if mla.is_latent_attention(cfg):
        attn = mla.attention_elements_per_rank(cfg, tp, replicated)
    dense_inter = _rows(cfg.get("intermediate_size") or 0, tp, "mlp", replicated)
    experts, moe_inter, shared_inter = _moe(cfg)
    sparse = _moe_layers(cfg)
    per_layer = []
    for i, kind in enumerate(layer_kinds(cfg)):
        total = 2 * h  # the two norms
        if kind == "attention":
            total += attn
        elif kind == "linear_attention":
            kh, kd, vh, vd, conv = _linear_attention_shapes(cfg)
            local_k, local_v = _delta_net_heads(cfg, tp, replicated)
            k_rows, v_rows = local_k * kd, local_v * vd
            total += h * (2 * k_rows + 2 * v_rows + 2 * local_v) + (2 * k_rows + v_rows) * conv + v_rows * h \
                + 2 * local_v + vd  # A_log, dt_bias and the output norm
        else:
            inner, d_state, conv, dt_rank = _mamba_shapes(cfg)
            inner //= tp
            total += h * 2 * inner + inner * conv + inner * (dt_rank + 2 * d_state) + dt_rank * inner \
                + inner * d_state + inner + inner * h
        if i in sparse:
            per_expert = 3 * h * _rows(moe_inter, tp, "experts", replicated)
            used = cfg.get("num_experts_per_tok", experts) if active else experts
            total += used * per_expert + h * experts  # experts and the router
            if mla.is_latent_attention(cfg):
                total += mla.router_elements(cfg)
            if shared_inter:
                gate = 0 if mla.is_latent_attention(cfg) else h  # DeepSeek's shared experts have no gate
                total += 3 * h * _shared_expert_rows(cfg, tp, replicated) + gate
        else:
            total += 3 * h * dense_inter
        per_layer.append(total)
    return per_layer


def kv_bytes_per_token(cfg: dict, tp: int, kv_bytes: int) -> int:
    if nemotron_h.is_nemotron_h(cfg):
        return nemotron_h.kv_bytes_per_token(cfg, tp, kv_bytes)
    if mla.is_latent_attention(cfg):
        return mla.kv_bytes_per_token(cfg, kv_bytes)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    shard = attention_shard(heads, kv_heads, attention_head_dim(cfg), 0, tp)
    full = sum(1 for k in layer_kinds(cfg) if k == "attention")
    return 2 * full * shard.num_kv * attention_head_dim(cfg) * kv_bytes


def state_bytes_per_seq(cfg: dict, tp: int, state_bytes: int) -> int:
    """Fixed per-sequence state of linear-attention and SSM layers (recurrent state plus conv window)."""
    if nemotron_h.is_nemotron_h(cfg):
        return nemotron_h.state_bytes_per_seq(cfg, tp, state_bytes, state_bytes)
    total = 0
    for kind in layer_kinds(cfg):
        if kind == "linear_attention":
            kh, kd, vh, vd, conv = _linear_attention_shapes(cfg)
            local_k, local_v = _delta_net_heads(cfg, tp, [])
            total += local_v * kd * vd + (2 * local_k * kd + local_v * vd) * (conv - 1)
        elif kind == "mamba":
            inner, d_state, conv, _ = _mamba_shapes(cfg)
            total += (inner // tp) * (d_state + conv - 1)
    return total * state_bytes


# -- the plan ------------------------------------------------------------------------------------
def _context(cfg: dict, req: PlanRequest, kv_dtype: int, dtype: int) -> tuple[int, int, int, int]:
    """(KV bytes per token, fixed state bytes per sequence, the model's context limit, the planned context), the
    model computing in `dtype` (bytes)."""
    tp = req.tensor_parallel_size
    model_limit = cfg.get("max_position_embeddings") or 2**31
    return (kv_bytes_per_token(cfg, tp, kv_dtype), _state_bytes(cfg, req, dtype), model_limit,
            req.max_model_len or model_limit)


def _state_bytes(cfg: dict, req: PlanRequest, dtype: int) -> int:
    """A sequence's fixed state: Gated DeltaNet's kept in float32; NemotronH's Mamba-2 convolution inputs in the
    compute dtype and its SSM states in --mamba-ssm-cache-dtype (float32 for auto)."""
    tp = req.tensor_parallel_size
    if nemotron_h.is_nemotron_h(cfg):
        ssm = 4 if req.mamba_ssm_cache_dtype == "auto" else DTYPE_BYTES[req.mamba_ssm_cache_dtype]
        return nemotron_h.state_bytes_per_seq(cfg, tp, dtype, ssm)
    return state_bytes_per_seq(cfg, tp, 4)


def _step_bytes(cfg: dict, req: PlanRequest, dtype: int) -> int:
    """The activations of a full step in `dtype`, and on the rank that samples (counted on each, as the plan is
    one rank's): the float32 logits of its sequences over the whole vocabulary with the sampler's temporaries at
    their peak, and the penalties' token counts when every sequence has a penalty (engine/sampler.py's
    TokenCounts)."""
    from shardserve.engine.sampler import TokenCounts

    tp = req.tensor_parallel_size
    activations = req.max_num_batched_tokens * (6 * cfg["hidden_size"] + 3 * (
        _moe(cfg)[1] or cfg["intermediate_size"]) // tp) * dtype
    rows = max(req.max_num_seqs, 1)
    logits = rows * cfg["vocab_size"] * 4 + sampling_bytes(rows, cfg["vocab_size"])
    return activations + logits + TokenCounts.peak_bytes(req.max_num_seqs, cfg["vocab_size"])


def _collective_bytes(cfg: dict, req: PlanRequest, dtype: int) -> int:
    """A GPU rank's collective buffers at TP > 1: GPU_COLLECTIVE_OVERHEAD (measured with the peer-memory
    all-reduce's smallest slots), plus what its larger slots add where the model sends larger messages
    (distributed/all_reduce.py's peer_slot_bytes: the decode graphs' largest, up to a cap)."""
    from shardserve.distributed.all_reduce import SYMM_MAX_BYTES, IpcOneShotAllReduce, peer_slot_bytes
    from shardserve.engine.cuda_graphs import all_reduce_token_counts

    tp = req.tensor_parallel_size
    if tp == 1:
        return 0
    per_token = cfg["hidden_size"] * dtype
    tokens = all_reduce_token_counts(req.max_num_seqs, req.max_num_batched_tokens)
    slot = peer_slot_bytes((t * per_token for t in tokens), per_token)
    area = IpcOneShotAllReduce.area_bytes
    return GPU_COLLECTIVE_OVERHEAD + area(slot, tp) - area(SYMM_MAX_BYTES, tp)


def _replicated_warning(replicated: list[str], tp: int) -> list[str]:
    if not replicated:
        return []
    return [f"replicated on every rank (they do not split {tp} ways): {', '.join(sorted(set(replicated)))}"]


def _latent_cache_note(cfg: dict, tp: int) -> list[str]:
    """The plan's note that a latent cache does not shrink with tensor parallelism (none for other caches)."""
    return [f"{mla.REPLICATED_NOTE}: its {cfg['kv_lora_rank'] + cfg['qk_rope_head_dim']} elements a token a layer "
            f"count whole on each of the {tp} ranks"] if mla.is_latent_attention(cfg) else []


def projection_elements_per_rank(cfg: dict, tp: int) -> int:
    """Weights of the attention and dense MLP projections one rank holds: what a quantized checkpoint (or
    --quantization fp8) keeps packed on GPUs. Experts, routers, norms, embeddings and the head stay in the compute
    dtype."""
    if nemotron_h.is_nemotron_h(cfg):
        return nemotron_h.packed_elements_per_rank(cfg, tp)[0]
    h, hd = cfg["hidden_size"], attention_head_dim(cfg)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    shard = attention_shard(heads, kv_heads, hd, 0, tp)
    attn = h * (shard.num_q + 2 * shard.num_kv) * hd + shard.num_q * hd * h
    dense = 3 * h * _rows(cfg.get("intermediate_size") or 0, tp, "mlp", [])
    shared = 3 * h * _shared_expert_rows(cfg, tp, [])
    sparse = _moe_layers(cfg)
    total = 0
    for i, kind in enumerate(layer_kinds(cfg)):
        if kind == "attention":
            total += attn
        total += shared if i in sparse else dense
    return total


def largest_projection_elements_per_rank(cfg: dict, tp: int) -> int:
    """The largest attention or dense MLP projection one rank holds (gate and up together): the size of the
    dequantized copy a packed layer makes for a batch, which the CUDA graphs' memory pool keeps."""
    h, hd = cfg["hidden_size"], attention_head_dim(cfg)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    shard = attention_shard(heads, kv_heads, hd, 0, tp)
    rows = max(_rows(cfg.get("intermediate_size") or 0, tp, "mlp", []),
               _shared_expert_rows(cfg, tp, []))
    return max(h * (shard.num_q + 2 * shard.num_kv) * hd, 2 * h * rows, packed_head_elements_per_rank(cfg, tp))


def packed_head_elements_per_rank(cfg: dict, tp: int) -> int:
    """The LM head's weights one rank keeps packed: those of a checkpoint that quantizes its untied head (GPTQ's
    `lm_head: true`, a compressed-tensors FP8 config that does not ignore it: QuantScheme.lm_head) whose hidden
    size is whole scale groups; 0 otherwise (the head in the compute dtype)."""
    from shardserve.weight_format import parse_quantization

    scheme = parse_quantization(cfg)
    if scheme is None or not scheme.lm_head:
        return 0
    group = scheme.group_columns
    if group and cfg["hidden_size"] % group:
        return 0
    return -(-cfg["vocab_size"] // tp) * cfg["hidden_size"]


def packed_expert_elements_per_rank(cfg: dict, tp: int) -> int:
    """Expert weights one rank keeps packed (layers/moe_packed.py): those of a quantized checkpoint whose rank slice
    holds whole scale groups (w13's hidden size, w2's share of the expert features), not in act order; 0 for float
    checkpoints. Experts split by features (expert parallelism holds whole experts: at least as packable)."""
    from shardserve.weight_format import parse_quantization

    scheme = parse_quantization(cfg)
    experts, inter, _ = _moe(cfg)
    if scheme is None or not experts or scheme.act_order:
        return 0
    group = scheme.group_columns
    h, rows = cfg["hidden_size"], _rows(inter, tp, "experts", [])
    if group and (h % group or rows % group):
        return 0
    if nemotron_h.is_nemotron_h(cfg):
        return nemotron_h.packed_elements_per_rank(cfg, tp)[1]
    return experts * 3 * h * rows * len(_moe_layers(cfg))


def packed_row_scale_bytes(cfg: dict, tp: int) -> int:
    """The float32 scale a packed row holds beside its group scales in the fp4 layout (NVFP4, MXFP4): a down
    expert's rows are the hidden size on every rank, so at TP 4 they come to about 1% of NemotronH's packed bytes;
    exact for NemotronH, its packed weights' own rows, and for other families counted as rows of the hidden size's
    width. 0 for other layouts."""
    from shardserve.weight_format import parse_quantization

    scheme = parse_quantization(cfg)
    if scheme is None or not scheme.e2m1:
        return 0
    if nemotron_h.is_nemotron_h(cfg):
        return 4 * nemotron_h.packed_elements_per_rank(cfg, tp)[2]
    elements = projection_elements_per_rank(cfg, tp) + packed_expert_elements_per_rank(cfg, tp) \
        + packed_head_elements_per_rank(cfg, tp)
    return 4 * elements // cfg["hidden_size"]


def _packed_bytes_per_weight(cfg: dict, online: str | None) -> tuple[float, str] | None:
    """Bytes a packed projection weight takes on GPUs (scales included), and the format's name; None for float
    weights. An unsupported quantization raises, as start-up would."""
    from shardserve.weight_format import parse_quantization

    scheme = parse_quantization(cfg)
    if online == "fp8" and scheme is None:
        return 1 + 4 / cfg["hidden_size"], "fp8 at load (a scale a row)"
    if scheme is None:
        return None
    if scheme.method == "fp8":
        return (1 + 4 / scheme.weight_block[1] if scheme.weight_block else 1.0), scheme.describe()
    group = scheme.group_size if scheme.group_size > 0 else cfg["hidden_size"]
    if scheme.e2m1:  # an e4m3 byte a group (the float32 scale a row: negligible)
        return 0.5 + 1 / group, scheme.describe()
    return 0.5 + 4 / group, scheme.describe()  # a 32-bit scale-and-zero word a group


def _quantization_warning(cfg: dict, req: PlanRequest) -> list[str]:
    packed = _packed_bytes_per_weight(cfg, req.quantization)
    if packed is None:
        return []
    if req.device == "cpu":
        return [f"the checkpoint's layers are quantized ({packed[1]}): on CPUs they are held dequantized, counted "
                f"here in float32"]
    tp = req.tensor_parallel_size
    experts = req.quantization != "fp8" and packed_expert_elements_per_rank(cfg, tp) > 0
    head = req.quantization != "fp8" and packed_head_elements_per_rank(cfg, tp) > 0
    quantized = _listed(["quantized projections", *(["experts"] if experts else []),
                         *(["the LM head"] if head else [])])
    kept = _listed([*([] if experts else ["experts"]), "embeddings", *([] if head else ["the head"])])
    return [f"{quantized} ({packed[1]}): counted at {packed[0]:.3g} bytes a weight; {kept} at {_dtype_bytes(cfg)}"]


def _context_named(req: PlanRequest, max_len: int) -> str:
    """The context a plan is for, as its reasons name it (the model's whole context when none was asked for)."""
    if req.max_model_len is None:
        return f"a sequence of the model's whole context, {max_len:,} tokens (--max-model-len not given),"
    return f"a sequence of --max-model-len {max_len:,} tokens"


def _overhead_named(overhead: int, states: int, req: PlanRequest) -> str:
    """A GPU rank's overhead, as its reasons name it: what it grows with."""
    state = f", with the fixed state of {req.max_num_seqs} sequences" if states else ""
    return (f"overhead ({(overhead + states) / GIB:.2f} GiB at --max-num-seqs {req.max_num_seqs} and "
            f"--max-num-batched-tokens {req.max_num_batched_tokens}{state})")


def _listed(parts: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def plan(cfg: dict, req: PlanRequest) -> Plan:
    if req.pipeline_parallel_size > 1:
        return _plan_stages(cfg, req)
    quantization = _quantization_warning(cfg, req)
    if req.device == "cpu":
        cpu = _plan_cpu(cfg, req)
        cpu.warnings[:0] = quantization
        return cpu
    tp = req.tensor_parallel_size
    dtype = _dtype_bytes(cfg)
    kv_dtype = _kv_dtype_bytes(req, dtype)
    replicated: list[str] = []
    weights = weight_elements_per_rank(cfg, tp, replicated) * dtype
    packed = _packed_bytes_per_weight(cfg, req.quantization)
    if packed is not None:
        weights -= int(projection_elements_per_rank(cfg, tp) * (dtype - packed[0]))
        if req.quantization != "fp8":  # --quantization fp8 leaves experts and the head in the compute dtype
            weights -= int((packed_expert_elements_per_rank(cfg, tp) + packed_head_elements_per_rank(cfg, tp))
                           * (dtype - packed[0]))
        weights += packed_row_scale_bytes(cfg, tp)
    per_token, per_seq_state, model_limit, max_len = _context(cfg, req, kv_dtype, dtype)
    h, inter = cfg["hidden_size"], cfg.get("intermediate_size") or _moe(cfg)[1]
    graphs = req.max_num_seqs * (8 * h + 3 * inter // tp) * dtype
    overhead = _step_bytes(cfg, req, dtype) + graphs + GPU_FIXED_OVERHEAD + _collective_bytes(cfg, req, dtype)
    if packed is not None:
        overhead += largest_projection_elements_per_rank(cfg, tp) * dtype
    states = req.max_num_seqs * per_seq_state
    usable = budget = cache_tokens = largest = None
    fits = None
    reasons: list[str] = []
    if req.gpu_memory_gb is not None:
        usable = int(req.gpu_memory_gb * GIB * req.gpu_memory_utilization)
        budget = usable - weights - overhead - states
        cache_tokens = max(0, budget // per_token) if per_token else (2**62 if budget >= 0 else 0)
        largest = int(min(cache_tokens, model_limit))
        fits = budget >= 0 and cache_tokens >= max_len
        if budget < 0:
            reasons.append(f"weights ({weights / GIB:.2f} GiB) and {_overhead_named(overhead, states, req)} "
                           f"exceed the usable {usable / GIB:.2f} GiB per device "
                           f"({req.gpu_memory_gb:g} GiB x {req.gpu_memory_utilization:g}), leaving nothing for the "
                           f"KV cache")
        elif not fits:
            reasons.append(f"{_context_named(req, max_len)} needs {per_token * max_len / GIB:.2f} GiB of KV cache "
                           f"per rank, but {budget / GIB:.2f} GiB ({cache_tokens:,} tokens) is left for it: the usable "
                           f"{usable / GIB:.2f} GiB per device less the weights ({weights / GIB:.2f} GiB) and "
                           f"{_overhead_named(overhead, states, req)}")
    ranks_here = req.ranks_per_host or tp * req.pipeline_parallel_size
    largest_tensor = max(cfg["vocab_size"] * h, 3 * h * inter) * dtype  # read whole before slicing
    host_needed = ranks_here * (largest_tensor + int(1.5 * GIB))  # per rank: one tensor in flight + runtime
    host_left = None
    warnings = []
    if req.host_memory_gb is not None:
        host_left = int(req.host_memory_gb * GIB) - host_needed
        if host_left < req.host_floor_gb * GIB:
            warnings.append(f"host memory left while loading would be {host_left / GIB:.1f} GiB, under the floor of "
                            f"{req.host_floor_gb:g} GiB: the host may swap or stall; start fewer ranks per host")
    warnings += quantization + _replicated_warning(replicated, tp) + _latent_cache_note(cfg, tp)
    active = weight_elements_per_rank(cfg, tp, [], active=True) * dtype if _moe(cfg)[0] else 0
    return Plan(weights, per_token, per_seq_state, overhead, max_len, per_token * max_len, usable, budget,
                cache_tokens, largest, fits, host_needed, host_left, warnings, reasons, sorted(set(replicated)),
                active_weight_bytes=active, latent_cache=mla.is_latent_attention(cfg))


def draft_cache_blocks(budget: int, outside: int, target_per_token: int, draft_per_token: int, block_size: int,
                       max_blocks: int) -> int:
    """Blocks of a draft model's KV cache out of rank 0's KV budget (engine/draft_model.py): what its weights and
    working memory (`outside`, 0 where they do not come out of the budget) leave is split so that the draft's cache
    and the target's hold as many tokens, the draft's at most `max_blocks` (max_num_seqs full contexts)."""
    left = max(0, budget - outside)
    return min(left // ((target_per_token + draft_per_token) * block_size), max_blocks)


def plan_draft(target: Plan, draft_cfg: dict, req: PlanRequest, block_size: int = 16,
               weight_bytes_added: int = 0) -> Plan:
    """`target` with a draft model on rank 0 (--speculative-config's draft_model, or the MTP layer as
    mtp_layer_config describes it): one rank in the target's dtype, its weights (plus `weight_bytes_added`) and
    working memory out of rank 0's KV budget on GPUs (on CPUs, host memory beside the --kv-cache-memory budget), then
    the budget split between the two caches as the engine splits it (draft_cache_blocks); the other ranks take
    rank 0's block count, so these are every rank's tokens."""
    if target.stages:
        raise ValueError("a draft model with pipeline stages is not served; plan it with -tp alone")
    draft_cfg = dict(draft_cfg, torch_dtype="float32" if req.device == "cpu" else
                     draft_cfg.get("torch_dtype") or "bfloat16")
    draft = plan(draft_cfg, dataclasses.replace(req, tensor_parallel_size=1, max_model_len=target.max_model_len))
    weights = draft.weight_bytes + weight_bytes_added
    outside = 0 if req.device == "cpu" else weights + draft.overhead_bytes - GPU_FIXED_OVERHEAD
    max_blocks = req.max_num_seqs * -(-target.max_model_len // block_size)
    found = {"draft_weight_bytes": weights, "draft_kv_bytes_per_token": draft.kv_bytes_per_token}
    if target.kv_budget_bytes is None:  # GPUs of unknown memory
        return dataclasses.replace(target, **found)
    states = req.max_num_seqs * target.state_bytes_per_seq
    budget = target.kv_budget_bytes - (states if req.device == "cpu" else 0)
    blocks = draft_cache_blocks(budget, outside, target.kv_bytes_per_token, draft.kv_bytes_per_token, block_size,
                                max_blocks)
    draft_cache = blocks * block_size * draft.kv_bytes_per_token
    tokens = max(0, (budget - outside - draft_cache) // target.kv_bytes_per_token)
    reasons = list(target.reasons)
    fits = target.fits
    if blocks * block_size < target.max_model_len:
        fits = False
        reasons.append(f"the draft model takes {(outside + draft_cache) / GIB:.2f} GiB of rank 0's KV-cache budget of "
                       f"{budget / GIB:.2f} GiB, and what is left holds {blocks * block_size:,} tokens each of its "
                       f"cache and the target's, under {target.max_model_len:,}")
    host = target.host_needed_bytes + (weights if req.device == "cpu" else 0)
    host_left = None if target.host_left_bytes is None else target.host_left_bytes - (host - target.host_needed_bytes)
    return dataclasses.replace(target, **found, draft_cache_tokens=blocks * block_size, max_tokens_in_cache=tokens,
                               largest_context=min(target.largest_context or tokens, tokens), fits=fits,
                               reasons=reasons, host_needed_bytes=host, host_left_bytes=host_left)


def plan_mtp(target: Plan, cfg: dict, req: PlanRequest) -> Plan:
    """`target` with its checkpoint's MTP layer on rank 0 (--speculative-config's mtp, engine/mtp.py): planned as a
    draft of one decoder layer of the target's last kind (a latent cache of one layer) with its own embedding and LM
    head, and eh_proj and three norms besides."""
    if not cfg.get("num_nextn_predict_layers"):
        raise ValueError("--speculative-config method mtp: this config has no MTP layer (num_nextn_predict_layers)")
    layers, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    sparse = bool(_moe(cfg)[0]) and layers - 1 >= cfg.get("first_k_dense_replace", 0)
    layer_cfg = dict(cfg, num_hidden_layers=1, first_k_dense_replace=0 if sparse else 1, tie_word_embeddings=False)
    dtype = 4 if req.device == "cpu" else _dtype_bytes(cfg)
    own = (2 * h * h + 3 * h) * dtype  # eh_proj, enorm, hnorm and shared_head.norm
    return plan_draft(target, layer_cfg, req, weight_bytes_added=own)


# A stage holding this many times another's weights is flagged: the pipeline runs at its slowest stage's pace.
STAGE_IMBALANCE = 1.5


def _plan_stages(cfg: dict, req: PlanRequest) -> Plan:
    """Pipeline stages: the whole model's plan at this tensor-parallel size, each stage's weights and KV cache per
    token scaled to the layers it holds (split by bytes as the engine splits them), its context re-derived."""
    from shardserve.config import refuse_stages_without_attention, split_layers

    if nemotron_h.is_nemotron_h(cfg):
        attention, linear = nemotron_h.attention_and_state_layers(cfg)
    else:
        kinds = layer_kinds(cfg)
        if not set(kinds) <= {"attention", "linear_attention"}:
            raise ValueError("pipeline stages serve models of attention layers (Llama, Qwen2/3, Mistral, "
                             "DeepSeek-V3/V2 and their mixtures of experts) and the hybrids Qwen3-Next, Qwen3.5 and "
                             "NemotronH; plan this model with -tp alone")
        attention = [i for i, kind in enumerate(kinds) if kind == "attention"]
        linear = [i for i, kind in enumerate(kinds) if kind == "linear_attention"]
    pp, tp = req.pipeline_parallel_size, req.tensor_parallel_size
    # Every rank of every stage on one host unless ranks_per_host says otherwise (host memory counts them all).
    whole = plan(cfg, dataclasses.replace(req, pipeline_parallel_size=1, pipeline_stage=None,
                                          ranks_per_host=req.ranks_per_host or tp * pp))
    per_layer = layer_elements_per_rank(cfg, tp, [])
    first, last = end_elements_per_rank(cfg, tp)
    total = sum(per_layer) + first + last
    # What one token reads of each layer (a mixture of experts: its chosen experts), for each stage's share of it.
    active_layers = layer_elements_per_rank(cfg, tp, [], active=True) if whole.active_weight_bytes else per_layer
    active_total = sum(active_layers) + first + last
    blocks = split_layers(per_layer, pp)
    refuse_stages_without_attention(blocks, attention, architecture_of(cfg))
    plans = []
    for s, block in enumerate(blocks):
        held_attention = sum(i in block for i in attention)
        ends = (first if s == 0 else 0) + (last if s == pp - 1 else 0)  # the embedding's and the head's elements
        elements = sum(per_layer[i] for i in block) + ends
        # A hybrid's stage keeps the KV cache of its attention layers and the states of its Gated DeltaNet or
        # Mamba-2 layers.
        states = whole.state_bytes_per_seq * sum(i in block for i in linear) // len(linear) if linear else 0
        staged = _restaged(whole, whole.weight_bytes * elements // total,
                           whole.kv_bytes_per_token * held_attention // len(attention), req,
                           cfg.get("max_position_embeddings") or 2**31, states)
        active = sum(active_layers[i] for i in block) + ends
        plans.append(dataclasses.replace(staged, active_weight_bytes=whole.active_weight_bytes * active
                                         // active_total))
    stages = [dict(stage=s, layers=[b.start, b.stop - 1], weight_bytes=p.weight_bytes,
                   kv_bytes_per_token=p.kv_bytes_per_token, state_bytes_per_seq=p.state_bytes_per_seq,
                   max_tokens_in_cache=p.max_tokens_in_cache, fits=p.fits)
              for s, (b, p) in enumerate(zip(blocks, plans))]
    if req.pipeline_stage is not None:
        chosen = plans[req.pipeline_stage]
    else:
        chosen = min(plans, key=lambda p: (p.max_tokens_in_cache if p.max_tokens_in_cache is not None else 0,
                                           -p.weight_bytes))
    weights = [p.weight_bytes for p in plans]
    warnings = list(chosen.warnings)
    if min(weights) and max(weights) > STAGE_IMBALANCE * min(weights):
        warnings.append(f"stage {weights.index(max(weights))} holds {max(weights) / min(weights):.1f}x the weights "
                        f"of stage {weights.index(min(weights))}: the pipeline runs at its slowest stage's pace")
    fits = None if any(p.fits is None for p in plans) else all(p.fits for p in plans)
    reasons = [f"stage {s}: {r}" for s, p in enumerate(plans) for r in p.reasons]
    return dataclasses.replace(chosen, stages=stages, warnings=warnings, fits=fits, reasons=reasons)


def _restaged(whole: Plan, weights: int, per_token: int, req: PlanRequest, model_limit: int,
              state_per_seq: int) -> Plan:
    """`whole` (one stage) for a stage of `weights` bytes, `per_token` KV bytes a token and `state_per_seq` bytes of
    layer state a sequence per rank: its KV budget (on GPUs, what its weights and states leave), tokens in cache,
    largest context and fit, derived as plan() derives them."""
    max_len, states = whole.max_model_len, req.max_num_seqs * state_per_seq
    if whole.usable_bytes is not None:
        budget = whole.usable_bytes - weights - whole.overhead_bytes - states
        cache_tokens = max(0, budget // per_token)
    elif whole.kv_budget_bytes is not None:  # CPUs: --kv-cache-memory a rank, whatever the weights
        budget = whole.kv_budget_bytes
        cache_tokens = max(0, (budget - states) // per_token)
    else:  # GPUs of unknown memory
        return dataclasses.replace(whole, weight_bytes=weights, kv_bytes_per_token=per_token,
                                   kv_bytes_for_context=per_token * max_len, state_bytes_per_seq=state_per_seq)
    reasons = []
    if budget < 0 or cache_tokens < max_len:
        reasons.append(f"{max_len:,} tokens need {per_token * max_len / GIB:.2f} GiB of KV cache per rank, but "
                       f"{max(budget, 0) / GIB:.2f} GiB ({cache_tokens:,} tokens) is left for it")
    host = [r for r in whole.reasons if "host memory" in r]
    fits = False if reasons or host else (None if whole.fits is None and whole.usable_bytes is None else True)
    return dataclasses.replace(whole, weight_bytes=weights, kv_bytes_per_token=per_token,
                               kv_bytes_for_context=per_token * max_len, kv_budget_bytes=budget,
                               state_bytes_per_seq=state_per_seq,
                               max_tokens_in_cache=cache_tokens, largest_context=int(min(cache_tokens, model_limit)),
                               fits=fits, reasons=reasons + host)


def _kv_dtype_bytes(req: PlanRequest, compute_bytes: int) -> int:
    """Bytes of one cached key or value element: the compute dtype's under --kv-cache-dtype auto (FP8: 1, so
    twice the tokens per GiB of bfloat16)."""
    return compute_bytes if req.kv_cache_dtype == "auto" else DTYPE_BYTES[req.kv_cache_dtype]


def _plan_cpu(cfg: dict, req: PlanRequest) -> Plan:
    """CPU ranks: weights in float32 (what the engine computes in on CPUs under --dtype auto), plus a 16-bit
    compact copy for decode steps where the checkpoint is 16-bit; a KV cache of --kv-cache-memory per rank;
    no CUDA graphs. Everything lives in host memory, shared by the ranks on the host: it fits when their sum
    leaves the host floor and the KV cache holds a full context."""
    from shardserve.engine.kv_cache import DEFAULT_CPU_KV_CACHE_GB

    tp = req.tensor_parallel_size
    replicated: list[str] = []
    elements = weight_elements_per_rank(cfg, tp, replicated)
    if cfg.get("tie_word_embeddings"):  # the LM head gets its own packed float32 copy of the embedding
        elements += -(-cfg["vocab_size"] // tp) * cfg["hidden_size"]
    # The compact copy for decode steps: GGUF blocks (about 5 bits a weight for Q4_1) or the 16-bit checkpoint.
    compact = 0.625 if cfg.get("gguf_quantized") else (_dtype_bytes(cfg) if _dtype_bytes(cfg) < 4 else 0)
    weights = int(elements * (4 + compact))
    per_token, per_seq_state, model_limit, max_len = _context(cfg, req, _kv_dtype_bytes(req, 4), 4)
    overhead = _step_bytes(cfg, req, 4) + CPU_FIXED_OVERHEAD
    states = req.max_num_seqs * per_seq_state
    kv_budget = int((req.kv_cache_memory_gb if req.kv_cache_memory_gb is not None else DEFAULT_CPU_KV_CACHE_GB) * GIB)
    cache_tokens = max(0, (kv_budget - states) // per_token) if per_token else 2**62
    largest = int(min(cache_tokens, model_limit))
    ranks_here = req.ranks_per_host or tp * req.pipeline_parallel_size
    host_needed = ranks_here * (weights + overhead + kv_budget)
    host_left = None
    fits = None
    reasons: list[str] = []
    if cache_tokens < max_len:
        state = f" (less {states / GIB:.2f} GiB for the fixed state of {req.max_num_seqs} sequences)" if states else ""
        reasons.append(f"{_context_named(req, max_len)} needs {per_token * max_len / GIB:.2f} GiB of KV cache per "
                       f"rank, but --kv-cache-memory gives {kv_budget / GIB:.2f} GiB{state}: {cache_tokens:,} tokens")
    if req.host_memory_gb is not None:
        host_left = int(req.host_memory_gb * GIB) - host_needed
        if host_left < req.host_floor_gb * GIB:
            reasons.append(f"{ranks_here} ranks need {host_needed / GIB:.2f} GiB of host memory (each: weights "
                           f"{weights / GIB:.2f} GiB, overhead {overhead / GIB:.2f} GiB, KV cache {kv_budget / GIB:.2f} "
                           f"GiB), which leaves {host_left / GIB:.1f} GiB of {req.host_memory_gb:.1f}, under the floor "
                           f"of {req.host_floor_gb:g} GiB (--host-floor-gb): lower --kv-cache-memory, or start fewer "
                           f"ranks on this host")
        fits = not reasons
    elif reasons:
        fits = False
    return Plan(weights, per_token, per_seq_state, overhead, max_len, per_token * max_len, None, kv_budget,
                cache_tokens, largest, fits, host_needed, host_left,
                _replicated_warning(replicated, tp) + _latent_cache_note(cfg, tp), reasons,
                sorted(set(replicated)),
                device="cpu", latent_cache=mla.is_latent_attention(cfg))


def describe(p: Plan, tp: int) -> str:
    gib = lambda b: f"{b / GIB:,.2f} GiB"  # noqa: E731
    stages = [f"pipeline stage {s['stage']}: layers {s['layers'][0]}-{s['layers'][1]}, weights "
              f"{gib(s['weight_bytes'])} a rank, KV cache {s['kv_bytes_per_token'] / 1024:,.1f} KiB a token"
              + (f" = {s['max_tokens_in_cache']:,} tokens" if s['max_tokens_in_cache'] is not None else "")
              + (f", state {s['state_bytes_per_seq'] / 2**20:,.1f} MiB a sequence" if s.get('state_bytes_per_seq')
                 else "")
              for s in p.stages]
    if stages:
        stages.append("the stage whose KV cache holds the fewest tokens:")
    lines = [
        f"per rank (tensor parallel {tp}):",
        f"  weights                {gib(p.weight_bytes)}",
        *([f"  read per token         {gib(p.active_weight_bytes)} (the router and the chosen experts of "
           f"each expert layer)"] if p.active_weight_bytes else []),
        f"  KV cache per token     {p.kv_bytes_per_token / 1024:,.1f} KiB (full-attention layers"
        f"{'; the latent cache, replicated on every rank' if p.latent_cache else ''})",
        f"  KV for one context     {gib(p.kv_bytes_for_context)} at {p.max_model_len:,} tokens",
    ]
    if p.state_bytes_per_seq:
        lines.append(f"  fixed state per seq    {p.state_bytes_per_seq / 2**20:,.1f} MiB (linear-attention/SSM layers)")
    if p.draft_weight_bytes:
        lines.append(f"  draft model (rank 0)   weights {gib(p.draft_weight_bytes)}, KV cache "
                     f"{p.draft_kv_bytes_per_token / 1024:,.1f} KiB a token"
                     + ("" if p.draft_cache_tokens is None else f" = {p.draft_cache_tokens:,} tokens")
                     + (", out of rank 0's KV-cache budget" if p.device != "cpu" else ""))
    if p.device == "cpu":
        lines[0] = f"per rank (tensor parallel {tp}, CPU: float32, in host memory):"
        lines.append(f"  overhead (estimate)    {gib(p.overhead_bytes)} (activations, runtime)")
        lines.append(f"  KV cache               {gib(p.kv_budget_bytes)} (--kv-cache-memory) = {p.max_tokens_in_cache:,} "
                     f"tokens")
        lines.append(f"host memory for all ranks on this host: {gib(p.host_needed_bytes)}"
                     + ("" if p.host_left_bytes is None else f", {gib(p.host_left_bytes)} left"))
    else:
        lines.append(f"  overhead (estimate)    {gib(p.overhead_bytes)} (activations, CUDA graphs, workspaces)")
    if p.usable_bytes is not None:
        lines += [f"  usable per device      {gib(p.usable_bytes)}",
                  f"  left for the KV cache  {gib(max(p.kv_budget_bytes, 0))} = {p.max_tokens_in_cache:,} tokens",
                  f"  largest context        {p.largest_context:,} tokens"]
    if p.device != "cpu":
        lines.append(f"host memory while loading: {gib(p.host_needed_bytes)}"
                     + ("" if p.host_left_bytes is None else f", {gib(p.host_left_bytes)} left"))
    lines[:0] = stages
    lines += [f"warning: {w}" for w in p.warnings]
    if p.fits is None:
        lines.append("fits: unknown (give --host-memory-gb)" if p.device == "cpu" else
                     "fits: unknown (give --gpu-memory-gb, or run where the GPUs are, or --device cpu)")
    elif p.fits:
        lines.append(f"fits: yes, {p.max_tokens_in_cache // max(p.max_model_len, 1):,} full-length sequences at once")
    else:
        lines += [f"fits: NO: {r}" for r in p.reasons]
        if 0 < p.largest_context < p.max_model_len:  # the context is what does not fit, and a shorter one would
            lines.append(f"the largest --max-model-len that fits: {p.largest_context:,}")
    return "\n".join(lines)
