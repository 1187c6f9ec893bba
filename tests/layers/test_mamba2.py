"""The Mamba-2 layer gives transformers' outputs and states (NemotronH's mixer, float32, random weights): a prompt
whole or in chunks, decode steps after it, many sequences stepped together, and the shares of 2 tensor-parallel
ranks summed (or, where the B/C groups do not split, each rank's whole output)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardserve.layers.mamba2 import Mamba2Dims, Mamba2Mixer, MambaState
from shardserve.weights.loader import load_tensors
from tests.helpers.partial_sums import PartialSums
from tests.helpers.state_mixers import (check_decode_continues_prompt, check_sequences_stepped_together,
                                         prefill_in_chunks, run_transformers)

HIDDEN = 32
ATOL = 1e-5


def _reference(heads: int = 6, groups: int = 2, chunk_size: int = 16, seed: int = 0):
    """(transformers' NemotronH Mamba-2 mixer with random float32 weights, its config)."""
    from transformers import AutoConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    cfg = AutoConfig.for_model("nemotron_h", hidden_size=HIDDEN, mamba_num_heads=heads, mamba_head_dim=8,
                               ssm_state_size=16, n_groups=groups, conv_kernel=4, chunk_size=chunk_size,
                               layers_block_type=["linear_attention"], num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16)
    torch.manual_seed(seed)
    ref = NemotronHMamba2Mixer(cfg, 0).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name == "A_log":
                p.copy_(torch.log(torch.rand(p.shape) * 2 + 0.2))
            elif name == "dt_bias":
                p.normal_(-1.0, 0.5)
            else:
                p.normal_(0, 0.05 if name.startswith("out_proj") else 0.3 if "proj" in name or "conv" in name
                          else 1.0)
    return ref, cfg


def _ours(ref: nn.Module, cfg, rank: int = 0, tp: int = 1, comm=None) -> Mamba2Mixer:
    """Our layer for rank `rank` of `tp`, loaded from ref's tensors under their checkpoint names."""
    comm = PartialSums(rank, tp) if comm is None else comm
    layer = Mamba2Mixer(Mamba2Dims.from_hf_dict(cfg.to_dict()), comm, torch.float32)
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([nn.Module()])
    root.model.layers[0].mixer = layer
    tensors = [(f"model.layers.0.mixer.{n}", t) for n, t in ref.state_dict().items()]
    load_tensors(root, tensors, False, "the reference layer")
    return layer


def _assert_state_matches(state: MambaState, conv_ref: torch.Tensor, ssm_ref: torch.Tensor) -> None:
    # transformers keeps the last K inputs, we the last K - 1.
    torch.testing.assert_close(state.conv, conv_ref[:, 1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(state.ssm, ssm_ref.float(), atol=ATOL, rtol=0)


def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("groups", [1, 2])
def test_prefill_matches_transformers(groups):
    """A prompt of 40 tokens (two full SSD chunks of 16 and a part): the output and the state after it."""
    ref, cfg = _reference(groups=groups)
    x = _tokens(40)
    (expected,), conv_ref, ssm_ref = run_transformers(ref, cfg, [x])
    with torch.no_grad():
        out, state = _ours(ref, cfg).prefill(x)
    assert expected.abs().max() > 0.5 and expected.abs().mean() > 0.05  # a real signal to compare
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    _assert_state_matches(state, conv_ref, ssm_ref)


def test_prefill_in_chunks_equals_whole_prompt():
    """The same prompt in chunks of 7, 20 and 13 tokens (boundaries inside SSD chunks), each from the state the
    last left: the whole prompt's outputs and the same final state."""
    ref, cfg = _reference()
    x = _tokens(40)
    (expected,), conv_ref, ssm_ref = run_transformers(ref, cfg, [x])
    out, state = prefill_in_chunks(_ours(ref, cfg), x, [7, 20, 13])
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    _assert_state_matches(state, conv_ref, ssm_ref)


@pytest.mark.parametrize("groups", [1, 2])
def test_decode_steps_continue_the_prompt(groups):
    """A prompt of 20 tokens, then 5 single-token decode steps from its state: transformers' outputs for each."""
    ref, cfg = _reference(groups=groups)
    x = _tokens(25)
    expected, conv_ref, ssm_ref = run_transformers(ref, cfg, [x[:20], *x[20:].split(1)])
    state = check_decode_continues_prompt(_ours(ref, cfg), x, 20, expected, ATOL)
    _assert_state_matches(state, conv_ref, ssm_ref)


def test_sequences_stepped_together_equal_each_alone():
    """Prompts of 30, 5 and 1 tokens in one step over a pool of states, then 3 decode steps of all three
    together: each sequence's outputs are transformers' for it alone; the pool's other slots are untouched."""
    ref, cfg = _reference()
    check_sequences_stepped_together(_ours(ref, cfg), ref, cfg, [30, 5, 1], 3, _tokens, ATOL)


def _prompt_then_steps(layer: Mamba2Mixer, x: torch.Tensor) -> tuple[torch.Tensor, MambaState]:
    with torch.no_grad():
        out, state = layer.prefill(x[:20])
        outs = [out]
        for t in range(20, x.shape[0]):
            out, state = layer.decode(x[t:t + 1], MambaState(state.conv[None], state.ssm[None]))
            state = MambaState(state.conv[0], state.ssm[0])
            outs.append(out)
    return torch.cat(outs), state


@pytest.mark.parametrize("heads,groups,tp,sharded", [
    (6, 2, 2, True),   # one group of 3 heads per rank
    (6, 1, 2, False),  # one group: never sliced, the layer is whole on both ranks
    (5, 1, 2, False),  # an odd head count
    (8, 4, 2, True),
])
def test_tensor_parallel_ranks_equal_one_rank(heads, groups, tp, sharded):
    ref, cfg = _reference(heads=heads, groups=groups)
    x = _tokens(24)
    whole, whole_state = _prompt_then_steps(_ours(ref, cfg), x)
    ranks = [(*_prompt_then_steps(layer, x), layer.shard) for layer in (_ours(ref, cfg, r, tp) for r in range(tp))]
    assert ranks[0][2].sharded == sharded
    if sharded:
        torch.testing.assert_close(sum(out for out, _, _ in ranks), whole, atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.cat([s.ssm for _, s, _ in ranks]), whole_state.ssm, atol=ATOL, rtol=0)
        assert [s.heads for _, _, s in ranks] == [(0, heads // 2), (heads // 2, heads)]
    else:
        for out, state, _ in ranks:
            torch.testing.assert_close(out, whole, atol=ATOL, rtol=0)
            torch.testing.assert_close(state.ssm, whole_state.ssm, atol=ATOL, rtol=0)


def test_a_wrong_slice_on_one_rank_fails_the_comparison():
    """The check above can fail: rank 1 of 2 with its B rows of in_proj off by 0.5."""
    ref, cfg = _reference(heads=6, groups=2)
    x = _tokens(24)
    whole, _ = _prompt_then_steps(_ours(ref, cfg), x)
    outs = []
    for rank in range(2):
        layer = _ours(ref, cfg, rank, 2)
        if rank == 1:
            offset, _ = layer.in_proj.offsets["B"]
            layer.in_proj.weight.data[offset:offset + 16] += 0.5
        outs.append(_prompt_then_steps(layer, x)[0])
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(sum(outs), whole, atol=ATOL, rtol=0)
