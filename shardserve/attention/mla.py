"""Attention over DeepSeek's paged latent cache (multi-head latent attention, layers/mla.py), in torch on any device.

Cache invariant: a layer's cache is one plane [num_slots, 1, L + R]; the slot of (sequence, position) holds that
token's normed latent (L = kv_lora_rank features) then its rotated rope key (R = qk_rope_head_dim), once for every
head and every rank. Slots are filled as the paged KV cache's are (slot = block * block_size + offset, blocks shared
only by sequences with the same prefix).

Metadata: where each new token's entry goes (slot_mapping), the single-token rows' block tables and context lengths
(int32, the decode kernel's interface: `mla_decode` below, or a device kernel of the same signature), and for each
longer chunk the slots of its whole context (the expanded form reads them). Built from the step's StepBatch on
the backend's device, CPU or CUDA alike, or for CUDA graphs held in static buffers (static_decode_metadata): a
decode step reads nothing on the host, so graphs capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.attention.batch import StepBatch
from shardserve.attention.sdpa import PrefillChunk


@dataclass
class MlaMetadata:
    backend: "MlaBackend"
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's entry goes
    num_decode: int  # rows [0, num_decode) are one token of one sequence each
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] int32, padded with block 0
    decode_context_lens: torch.Tensor | None  # [num_decode] int32, including this step's token
    prefills: list[PrefillChunk]
    # A CUDA graph's rows: those past the live batch have slot -1 (store nothing) and context length 0 (output 0).
    padded: bool = False


def device_decode(device: torch.device):
    """("mla-triton", the Triton decode kernel) on CUDA where shardserve has it, else None (torch's)."""
    from shardserve.kernels.availability import use_triton

    if not use_triton(torch.empty(0, device=device)):
        return None
    try:
        from shardserve.kernels.triton.mla_decode import mla_decode as triton_decode
    except ImportError:
        return None
    return "mla-triton", triton_decode


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
               block_size: int, scale: float, latent_dim: int) -> torch.Tensor:
    """Absorbed decode attention, one query token per sequence: for q [B, H, L + R] (the latent query beside the
    rotated query) over each sequence's cache entries [num_slots, L + R] (its first context_lens[b] positions through
    block_tables[b]), softmax(scale * q . entry) . latent: [B, H, L] in q's dtype, computed in float32.

    Reads the context padded to the block tables' width; positions past a sequence's length read slot 0 (block 0 is
    zeroed, never NaN) and are masked out. No host synchronisation."""
    batch, width = block_tables.shape
    pos = torch.arange(width * block_size, device=q.device)
    valid = pos.unsqueeze(0) < context_lens.unsqueeze(1)
    slots = block_tables.long()[:, pos // block_size] * block_size + pos % block_size
    entries = cache[torch.where(valid, slots, 0)].float()  # [B, P, L + R]
    scores = torch.matmul(q.float(), entries.transpose(1, 2)).mul_(scale)  # [B, H, P]
    scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))
    # A row of context 0 (a graph's padding row) has no valid position: its weights are all zeroed, not NaN.
    weights = torch.softmax(scores, dim=-1).masked_fill_(~valid.unsqueeze(1), 0.0)
    return torch.matmul(weights, entries[..., :latent_dim]).to(q.dtype)


class MlaBackend:
    """The latent cache's metadata and its decode product (`decode`: mla_decode's signature): the Triton kernel
    (kernels/triton/mla_decode.py) on CUDA where it is there, else torch's mla_decode. Start-up checks the product
    against float64 and falls back to torch's (engine/kernel_setup.checked_latent_attention)."""

    fuses_head_norm = False

    def __init__(self, device: torch.device, block_size: int, decode=None) -> None:
        self.device = device
        self.block_size = block_size
        self.name, self.decode = ("mla-torch", mla_decode) if decode is None else decode
        # Decode-only steps on the Triton kernels' fused form (layers/mla.MultiHeadLatentAttention.fused_decode).
        self.fuses_decode = self.name == "mla-triton"

    @classmethod
    def for_device(cls, device: torch.device, block_size: int) -> "MlaBackend":
        return cls(device, block_size, device_decode(device))

    def with_torch_decode(self) -> "MlaBackend":
        return MlaBackend(self.device, self.block_size)

    def build_metadata(self, batch: StepBatch) -> MlaMetadata:
        bs, nd = self.block_size, batch.num_decode
        prefills = []
        for i in range(nd, len(batch.chunks)):
            c = batch.chunks[i]
            slots = [c.block_table[p // bs] * bs + p % bs for p in range(batch.context_len(i))]
            prefills.append(PrefillChunk(batch.row_start[i], batch.row_start[i + 1],
                                         torch.tensor(slots, dtype=torch.long, device=self.device), c.start_position))
        tables = lens = None
        if nd:
            lens_list = [batch.context_len(i) for i in range(nd)]
            width = -(-max(lens_list) // bs)
            tables = torch.zeros(nd, width, dtype=torch.int32)
            for i in range(nd):
                used = batch.chunks[i].block_table[:width]
                tables[i, :len(used)] = torch.tensor(used, dtype=torch.int32)
            tables = tables.to(self.device)
            lens = torch.tensor(lens_list, dtype=torch.int32, device=self.device)
        return MlaMetadata(self, torch.tensor(batch.slot_mapping, dtype=torch.long, device=self.device), nd, tables,
                           lens, prefills)

    # -- static buffers for CUDA graphs (engine/cuda_graphs.py writes them before each replay) ------------------
    def static_decode_metadata(self, max_batch: int, max_blocks: int) -> MlaMetadata:
        """Decode metadata in fixed buffers sized for the largest graph batch, kept as long as the graphs."""
        return MlaMetadata(self, torch.full((max_batch,), -1, dtype=torch.long, device=self.device), max_batch,
                           torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=self.device),
                           torch.zeros(max_batch, dtype=torch.int32, device=self.device), [], padded=True)

    def graph_view(self, static: MlaMetadata, batch_size: int, max_context: int,
                   rows_share_sequences: bool = False) -> MlaMetadata:
        """The first batch_size rows of the static buffers. The decode's launch (its splits of the context) depends
        on the tables' full width only, so the graph's kernels serve any context up to max_model_len. Rows of one
        sequence side by side need nothing else: the entries are stored by a launch before the decode's."""
        return MlaMetadata(self, static.slot_mapping[:batch_size], batch_size,
                           static.decode_block_tables[:batch_size], static.decode_context_lens[:batch_size], [],
                           padded=True)
