"""What the paged-attention kernel tests share: a paged KV cache filled from contiguous keys and values, a float64
reference attention, the attention tolerances by dtype, and the slots of each sequence's last position."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

ATTN_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


# ---------------------------------------------------------------------------------------------------------------
# Paged cache fixtures and the reference


class PagedCache:
    """A random cache with shuffled, non-contiguous block tables; block 0 is never handed out."""

    def __init__(self, lengths: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        blocks_needed = [-(-n // block_size) for n in lengths]
        num_blocks = 1 + sum(blocks_needed) + 3
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
        self.v = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
        ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        max_blocks = max(blocks_needed + [1]) + 2
        table = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
        for s, n in enumerate(blocks_needed):
            table[s, :n] = torch.tensor(ids[:n], dtype=torch.int32)
            table[s, n:] = torch.randint(0, num_blocks, (max_blocks - n,), generator=g)  # junk past the end
            ids = ids[n:]
        self.block_tables = table.to(DEVICE)
        self.block_size = block_size
        self.generator = g

    def context(self, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, length) of seq: [length, kv_heads, dim] each."""
        pos = torch.arange(length, device=DEVICE)
        table = self.block_tables[seq].long()
        slots = table[pos // self.block_size] * self.block_size + pos % self.block_size
        return self.k[slots], self.v[slots]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """q [M, H, D] at positions q_pos attends to k, v [L, KVH, D] at positions <= its own; float64."""
    if k.shape[0] == 0:
        return torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q.double(), k) * scale
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hml,lhd->mhd", probs, v)


def slots_of_last_positions(cache: PagedCache, lengths: list[int]) -> torch.Tensor:
    """The cache slot of each sequence's position length - 1 (-1 for an empty sequence: a padding row)."""
    slots = []
    for s, n in enumerate(lengths):
        block = int(cache.block_tables[s, (n - 1) // cache.block_size]) if n else -1
        slots.append(block * cache.block_size + (n - 1) % cache.block_size if n else -1)
    return torch.tensor(slots, device=DEVICE)
