"""The chunked gated delta rule and the chunked causal convolution give, for any length and from any state, what
their one-token steps give token by token (the definition), float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardserve.kernels.causal_conv1d import causal_conv1d, causal_conv1d_step
from shardserve.kernels.gated_delta_rule import chunked_gated_delta_rule, gated_delta_rule_step

KEY_HEADS, VALUE_HEADS, DK, DV = 2, 4, 8, 6


def _inputs(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(tokens, KEY_HEADS, DK, generator=g), dim=-1)
    k = F.normalize(torch.randn(tokens, KEY_HEADS, DK, generator=g), dim=-1)
    v = torch.randn(tokens, VALUE_HEADS, DV, generator=g)
    decay = -torch.rand(tokens, VALUE_HEADS, generator=g) * 2
    beta = torch.rand(tokens, VALUE_HEADS, generator=g)
    state = torch.randn(VALUE_HEADS, DK, DV, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("tokens", [1, 5, 63, 64, 65, 130])
def test_chunked_rule_equals_token_steps(tokens):
    q, k, v, decay, beta, state = _inputs(tokens)
    out, final = chunked_gated_delta_rule(q, k, v, decay, beta, 0.3, state)
    s, steps = state.unsqueeze(0), []
    for t in range(tokens):
        o, s = gated_delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1], 0.3, s)
        steps.append(o)
    torch.testing.assert_close(out, torch.cat(steps), atol=1e-5, rtol=0)
    torch.testing.assert_close(final, s[0], atol=1e-5, rtol=0)
    assert out.dtype == final.dtype == torch.float32


def test_value_heads_read_their_groups_key_head():
    """Value heads 2 and 3 belong to key head 1: changing key head 0 leaves their outputs alone."""
    q, k, v, decay, beta, state = _inputs(70)
    out, _ = chunked_gated_delta_rule(q, k, v, decay, beta, 0.3, state)
    k2 = k.clone()
    k2[:, 0] = F.normalize(torch.randn(70, DK), dim=-1)
    out2, _ = chunked_gated_delta_rule(q, k2, v, decay, beta, 0.3, state)
    assert torch.equal(out[:, 2:], out2[:, 2:]) and not torch.allclose(out[:, :2], out2[:, :2])


@pytest.mark.parametrize("tokens", [1, 2, 9])
def test_chunked_conv_equals_token_steps(tokens):
    g = torch.Generator().manual_seed(1)
    x, weight, state = (torch.randn(*shape, generator=g) for shape in ((tokens, 5), (5, 4), (5, 3)))
    y, final = causal_conv1d(x, weight, state)
    s, steps = state.unsqueeze(0), []
    for t in range(tokens):
        o, s = causal_conv1d_step(x[t:t + 1], weight, s)
        steps.append(o)
    torch.testing.assert_close(y, torch.cat(steps), atol=1e-6, rtol=0)
    torch.testing.assert_close(final, s[0], atol=0, rtol=0)
