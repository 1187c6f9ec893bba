"""What the layer tests of the per-sequence-state token mixers (Gated DeltaNet, Mamba-2) share: both are
layers/state_mixer.StateMixer, whose state is a pair (convolution inputs, recurrent state), and both are checked
against transformers' module run through its cache."""

from __future__ import annotations

import torch
from torch import nn


def run_transformers(ref: nn.Module, cfg, chunks: list[torch.Tensor]):
    """transformers' outputs for consecutive chunks of one sequence (each [T, hidden]) through its cache, and its
    final (conv state, recurrent state)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        outs = [ref(c.unsqueeze(0), cache=cache)[0] for c in chunks]
    return outs, cache.get_conv_state(0)[0], cache.get_recurrent_state(0)[0]


def prefill_in_chunks(layer: nn.Module, x: torch.Tensor, sizes: list[int]):
    """The outputs of x prefilled in chunks of `sizes`, each from the state the last left, and the final state."""
    state, outs = None, []
    with torch.no_grad():
        for chunk in x.split(sizes):
            out, state = layer.prefill(chunk, state)
            outs.append(out)
    return torch.cat(outs), state


def check_decode_continues_prompt(layer: nn.Module, x: torch.Tensor, prompt: int, expected, atol: float):
    """x[:prompt] prefilled, then one decode step a token to the end of x, each output equal to expected[i]
    (the prompt's, then each step's); returns the final state (without a batch dim)."""
    with torch.no_grad():
        out, state = layer.prefill(x[:prompt])
        torch.testing.assert_close(out, expected[0], atol=atol, rtol=0)
        states = type(state)(*(t.unsqueeze(0) for t in state))
        for step in range(x.shape[0] - prompt):
            out, states = layer.decode(x[prompt + step:prompt + step + 1], states)
            torch.testing.assert_close(out, expected[1 + step], atol=atol, rtol=0, msg=f"decode step {step}")
    return type(states)(*(t[0] for t in states))


def check_sequences_stepped_together(layer: nn.Module, ref: nn.Module, cfg, lengths: list[int], steps: int,
                                     tokens, atol: float) -> None:
    """Prompts of `lengths` tokens in one step over a pool of six states (slots 4, 0, 2), then `steps` decode steps
    of all of them together (one token each, with and without their row starts): each sequence's outputs are
    transformers' for it alone, and the pool's other slots (1, 3, 5, their recurrent states marked) untouched.
    tokens(n, seed): the inputs of a sequence of n tokens."""
    slots = torch.tensor([4, 0, 2])
    seqs = [tokens(n + steps, seed=10 + i) for i, n in enumerate(lengths)]
    expected = [run_transformers(ref, cfg, [s[:n], *s[n:].split(1)])[0] for s, n in zip(seqs, lengths)]
    pool = layer.zero_state(batch=6)
    pool[1][[1, 3, 5]] = 7.0  # other sequences' recurrent states
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    with torch.no_grad():
        out = layer(torch.cat([s[:n] for s, n in zip(seqs, lengths)]), pool, slots, starts)
        for i in range(len(lengths)):
            torch.testing.assert_close(out[starts[i]:starts[i + 1]], expected[i][0], atol=atol, rtol=0)
        for step in range(steps):
            x = torch.stack([s[n + step] for s, n in zip(seqs, lengths)])
            out = layer(x, pool, slots, None if step % 2 else list(range(len(lengths) + 1)))
            for i in range(len(lengths)):
                torch.testing.assert_close(out[i:i + 1], expected[i][1 + step], atol=atol, rtol=0,
                                           msg=f"sequence {i}, decode step {step}")
    assert bool((pool[1][[1, 3, 5]] == 7.0).all()) and not pool[0][[1, 3, 5]].any()


def check_decode_step_kernels_agree(layer: nn.Module, hidden: int, reference_kernels, kernels, slots_count: int,
                                    device) -> None:
    """The layer's decode step (query_start None) of two tokens of `hidden` features in pool slots 3 and 1, random
    weights and random states, on `kernels` gives the output and states it gives on `reference_kernels` (the
    torch ones)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    layer.to(device)
    state = layer.zero_state(slots_count, device)
    state = type(state)(*(torch.randn(t.shape, generator=g).to(t) for t in state))
    x, slots = torch.randn(2, hidden, generator=g).to(device), torch.tensor([3, 1], device=device)
    results = []
    for chosen in (reference_kernels, kernels):
        layer.kernels = chosen
        pool = type(state)(*(t.clone() for t in state))
        with torch.no_grad():
            results.append((layer(x, pool, slots, None), *pool))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

