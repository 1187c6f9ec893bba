"""The Mamba-2 prompt scan (kernels/mamba2_ssd.ssd_chunked) equals the recurrence it unrolls: the same outputs and
final state as ssd_step taken token by token, whatever the blocks computed at once, with a last block cut short,
several heads to a group of B and C, and a state carried in; a prompt in two calls equals it in one."""

from __future__ import annotations

import pytest
import torch

from shardserve.kernels.mamba2_ssd import ssd_chunked, ssd_step


def _inputs(tokens: int, heads: int, groups: int, head_dim: int = 8, d_state: int = 16, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(tokens, heads, head_dim, generator=g), dt=torch.rand(tokens, heads, generator=g) + 0.05,
                a=-torch.rand(heads, generator=g) * 2, b=torch.randn(tokens, groups, d_state, generator=g),
                c=torch.randn(tokens, groups, d_state, generator=g), d=torch.randn(heads, generator=g),
                state=torch.randn(heads, head_dim, d_state, generator=g))


def _recurrence(x, dt, a, b, c, d, state):
    ys = []
    for t in range(x.shape[0]):
        y, state = ssd_step(x[t:t + 1], dt[t:t + 1], a, b[t:t + 1], c[t:t + 1], d, state[None])
        ys.append(y[0])
        state = state[0]
    return torch.stack(ys), state


@pytest.mark.parametrize("tokens, heads, groups, chunk, at_once", [
    (37, 6, 2, 8, 1),    # five blocks, the last cut short, one at a time
    (37, 6, 2, 8, 2),    # two at a time: the last pass one block
    (37, 6, 3, 8, 5),    # one pass of five blocks, two heads a group
    (5, 4, 1, 16, None),  # shorter than a block; the device's default
    (64, 8, 8, 16, 4),   # a head a group, whole blocks
])
def test_the_scan_equals_the_recurrence(tokens, heads, groups, chunk, at_once):
    inputs = _inputs(tokens, heads, groups)
    want_y, want_state = _recurrence(**inputs)
    y, state = ssd_chunked(**inputs, chunk_size=chunk, chunks_at_once=at_once)
    torch.testing.assert_close(y, want_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)


def test_a_prompt_in_two_calls_equals_one():
    """Chunked prefill: the state after the first 21 tokens carried into the last 19 (a cut inside a block)."""
    inputs = _inputs(40, 6, 2, seed=3)
    whole_y, whole_state = ssd_chunked(**inputs, chunk_size=16, chunks_at_once=2)
    first = {k: (v[:21] if k in ("x", "dt", "b", "c") else v) for k, v in inputs.items()}
    y1, state = ssd_chunked(**first, chunk_size=16, chunks_at_once=2)
    rest = {k: (v[21:] if k in ("x", "dt", "b", "c") else v) for k, v in inputs.items()} | {"state": state}
    y2, last = ssd_chunked(**rest, chunk_size=16, chunks_at_once=2)
    torch.testing.assert_close(torch.cat([y1, y2]), whole_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, whole_state, rtol=1e-4, atol=1e-4)
