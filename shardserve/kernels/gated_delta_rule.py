"""The gated delta rule in plain torch, float32: a chunked form for prompts and a one-token step for decode.

Per value head, the state S is a [k_head_dim, v_head_dim] matrix; each token t (query q, key k, value v, log
decay g <= 0, write strength beta in (0, 1)) does

    S <- exp(g) * S
    S <- S + k (beta * (v - S^T k))^T        (the delta rule: write only what S does not already predict)
    o  = S^T (scale * q)

Query and key heads are shared by groups of consecutive value heads (value head h reads key head
h // (value_heads // key_heads)). Callers pass q and k already l2-normalised; `scale` multiplies q.

The chunked form gives the same numbers as running the step over every token (to float32 rounding): within a
chunk of C tokens the writes are found together by one triangular solve (the WY / UT transform), and only the
state crosses chunk boundaries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the prefill form, as the reference implementations use


def _heads_of_values(x: torch.Tensor, value_heads: int, dim: int) -> torch.Tensor:
    """q or k with each key head repeated for the value heads of its group."""
    return x if x.shape[dim] == value_heads else x.repeat_interleave(value_heads // x.shape[dim], dim=dim)


def delta_rule_gates(ba: torch.Tensor, a_log: torch.Tensor,
                     dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log decay g = -exp(A_log) * softplus(a + dt_bias) and the write strength beta = sigmoid(b), float32
    [tokens, value_heads] each, from ba [tokens, 2 * value_heads] ([b | a] a token)."""
    b, a = ba.chunk(2, dim=-1)
    return -a_log.exp() * F.softplus(a.float() + dt_bias), b.sigmoid().float()


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim, as the reference kernels normalise q and k."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def split_heads(mixed: torch.Tensor, key_heads: int, key_dim: int, value_heads: int,
                value_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (l2-normalised, float32) [tokens, key_heads, key_dim] and v [tokens, value_heads, value_dim] of the
    convolution's output [tokens, channels] ([q | k | v] a token)."""
    q, k, v = mixed.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=-1)
    q, k = (l2_normalized(t.reshape(t.shape[0], key_heads, key_dim).float()) for t in (q, k))
    return q, k, v.reshape(v.shape[0], value_heads, value_dim)


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, scale: float, state: torch.Tensor,
                             chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of T >= 1 tokens starting from `state`.

    q, k: [T, key_heads, dk]; v: [T, value_heads, dv]; g, beta: [T, value_heads]; state: [value_heads, dk, dv].
    Returns (o [T, value_heads, dv], the state after the last token), both float32; `state` is not written.
    """
    tokens, heads = v.shape[0], v.shape[1]
    group = heads // q.shape[1]
    # Padding tokens have beta = 0 and g = 0: they write nothing and do not decay the state, so the final state is
    # the last real token's.
    pad = -tokens % chunk
    n = (tokens + pad) // chunk

    def by_chunk(x: torch.Tensor) -> torch.Tensor:
        """[T, heads, ...] -> [N, heads, C, ...] float32, contiguous: chunk after chunk, each a slice in one piece."""
        x = F.pad(x.float(), (0, 0) * (x.dim() - 1) + (0, pad))
        return x.reshape(n, chunk, *x.shape[1:]).transpose(1, 2).contiguous()

    q, k, v = by_chunk(q) * scale, by_chunk(k), by_chunk(v)  # q, k per key head, v per value head
    g, beta = by_chunk(g[..., None])[..., 0], by_chunk(beta[..., None])[..., 0]  # [N, H, C]

    def per_value_head(x: torch.Tensor) -> torch.Tensor:  # a key head's [N, key_heads, ...] for each of its group
        return x if group == 1 else x.repeat_interleave(group, dim=1)

    decay = g.cumsum(-1)  # [N, H, C]: log of the decay from the chunk's start to each token, inclusive
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    # between[..., i, j] = exp(decay_i - decay_j) for j <= i, else 0: the decay from token j's write to token i.
    between = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    # Writes u of a chunk solve (I + L) u = beta * (v - exp(decay) S0^T k), with L strictly lower:
    # L[i, j] = beta_i exp(decay_i - decay_j) k_i . k_j. Split by linearity into a part without S0 and the
    # matrix that maps S0 to its share. The products k_i . k_j and q_i . k_j are a key head's, formed once.
    system = per_value_head(k @ k.transpose(-1, -2)) * beta.unsqueeze(-1) * between
    solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # noqa: E731
    u_free = solve(v * beta.unsqueeze(-1))
    attn = per_value_head(q @ k.transpose(-1, -2)) * between  # within-chunk reads, the diagonal included
    k = per_value_head(k)
    k_reads = solve(k * (beta * decay.exp()).unsqueeze(-1))
    q_decayed = per_value_head(q) * decay.exp().unsqueeze(-1)
    k_to_end = (k * (decay[..., -1:] - decay).exp().unsqueeze(-1)).transpose(-1, -2).contiguous()
    chunk_decay = decay[..., -1].exp()[..., None, None]

    s = state.float()
    out = torch.empty_like(v)
    for c in range(n):
        u = u_free[c] - k_reads[c] @ s
        out[c] = q_decayed[c] @ s + attn[c] @ u
        s = s * chunk_decay[c] + k_to_end[c] @ u
    return out.transpose(1, 2).reshape(n * chunk, heads, -1)[:tokens].contiguous(), s


def gated_delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, scale: float,
                          state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences at once.

    q, k: [B, key_heads, dk]; v: [B, value_heads, dv]; g, beta: [B, value_heads]; state: [B, value_heads, dk, dv].
    Returns (o [B, value_heads, dv], the states after the token), both float32; `state` is not written.
    """
    heads = v.shape[1]
    q, k = (_heads_of_values(x, heads, 1).float() for x in (q, k))
    s = state.float() * g.float().exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", s, k)
    write = (v.float() - predicted) * beta.float().unsqueeze(-1)
    s = s + k.unsqueeze(-1) * write.unsqueeze(-2)
    out = torch.einsum("bhkv,bhk->bhv", s, q * scale)
    return out, s
