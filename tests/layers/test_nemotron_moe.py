"""NemotronH's mixture-of-experts block gives transformers' NemotronHMoE outputs (float32, random weights, a nonzero
score-correction bias), with and without LatentMoE's latent projections: whole on one rank, and the shares of 2 and 3
tensor-parallel ranks (experts split by features) or of 2 expert-parallel ranks (whole experts) summed. The grouped
top-k router chooses transformers' experts with its weights. A wrong slice on one rank fails the comparison."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardserve.config import ModelConfig
from shardserve.layers.grouped_topk import GroupedTopK, grouped_top_k
from shardserve.models.nemotron_h import NemotronHForCausalLM, NemotronHMoE
from shardserve.weights.loader import load_tensors
from tests.helpers.partial_sums import PartialSums

ATOL = 1e-5
# 8 experts of 48 features in 4 groups (the best 2 kept), top 3, a shared expert of 32 features: the experts split
# in 2 and 3, the shared expert in 2 (whole at 3, added by rank 0 alone).
SIZES = dict(hidden_size=64, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
             moe_shared_expert_intermediate_size=32, n_group=4, topk_group=2, routed_scaling_factor=2.5)


def _reference(latent: int | None, norm_topk_prob: bool = True, seed: int = 0):
    """(transformers' NemotronHMoE with random float32 weights and correction bias, our ModelConfig of it)."""
    from transformers import AutoConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE as Reference

    hf = AutoConfig.for_model("nemotron_h", layers_block_type=["moe", "full_attention"], num_attention_heads=2,
                              num_key_value_heads=1, head_dim=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
                              moe_latent_size=latent, norm_topk_prob=norm_topk_prob, **SIZES)
    torch.manual_seed(seed)
    ref = Reference(hf, 0).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.normal_(0, 0.3 if name.startswith("gate") else 0.15)
        ref.gate.e_score_correction_bias.normal_(0, 0.3)
    cfg = ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": ["NemotronHForCausalLM"]})
    return ref, cfg


def _ours(ref: nn.Module, cfg: ModelConfig, rank: int = 0, tp: int = 1, expert_parallel: bool = False,
          corrupt: str | None = None) -> NemotronHMoE:
    """Our block for rank `rank` of `tp`, loaded from ref's tensors under their names (its experts stacked:
    experts.up_proj [E, I, D], the per-expert names are the engine tests'); `corrupt`: every other value of a
    parameter of rank 1's block off by 0.5 after loading."""
    block = NemotronHMoE(cfg, PartialSums(rank, tp), torch.float32, expert_parallel)
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([nn.Module()])
    root.model.layers[0].mixer = block
    root.checkpoint_name = NemotronHForCausalLM.checkpoint_name  # the experts' names into w1 and w2
    tensors = [(f"model.layers.0.mixer.{n}", t) for n, t in ref.state_dict().items()]
    load_tensors(root, tensors, False, "the reference block")
    if corrupt is not None and rank == 1:
        block.get_parameter(corrupt).data.view(-1)[::2] += 0.5  # every other value: a shift that changes choices
    return block


def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, SIZES["hidden_size"], generator=torch.Generator().manual_seed(seed))


def _summed_ranks(ref, cfg, tp: int, x: torch.Tensor, expert_parallel: bool = False,
                  corrupt: str | None = None) -> tuple[torch.Tensor, list[NemotronHMoE]]:
    blocks = [_ours(ref, cfg, rank, tp, expert_parallel, corrupt) for rank in range(tp)]
    with torch.no_grad():
        return sum(block(x) for block in blocks), blocks


@pytest.mark.parametrize("latent", [None, 32])
def test_one_rank_equals_transformers(latent):
    ref, cfg = _reference(latent)
    x = _tokens(37)
    with torch.no_grad():
        want = ref(x.unsqueeze(0))[0]
        got = _ours(ref, cfg)(x)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("latent", [None, 32])
@pytest.mark.parametrize("tp, expert_parallel", [(2, False), (3, False), (2, True)])
def test_the_ranks_shares_sum_to_transformers(latent, tp, expert_parallel):
    """Split by features (24 or 16 of each expert's 48 a rank) or, under expert parallelism, 4 whole experts a rank;
    the latent projections whole on every rank."""
    ref, cfg = _reference(latent)
    x = _tokens(37)
    with torch.no_grad():
        want = ref(x.unsqueeze(0))[0]
    got, blocks = _summed_ranks(ref, cfg, tp, x, expert_parallel)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    shards = [b.experts.shard for b in blocks]
    assert all(s.sharded for s in shards)
    if expert_parallel:
        assert [s.experts for s in shards] == [(0, 4), (4, 8)] and all(s.rows == (0, 48) for s in shards)
    else:
        assert [s.rows for s in shards] == [(r * 48 // tp, (r + 1) * 48 // tp) for r in range(tp)]
    assert [b.adds_shared_expert for b in blocks] == ([True, True] if tp == 2 else [True, False, False])


@pytest.mark.parametrize("corrupt", ["experts.w1", "experts.w2", "fc1_latent_proj.weight", "fc2_latent_proj.weight",
                                     "shared_experts.up_proj.weight", "gate.e_score_correction_bias"])
def test_a_wrong_slice_on_one_rank_fails_the_comparison(corrupt):
    """The check above can fail: rank 1 of 2 with its slice of the experts (up or down), its copy of a latent
    projection or of the router's correction bias, or its share of the shared expert, partly off by 0.5."""
    ref, cfg = _reference(32)
    x = _tokens(37)
    with torch.no_grad():
        want = ref(x.unsqueeze(0))[0]
    got, _ = _summed_ranks(ref, cfg, 2, x, corrupt=corrupt)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_the_router_chooses_transformers_experts_with_its_weights(norm_topk_prob):
    """The same experts for each token (in any order) with the same weights: the unbiased sigmoid scores,
    renormalised or not, times routed_scaling_factor; the correction bias changes which experts, never how much."""
    ref, cfg = _reference(None, norm_topk_prob)
    x = _tokens(200)
    with torch.no_grad():
        _, want_weights, want_ids = ref.gate(x)
    route = GroupedTopK(8, 3, 4, 2, norm_topk_prob, 2.5)
    logits = x @ ref.gate.weight.t()
    weights, ids = grouped_top_k(logits, ref.gate.e_score_correction_bias, route)
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), atol=1e-6, rtol=0)
    assert not torch.equal(grouped_top_k(logits, None, route)[1], ids), "the bias never changed a choice"


@pytest.mark.parametrize("route, problem", [
    (dict(num_experts=8, top_k=2, num_groups=3), "do not split"),
    (dict(num_experts=8, top_k=2, num_groups=8, topk_groups=2), "two best"),
    (dict(num_experts=8, top_k=2, num_groups=2, topk_groups=3), "topk_group=3"),
    (dict(num_experts=8, top_k=5, num_groups=2, topk_groups=1), "num_experts_per_tok=5"),
])
def test_routing_that_cannot_choose_is_refused(route, problem):
    with pytest.raises(ValueError, match=problem):
        GroupedTopK(**route)
