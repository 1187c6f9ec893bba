"""The KV cache's layout: keys and values by default, with the byte count every model had before layouts were
declared; a model's own layout (DeepSeek's latent cache: one plane) allocated and counted as it says."""

from __future__ import annotations

import torch

from shardserve.config import CacheLayout
from shardserve.engine.kv_cache import allocate_kv_cache, bytes_per_block


def test_keys_and_values_are_two_planes_of_the_kv_heads():
    assert CacheLayout.keys_and_values(8, 128) == CacheLayout(2, 8, 128)
    assert bytes_per_block(32, 16, 8, 128, torch.bfloat16) == 2 * 32 * 16 * 8 * 128 * 2
    layers = allocate_kv_cache(3, 4, 16, 2, 8, torch.float32, torch.device("cpu"))
    assert len(layers) == 3 and all(len(planes) == 2 for planes in layers)
    assert layers[0][0].shape == (64, 2, 8) and not layers[2][1][:16].any(), "block 0 zeroed"


def test_a_one_plane_layout_holds_one_entry_a_token_a_layer():
    latent = CacheLayout(1, 1, 512 + 64)
    assert bytes_per_block(61, 16, latent.heads, latent.dim, torch.bfloat16, planes=latent.planes) == \
        61 * 16 * 576 * 2
    layers = allocate_kv_cache(2, 3, 16, 1, 576, torch.float32, torch.device("cpu"), planes=1)
    assert [tuple(t.shape) for planes in layers for t in planes] == [(48, 1, 576)] * 2
    assert not layers[1][0][:16].any()
