"""The Triton paged-attention kernels over an FP8 (e4m3) KV cache: the cache write quantizes as
attention/kv_quant.py does (the same bits), and prefill and decode equal float64 attention over the keys and values
as the cache holds them (stored * scale). In Triton's interpreter on CPUs (tiny shapes)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from shardserve.attention import kv_quant  # noqa: E402
from shardserve.kernels.triton import paged_attention as pa, paged_decode as pd  # noqa: E402
from tests.kernels.test_triton_kernels import DEVICE, PagedCache, reference_attention  # noqa: E402

K_SCALE, V_SCALE = 0.37, 1.9  # not powers of two: the rounding grid moves with them


def _fp8_cache(lengths, num_kv_heads, head_dim, block_size, seed):
    """A PagedCache whose keys and values are stored in e4m3 with K_SCALE / V_SCALE, and their float64 values as
    attention must read them."""
    cache = PagedCache(lengths, num_kv_heads, head_dim, block_size, torch.float32, seed)
    cache.k = kv_quant.encode(cache.k * 3, K_SCALE, kv_quant.FP8)
    cache.v = kv_quant.encode(cache.v * 3, V_SCALE, kv_quant.FP8)
    return cache


def _read(cache, seq, length):
    k, v = cache.context(seq, length)
    return k.double() * K_SCALE, v.double() * V_SCALE


def test_the_cache_write_quantizes_saturates_and_skips_negative_slots():
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(5, 2, 32, generator=g) * 4, torch.randn(5, 2, 32, generator=g) * 4
    key[0, 0, :3] = torch.tensor([1e4, -1e4, 1e-5])  # saturates at +-448 * scale; rounds to a subnormal or 0
    k_cache = torch.zeros(16, 2, 32, dtype=kv_quant.FP8, device=DEVICE)
    v_cache = torch.zeros(16, 2, 32, dtype=kv_quant.FP8, device=DEVICE)
    slots = torch.tensor([3, -1, 0, 9, 15], device=DEVICE)

    pa.store_kv_cache(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots, K_SCALE, V_SCALE)

    written = slots >= 0
    for cache, x, scale in ((k_cache, key, K_SCALE), (v_cache, value, V_SCALE)):
        expected = kv_quant.encode(x[written.cpu()], scale, kv_quant.FP8)
        assert torch.equal(cache[slots[written]].view(torch.uint8).cpu(), expected.view(torch.uint8))
        untouched = torch.ones(16, dtype=torch.bool)
        untouched[slots[written].cpu()] = False
        assert not cache[untouched.to(DEVICE)].view(torch.uint8).any()
    assert k_cache[3, 0, :2].float().tolist() == [448.0, -448.0]  # saturated, not NaN


def test_prefill_and_split_decode_read_stored_values_times_the_scales():
    seqs = [(5, 5), (1, 30), (20, 45), (33, 33)]  # (new tokens, context including them)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    cache = _fp8_cache([c for _, c in seqs], num_kv_heads, head_dim, block_size, seed=7)
    lens = [n for n, _ in seqs]
    q = torch.randn(sum(lens), num_heads, head_dim, generator=cache.generator).to(DEVICE)
    query_start = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(DEVICE)
    context_lens = torch.tensor([c for _, c in seqs], dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5

    prefill = pa.paged_prefill_attention(q, cache.k, cache.v, cache.block_tables, query_start, context_lens,
                                         max(lens), scale, block_size, k_scale=K_SCALE, v_scale=V_SCALE)
    last_rows = query_start[1:].long() - 1
    decode = pd.paged_decode_attention(q[last_rows], cache.k, cache.v, cache.block_tables, context_lens, scale,
                                       block_size, 2, k_scale=K_SCALE, v_scale=V_SCALE)

    start = 0
    for s, (n, c) in enumerate(seqs):
        k, v = _read(cache, s, c)
        ref = reference_attention(q[start:start + n], k, v, torch.arange(c - n, c, device=DEVICE), scale)
        torch.testing.assert_close(prefill[start:start + n].double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(decode[s:s + 1].double(), ref[-1:], atol=1e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("mode", ["fused", "separate"])
def test_the_start_up_check_passes_the_paged_backend_over_an_fp8_cache(mode, monkeypatch, set_env):
    """Every path of the backend (the rotary kernel's cache write, decode storing its own new token, prefill)
    through the start-up check: float64 attention over keys and values rounded to e4m3 with the layer's scales."""
    from shardserve.attention.triton_paged import TritonPagedBackend
    from shardserve.engine import kernel_setup
    from shardserve.layers import rotary as rotary_module
    from shardserve.layers.attention import PagedAttention
    from shardserve.layers.rotary import RotaryEmbedding

    set_env(SHARDSERVE_DECODE_ROTARY=mode)
    monkeypatch.setattr(rotary_module, "use_triton", lambda t: True)  # CPU tensors too: the kernel path
    attn = PagedAttention(4, 2, 32, (0, 0, 1, 1))
    attn.k_scale, attn.v_scale = K_SCALE, V_SCALE
    rotary = RotaryEmbedding(32, 128, 10000.0, None, torch.float32).to(DEVICE)
    backend = TritonPagedBackend(torch.device(DEVICE), 16, 2)
    result = kernel_setup.check_attention(backend, attn, rotary, torch.float32, torch.device(DEVICE), 16,
                                          kv_dtype=kv_quant.FP8)
    assert result.passed and result.error < 1e-5, result.describe()
