"""The selective state-space recurrence of a Mamba-2 layer (SSD), in plain torch and float32.

Per head h with scalar decay A_h < 0, for each token t with step dt_t > 0 (softplus(dt + dt_bias), clamped),
input x_t [head_dim] and the head's group's B_t, C_t [d_state]:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T          (S: [head_dim, d_state])
    y_t = S_t C_t + D_h x_t

`ssd_chunked` runs a prompt chunk of one sequence in blocks of `chunk_size` tokens (the quadratic form inside a
block, the state carried between blocks), `ssd_step` one token of each of B sequences. Both take the state as it
is and return the new one, writing no input; states are float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def step_sizes(dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float]) -> torch.Tensor:
    """softplus(dt + dt_bias) in float32, clamped to `limit` (time_step_limit): dt [..., heads]."""
    dt = F.softplus(dt.float() + dt_bias.float())
    low, high = limit
    if low > 0.0 or high != float("inf"):
        dt = dt.clamp(min=low, max=high)
    return dt


def _by_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., groups, n] -> [..., heads, n]: each group's vector for its heads (consecutive heads share a group)."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                d: torch.Tensor, state: torch.Tensor, chunk_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of T >= 1 tokens: x [T, heads, head_dim], dt [T, heads] (step sizes, float32), a [heads]
    (A = -exp(A_log)), b, c [T, groups, d_state], d [heads], state [heads, head_dim, d_state].
    Returns (y [T, heads, head_dim] float32, the state after the last token, float32)."""
    heads = x.shape[1]
    x, b, c = x.float(), _by_head(b.float(), heads), _by_head(c.float(), heads)
    state = state.float()
    a = a.float()
    ys = []
    for s in range(0, x.shape[0], chunk_size):
        xc, dtc, bc, cc = x[s:s + chunk_size], dt[s:s + chunk_size], b[s:s + chunk_size], c[s:s + chunk_size]
        n = xc.shape[0]
        cum = torch.cumsum(dtc * a, dim=0)  # [n, heads]: log decay from the block's start through token l
        # decay[l, s, h] = exp(cum[l] - cum[s]) for s <= l, else 0
        seg = cum[:, None, :] - cum[None, :, :]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(seg.masked_fill(~causal[..., None], float("-inf")))
        scores = torch.einsum("lhn,shn->lsh", cc, bc) * decay  # [n, n, heads]
        xdt = xc * dtc[..., None]
        y = torch.einsum("lsh,shp->lhp", scores, xdt)
        y = y + torch.einsum("lhn,hpn->lhp", cc, state) * torch.exp(cum)[..., None]
        ys.append(y + d.float()[:, None] * xc)
        to_end = torch.exp(cum[-1:] - cum)  # [n, heads]
        state = state * torch.exp(cum[-1])[:, None, None] + torch.einsum("shp,shn->hpn", xdt * to_end[..., None], bc)
    return torch.cat(ys), state


def ssd_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: x [B, heads, head_dim], dt [B, heads] (float32), a, d [heads],
    b, c [B, groups, d_state], state [B, heads, head_dim, d_state].
    Returns (y [B, heads, head_dim] float32, the states after the token, float32)."""
    heads = x.shape[1]
    x, b, c = x.float(), _by_head(b.float(), heads), _by_head(c.float(), heads)
    decay = torch.exp(dt * a.float())[..., None, None]  # [B, heads, 1, 1]
    state = state.float() * decay + (dt[..., None] * x)[..., None] * b[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, c) + d.float()[:, None] * x
    return y, state


def split_channels(mixed: torch.Tensor, heads: int, head_dim: int, groups: int):
    """Convolved channels [T, channels] -> x [T, heads, head_dim], B and C [T, groups, state_size]."""
    t = mixed.shape[0]
    xs, b, c = mixed.split([heads * head_dim, *(2 * [(mixed.shape[1] - heads * head_dim) // 2])], dim=-1)
    return xs.reshape(t, heads, head_dim), b.reshape(t, groups, -1), c.reshape(t, groups, -1)
