"""The Gated DeltaNet layer gives transformers' outputs and states (Qwen3-Next's and Qwen3.5's layers, float32,
random weights): a prompt whole or in chunks, decode steps after it, many sequences stepped together, and the
shares of 2 or 3 tensor-parallel ranks summed (or, where heads do not split, each rank's whole output)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardserve.layers.gated_deltanet import DeltaNetDims, DeltaNetState, GatedDeltaNet
from shardserve.weights.loader import load_tensors
from tests.helpers.partial_sums import PartialSums
from tests.helpers.state_mixers import (check_decode_continues_prompt, check_sequences_stepped_together,
                                         prefill_in_chunks, run_transformers)

HIDDEN = 32
ATOL = 1e-5


def _reference(family: str, key_heads: int = 3, value_heads: int = 6, seed: int = 0):
    """(transformers' layer with random float32 weights, its config) for `family` ("qwen3_next" or "qwen3_5")."""
    from transformers import AutoConfig

    sizes = dict(hidden_size=HIDDEN, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    if family == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet as Layer
        cfg = AutoConfig.for_model("qwen3_next", **sizes)
    else:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet as Layer
        cfg = AutoConfig.for_model("qwen3_5_moe_text", **sizes)
    assert cfg.layer_types[0] == "linear_attention"
    torch.manual_seed(seed)
    ref = Layer(cfg, 0).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            # Outputs of a few units, so that float32 rounding stays well under ATOL.
            p.normal_(0, 0.05 if name.startswith("out_proj") else 0.3 if "proj" in name or "conv" in name else 1.0)
    return ref, cfg


def _ours(ref: nn.Module, cfg, rank: int = 0, tp: int = 1, comm=None, dtype=torch.float32) -> GatedDeltaNet:
    """Our layer for rank `rank` of `tp` (or of `comm`'s group), loaded from ref's tensors under their checkpoint
    names by the weight loader (each rank takes its slice)."""
    comm = PartialSums(rank, tp) if comm is None else comm
    layer = GatedDeltaNet(DeltaNetDims.from_hf_dict(cfg.to_dict()), comm, dtype)
    root = nn.Module()  # named as in a model, so that checkpoint names resolve as they will there
    root.packed_modules = GatedDeltaNet.packed_modules
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([nn.Module()])
    root.model.layers[0].linear_attn = layer
    tensors = [(f"model.layers.0.linear_attn.{n}", t) for n, t in ref.state_dict().items()]
    load_tensors(root, tensors, False, "the reference layer")
    return layer


def _assert_state_matches(state: DeltaNetState, conv_ref: torch.Tensor, rec_ref: torch.Tensor) -> None:
    # transformers keeps the last K inputs, we the last K - 1: the oldest one no output needs again.
    torch.testing.assert_close(state.conv, conv_ref[:, 1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(state.recurrent, rec_ref, atol=ATOL, rtol=0)


def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


FAMILIES = ["qwen3_next", "qwen3_5"]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_matches_transformers(family):
    """A prompt of 150 tokens (two full chunks of 64 and a part): the output and the state after it."""
    ref, cfg = _reference(family)
    x = _tokens(150)
    (expected,), conv_ref, rec_ref = run_transformers(ref, cfg, [x])
    with torch.no_grad():
        out, state = _ours(ref, cfg).prefill(x)
    assert expected.abs().max() > 1 and expected.abs().mean() > 0.1  # a real signal to compare
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    _assert_state_matches(state, conv_ref, rec_ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_in_chunks_equals_whole_prompt(family):
    """The same prompt in chunks of 37, 64 and 49 tokens, each from the state the last left: the whole prompt's
    outputs (transformers') and the same final state."""
    ref, cfg = _reference(family)
    x = _tokens(150)
    (expected,), conv_ref, rec_ref = run_transformers(ref, cfg, [x])
    out, state = prefill_in_chunks(_ours(ref, cfg), x, [37, 64, 49])
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    _assert_state_matches(state, conv_ref, rec_ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_continue_the_prompt(family):
    """A prompt of 70 tokens, then 5 single-token decode steps from its state: transformers' outputs for each."""
    ref, cfg = _reference(family)
    x = _tokens(75)
    expected, conv_ref, rec_ref = run_transformers(ref, cfg, [x[:70], *x[70:].split(1)])
    state = check_decode_continues_prompt(_ours(ref, cfg), x, 70, expected, ATOL)
    _assert_state_matches(state, conv_ref, rec_ref)


def test_bfloat16_prompt_and_steps_equal_transformers():
    """In bfloat16 (the recurrent state still float32) the same ops round the same way: transformers' outputs
    exactly, the conv state in bfloat16, the recurrent state in float32."""
    ref, cfg = _reference("qwen3_next")
    ref = ref.to(torch.bfloat16)
    x = _tokens(72).to(torch.bfloat16)
    expected, conv_ref, rec_ref = run_transformers(ref, cfg, [x[:70], *x[70:].split(1)])
    layer = _ours(ref, cfg, dtype=torch.bfloat16)
    out, state = _prompt_then_steps(layer, x)
    assert out.dtype == state.conv.dtype == torch.bfloat16 and state.recurrent.dtype == torch.float32
    assert torch.equal(out, torch.cat(expected))
    assert torch.equal(state.conv, conv_ref[:, 1:])
    torch.testing.assert_close(state.recurrent, rec_ref, atol=ATOL, rtol=0)


def test_sequences_stepped_together_equal_each_alone():
    """Prompts of 70, 5 and 1 tokens in one step over a pool of states, then 4 decode steps of all three
    together: each sequence's outputs are transformers' for it alone; the pool's other slots are untouched."""
    ref, cfg = _reference("qwen3_next")
    check_sequences_stepped_together(_ours(ref, cfg), ref, cfg, [70, 5, 1], 4, _tokens, ATOL)


def _prompt_then_steps(layer: GatedDeltaNet, x: torch.Tensor) -> tuple[torch.Tensor, DeltaNetState]:
    """Outputs of a 70-token prompt, then of single-token steps (the decode kernels) to the end of x; the final
    state."""
    with torch.no_grad():
        out, state = layer.prefill(x[:70])
        outs = [out]
        for t in range(70, x.shape[0]):
            out, state = layer.prefill(x[t:t + 1], state)
            outs.append(out)
    return torch.cat(outs), state


def _run_ranks(ref, cfg, tp: int, x: torch.Tensor, corrupt=None):
    """Per rank of `tp`: (_prompt_then_steps' outputs and state, the layer's shard).
    corrupt(rank, layer) may change a rank's weights after loading."""
    results = []
    for rank in range(tp):
        layer = _ours(ref, cfg, rank, tp)
        if corrupt is not None:
            corrupt(rank, layer)
        out, state = _prompt_then_steps(layer, x)
        results.append((out, state, layer.shard))
    return results


def _check_ranks_match_whole(ref, cfg, tp: int, x: torch.Tensor, corrupt=None) -> bool:
    """The ranks' outputs summed (sharded) or each rank's own (replicated) equal one rank's; their states are
    the whole layer's split by value heads. Returns whether the layer was sharded."""
    (whole, whole_state, _), = _run_ranks(ref, cfg, 1, x)
    ranks = _run_ranks(ref, cfg, tp, x, corrupt)
    sharded = ranks[0][2].sharded
    if sharded:
        torch.testing.assert_close(sum(out for out, _, _ in ranks), whole, atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.cat([s.recurrent for _, s, _ in ranks]), whole_state.recurrent,
                                   atol=ATOL, rtol=0)
        # The ranks' value heads tile the layer's in order, each rank with its key heads' groups.
        heads = [s.value_heads for _, _, s in ranks]
        assert heads[0][0] == 0 and heads[-1][1] == cfg.linear_num_value_heads
        assert all(a[1] == b[0] for a, b in zip(heads, heads[1:]))
    else:
        for rank, (out, state, _) in enumerate(ranks):
            torch.testing.assert_close(out, whole, atol=ATOL, rtol=0, msg=f"replicated rank {rank}")
            torch.testing.assert_close(state.recurrent, whole_state.recurrent, atol=ATOL, rtol=0)
    return sharded


@pytest.mark.parametrize("family,key_heads,value_heads,tp,sharded", [
    ("qwen3_next", 3, 6, 2, False),  # 3 key heads do not split in 2: every rank holds the whole layer
    ("qwen3_next", 3, 6, 3, True),
    ("qwen3_next", 4, 8, 2, True),
    ("qwen3_next", 4, 8, 3, False),
    ("qwen3_5", 3, 6, 3, True),
    ("qwen3_5", 2, 6, 2, True),
])
def test_tensor_parallel_ranks_equal_one_rank(family, key_heads, value_heads, tp, sharded):
    ref, cfg = _reference(family, key_heads, value_heads)
    assert _check_ranks_match_whole(ref, cfg, tp, _tokens(72)) == sharded


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("parameter", ["in_proj_ba", "in_proj_qkvz", "conv1d", "A_log", "dt_bias", "out_proj"])
def test_a_wrong_slice_on_one_rank_fails_the_comparison(family, parameter):
    """The check above can fail: rank 1 of 3 with one of its slices (the b and a rows of its value heads, its
    q/k/v/z rows, its convolution channels, its decay parameters, its out_proj columns) off by 0.5."""
    ref, cfg = _reference(family, 3, 6)

    def corrupt(rank, layer):
        if rank == 1:
            module = getattr(layer, parameter)
            (module.weight if hasattr(module, "weight") else module).data += 0.5

    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        _check_ranks_match_whole(ref, cfg, 3, _tokens(72), corrupt)


def test_two_ranks_of_a_real_group_each_give_the_whole_output():
    """Two processes in a gloo group: out_proj's all-reduce gives each rank one rank's output; each rank keeps
    the recurrent state of its own value heads only."""
    from tests.ranks import run_ranks

    outcome = run_ranks(_rank_of_a_group, 2, "qwen3_next", timeout=300)
    assert outcome == {0: "ok", 1: "ok"}


def _rank_of_a_group(rank: int, port: int, family: str, results) -> None:
    import torch.distributed as dist

    from shardserve.distributed.communicator import Communicator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ref, cfg = _reference(family, 4, 8)
        x = _tokens(72)
        whole, whole_state = _prompt_then_steps(_ours(ref, cfg), x)
        layer = _ours(ref, cfg, comm=Communicator(dist.group.WORLD, rank, 2))
        out, state = _prompt_then_steps(layer, x)
        assert layer.shard.sharded and layer.shard.value_heads == (4 * rank, 4 * rank + 4)
        torch.testing.assert_close(out, whole, atol=ATOL, rtol=0)
        torch.testing.assert_close(state.recurrent, whole_state.recurrent[4 * rank:4 * rank + 4], atol=ATOL, rtol=0)
        results.put((rank, "ok"))
    except Exception as e:  # noqa: BLE001 - the test reads it
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()
