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
from shardserve.kernels.triton import fused_ops  # noqa: E402
from shardserve.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.helpers.paged_cache import (ATTN_TOL, DEVICE, PagedCache, reference_attention,  # noqa: E402
                                       slots_of_last_positions)

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


class _Launches:
    """The decode kernel, recording the keyword arguments (launch parameters and constexprs) of each launch."""

    def __init__(self, kernel) -> None:
        self.kernel, self.kwargs = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kwargs.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


# (head_dim, tokens a tile): an FP8 row of 128 bytes or less takes tiles of 128 tokens, a 16-bit one 64.
FP8_TILES = [(32, 128), (256, 64)]


# (q's dtype, log2 of a factor on q): bfloat16 queries past float16's range (2^16) and below its normal one
# (2^-14), which the tiles' float16 products must still read exactly; float16 ones as they are.
QUERY_MAGNITUDES = [(torch.float16, 0), (torch.float16, -6), (torch.bfloat16, 0), (torch.bfloat16, 20),
                    (torch.bfloat16, 100), (torch.bfloat16, -20), (torch.bfloat16, -100)]


@pytest.mark.parametrize("head_dim,block_n", FP8_TILES)
@pytest.mark.parametrize("dtype,log2_magnitude", QUERY_MAGNITUDES)
def test_decode_of_16_bit_queries_reads_fp8_tiles_as_float64_attention(monkeypatch, dtype, log2_magnitude,
                                                                       head_dim, block_n):
    """16-bit queries over an FP8 cache: tiles of FP8_TILES' tokens, converted to float16 with q's rows scaled
    by powers of two (paged_attention.tile_operand): q times 2^m with the softmax scale divided by 2^m reads as
    q. Contexts around the tile's length, one split and three."""
    lengths = [0, 1, block_n - 1, block_n, block_n + 1, 2 * block_n + 44]
    num_heads, num_kv_heads, block_size = 8, 2, 16
    magnitude = 2.0 ** log2_magnitude
    cache = _fp8_cache(lengths, num_kv_heads, head_dim, block_size, seed=head_dim)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=cache.generator)
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    launches = _Launches(pd._decode_kernel)
    monkeypatch.setattr(pd, "_decode_kernel", launches)
    for splits in (1, 3):
        out = pd.paged_decode_attention((q * magnitude).to(dtype).to(DEVICE), cache.k, cache.v, cache.block_tables,
                                        context_lens, scale / magnitude, block_size, splits, k_scale=K_SCALE,
                                        v_scale=V_SCALE)
        assert launches.kwargs[-1]["BLOCK_N"] == block_n and launches.kwargs[-1]["KV_FP8"]
        assert out.dtype == dtype and torch.isfinite(out).all()
        for s, n in enumerate(lengths):
            k, v = _read(cache, s, n)
            ref = reference_attention(q[s:s + 1].to(dtype).to(DEVICE), k, v, torch.tensor([n - 1], device=DEVICE),
                                      scale)
            torch.testing.assert_close(out[s:s + 1].double(), ref, atol=ATTN_TOL[dtype], rtol=ATTN_TOL[dtype])


def test_a_16_bit_cache_keeps_its_tiles_of_64_tokens(monkeypatch):
    """The FP8 tile length is the FP8 cache's alone: a bfloat16 (float16 on CPUs) cache of the same rows keeps 64."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    cache = PagedCache([70], 2, 32, 16, dtype, seed=3)
    q = torch.randn(1, 4, 32, generator=cache.generator).to(dtype).to(DEVICE)
    launches = _Launches(pd._decode_kernel)
    monkeypatch.setattr(pd, "_decode_kernel", launches)
    pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, torch.tensor([70], dtype=torch.int32,
                              device=DEVICE), 0.2, 16, 1)
    assert launches.kwargs[-1]["BLOCK_N"] == 64 and not launches.kwargs[-1]["KV_FP8"]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_that_stores_its_new_token_in_fp8_equals_the_rotary_kernel_then_decode(monkeypatch, dtype, splits):
    """16-bit queries over an FP8 cache, the decode launch rotating and storing its own new token: the cache the
    rotary kernel writes (the same quantized bytes), and the output of decode after it to rounding, which is
    float64 attention over the cache's values."""
    lengths = [0, 1, 127, 128, 200]
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 32, 16
    cache = _fp8_cache(lengths, num_kv_heads, head_dim, block_size, seed=splits)
    g = cache.generator
    rope = RotaryEmbedding(head_dim, 256, 10000.0, None, dtype)
    cos, sin = rope.cos.to(DEVICE), rope.signed_sin.to(DEVICE)
    qkv = (2 * torch.randn(len(lengths), num_heads + 2 * num_kv_heads, head_dim, generator=g)).to(dtype).to(DEVICE)
    positions = torch.tensor([max(n - 1, 0) for n in lengths], device=DEVICE)
    slots = slots_of_last_positions(cache, lengths)
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    k_cache, v_cache = cache.k.clone(), cache.v.clone()

    expected_qkv = qkv.clone()
    qk = expected_qkv[:, :num_heads + num_kv_heads]
    fused_ops.apply_rotary_and_store_(qk, num_heads, expected_qkv[:, num_heads + num_kv_heads:], positions, cos,
                                      sin, cache.k, cache.v, slots, None, **scales)
    expected = pd.paged_decode_attention(qk[:, :num_heads], cache.k, cache.v, cache.block_tables, context_lens,
                                         scale, block_size, splits, **scales)
    new = pd.NewTokens(qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:], slots, cos,
                       sin)
    launches = _Launches(pd._decode_kernel)
    monkeypatch.setattr(pd, "_decode_kernel", launches)
    got = pd.paged_decode_attention(qkv[:, :num_heads], k_cache, v_cache, cache.block_tables, context_lens, scale,
                                    block_size, splits, new_tokens=new, **scales)

    # One split (large batches): the FP8 config's four warps; several (small batches): the rotating launch's.
    assert launches.kwargs[-1]["num_warps"] == (4 if splits == 1 else pd.DECODE_NEW_TOKEN_WARPS)
    assert launches.kwargs[-1]["BLOCK_N"] == 128
    assert torch.equal(k_cache.view(torch.uint8), cache.k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), cache.v.view(torch.uint8))
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=8e-3)  # the new token's products in another order
    for s, n in enumerate(lengths):
        k, v = _read(cache, s, n)
        ref = reference_attention(expected_qkv[s:s + 1, :num_heads], k, v, positions[s:s + 1], scale)
        torch.testing.assert_close(got[s:s + 1].double(), ref, atol=ATTN_TOL[dtype], rtol=ATTN_TOL[dtype])
