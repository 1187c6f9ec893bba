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


# Bytes of one decay matrix (blocks x heads x chunk_size**2 float32) a pass of ssd_chunked may take on a GPU: its
# blocks' quadratic forms and the state carried between them in a few batched products rather than a dozen small
# launches a block, with transients of about three such matrices (at 32 MiB: 8 blocks of 128 tokens at
# Nemotron-3-Nano's 64 heads, 4 at 128 heads). On CPUs one block at a time, whose tensors stay in cache, is
# fastest: a 4,096-token prompt of Nemotron-3-Nano's 64 heads took 0.23 to 0.32 s at 1 block, 0.40 at 2, 0.45 at 8
# (and 0.43 s a head at a time before C . B was formed once a group), on a 2-core EPYC. (The GPU figure is not
# measured yet.)
GPU_PASS_BYTES = 32 * 2**20


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                d: torch.Tensor, state: torch.Tensor, chunk_size: int = 128,
                chunks_at_once: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of T >= 1 tokens: x [T, heads, head_dim], dt [T, heads] (step sizes, float32), a [heads]
    (A = -exp(A_log)), b, c [T, groups, d_state], d [heads], state [heads, head_dim, d_state].
    Returns (y [T, heads, head_dim] float32, the state after the last token, float32).

    The tokens go in blocks of chunk_size from the first, up to chunks_at_once blocks in one pass (_ssd_blocks;
    None: as many as GPU_PASS_BYTES allows on a GPU, 1 elsewhere); the state carries from pass to pass."""
    if chunks_at_once is None:
        per_block = x.shape[1] * chunk_size * chunk_size * 4
        chunks_at_once = 1 if x.device.type == "cpu" else max(1, GPU_PASS_BYTES // per_block)
    x, b, c, d, state, a = x.float(), b.float(), c.float(), d.float(), state.float(), a.float()
    ys = []
    span = chunk_size * chunks_at_once
    for s in range(0, x.shape[0], span):
        y, state = _ssd_blocks(x[s:s + span], dt[s:s + span], a, b[s:s + span], c[s:s + span], state, chunk_size)
        ys.append(y + d[:, None] * x[s:s + span])
    return torch.cat(ys), state


def _ssd_blocks(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM's output without the D term, and the state after, for n tokens in blocks of chunk_size (float32; b
    and c per group, whose consecutive heads share them). The last block is padded with tokens of dt = 0, which
    decay nothing and add nothing.

    Within block k, y_l = sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s + exp(cum_l) C_l S_k, cum the
    running sum of dt * A from the block's start and S_k the state entering it; blocks apart,
    S_{k+1} = exp(cum_last_k) S_k + sum_s exp(cum_last_k - cum_s) dt_s x_s B_s^T, unrolled as a decay matrix
    over the blocks (every exponent <= 0). C_l . B_s is formed once a group, not once a head."""
    n, heads = dt.shape
    groups = b.shape[1]
    pad = -n % chunk_size
    if pad:
        x, b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, b, c))
        dt = F.pad(dt, (0, 0, 0, pad))
    blocks = (n + pad) // chunk_size
    shape = (blocks, chunk_size, groups, heads // groups)

    # [T, ...] -> [K, G, (R,) L, ...]: block, group, head of the group, token, the rest.
    b, c = (t.reshape(blocks, chunk_size, groups, -1).transpose(1, 2) for t in (b, c))  # [K, G, L, N]
    xdt = (x * dt[..., None]).reshape(*shape, -1).permute(0, 2, 3, 1, 4)  # [K, G, R, L, P]
    cum = torch.cumsum((dt * a).reshape(shape).permute(0, 2, 3, 1), dim=-1)  # [K, G, R, L]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")))  # [K, G, R, L, S]
    y = ((c @ b.transpose(-1, -2))[:, :, None] * decay) @ xdt  # [K, G, R, L, P]
    # Each block's own contribution to the state after it, from a zero state: [K, G, R, P, N].
    last = cum[..., -1]  # [K, G, R]
    own = (xdt * torch.exp(last[..., None] - cum)[..., None]).transpose(-1, -2) @ b[:, :, None]
    # The state entering block k: S_0 decayed over blocks 0..k-1, plus block j's own decayed over blocks j+1..k-1.
    through = torch.cumsum(last, dim=0)  # [K, G, R]: log decay over blocks 0..k
    before = through - last  # over blocks 0..k-1
    earlier = torch.ones(blocks, blocks, dtype=torch.bool, device=x.device).tril(-1)
    gap = torch.exp((before[:, None] - through[None]).masked_fill(~earlier[..., None, None], float("-inf")))
    entering = (torch.exp(before)[..., None, None] * state.reshape(groups, heads // groups, *state.shape[1:])
                + torch.einsum("kjgr,jgrpn->kgrpn", gap, own))  # [K, G, R, P, N]
    y = y + (c[:, :, None] @ entering.transpose(-1, -2)) * torch.exp(cum)[..., None]
    after = (entering[-1] * torch.exp(last[-1])[..., None, None] + own[-1]).reshape(state.shape)
    return y.permute(0, 3, 1, 2, 4).reshape(blocks * chunk_size, heads, -1)[:n], after


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
