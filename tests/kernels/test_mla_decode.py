"""The Triton decode kernel of multi-head latent attention equals float64 attention over the same paged latent rows:
heads fewer than a tensor-core block (padded) and more than one block, contexts that end mid-block, blocks out of
order, a padding row (context 0, output 0), one split and several joined by the second launch, and a cache with
or without its singleton head axis; an FP8 (e4m3) cache read as the values it holds.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors (small widths, float32)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from shardserve.kernels.triton.mla_decode import mla_decode, mla_decode_reference  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# DeepSeek-V3's widths on a GPU; narrower ones in the interpreter, which is slow.
LATENT, ROPE = (512, 64) if ON_GPU else (32, 16)
BLOCK_SIZE = 16


def _paged(context_lens: list[int], heads: int, dtype: torch.dtype, seed: int, head_axis: bool, rope: int = ROPE):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(1, max(triton.cdiv(n, BLOCK_SIZE) for n in context_lens))
    num_blocks = len(context_lens) * max_blocks + 3
    # Each sequence's blocks drawn from a shuffled pool: tables point anywhere, never to the same block twice.
    order = torch.randperm(num_blocks, generator=g)[:len(context_lens) * max_blocks]
    tables = order.view(len(context_lens), max_blocks).to(torch.int32)
    cache = torch.randn(num_blocks * BLOCK_SIZE, *([1] if head_axis else []), LATENT + rope, generator=g)
    q = torch.randn(len(context_lens), heads, LATENT + rope, generator=g)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q.to(dtype), cache.to(dtype), tables, lens)]


@pytest.mark.parametrize("heads", [5, 20])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_equals_float64_attention_over_the_latent_rows(heads, num_splits):
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    q, cache, tables, lens = _paged([37, 1, 0, 70], heads, dtype, seed=heads + num_splits, head_axis=num_splits == 3)
    scale = (LATENT // 4 + ROPE) ** -0.5
    got = mla_decode(q, cache, tables, lens, BLOCK_SIZE, scale, LATENT, num_splits=num_splits)
    want = mla_decode_reference(q, cache, tables, lens, BLOCK_SIZE, scale, LATENT)
    assert got.shape == (4, heads, LATENT) and got.dtype == dtype
    assert torch.count_nonzero(got[2]) == 0  # the padding row
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


def test_float32_products_are_full_precision_and_a_narrow_rope_part_is_summed_apart():
    """Float32 (the tests' dtype on GPUs too) multiplies in full precision, not TF32 (whose 10-bit mantissas would
    miss this tolerance on a GPU), and a rope part narrower than a tensor-core product (8 dims: tiny models) is
    scored without one."""
    q, cache, tables, lens = _paged([37, 5], 4, torch.float32, seed=11, head_axis=False, rope=8)
    scale = (LATENT // 4 + 8) ** -0.5
    got = mla_decode(q, cache, tables, lens, BLOCK_SIZE, scale, LATENT, num_splits=2)
    want = mla_decode_reference(q, cache, tables, lens, BLOCK_SIZE, scale, LATENT)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_an_fp8_cache_is_read_as_the_values_it_holds(num_splits):
    """An e4m3 latent cache: the kernel's output is float64 attention over exactly the stored (rounded) entries."""
    q, cache, tables, lens = _paged([20, 45], 6, torch.float32, seed=7, head_axis=True)
    q = q.to(torch.bfloat16 if ON_GPU else torch.float32)
    stored = cache.to(torch.float8_e4m3fn)
    scale = (LATENT // 4 + ROPE) ** -0.5
    got = mla_decode(q, stored, tables, lens, BLOCK_SIZE, scale, LATENT, num_splits=num_splits)
    want = mla_decode_reference(q, stored.float(), tables, lens, BLOCK_SIZE, scale, LATENT)
    tolerance = 2e-2 if ON_GPU else 1e-4
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
    assert not torch.allclose(want, mla_decode_reference(q, cache, tables, lens, BLOCK_SIZE, scale, LATENT))


def test_rows_that_do_not_match_the_cache_are_refused():
    q, cache, tables, lens = _paged([4], 4, torch.float32, seed=0, head_axis=False)
    with pytest.raises(ValueError, match="query rows"):
        mla_decode(q[..., :-1], cache, tables, lens, BLOCK_SIZE, 1.0, LATENT)


def _latent_layer(interleaved: bool):
    from shardserve.distributed.communicator import Communicator
    from shardserve.layers.mla import MlaDims, MultiHeadLatentAttention

    dims = MlaDims(hidden_size=48, num_heads=3, q_lora_rank=0, kv_lora_rank=LATENT, qk_nope_head_dim=16,
                   qk_rope_head_dim=ROPE, v_head_dim=12, eps=1e-6, scale=0.2, interleaved=interleaved)
    layer = MultiHeadLatentAttention(dims, Communicator(None, 0, 1), torch.float32).to(DEVICE)
    g = torch.Generator().manual_seed(3)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return layer


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_the_fused_decode_step_equals_the_torch_ops_it_replaces(interleaved, cache_dtype):
    """MultiHeadLatentAttention.fused_decode (one launch stores the normed latent and rotated key and rotates the
    queries, then the absorbed products around the decode kernel) against the layer's torch path over the same
    kernel: the same heads' values and the same cache entries, for two live rows and a CUDA graph's padding row
    (slot -1, context 0: zeros, nothing stored)."""
    from shardserve.attention.mla import MlaBackend, MlaMetadata
    from shardserve.layers.rotary import RotaryEmbedding, RotaryLookup

    layer = _latent_layer(interleaved)
    rotary = RotaryEmbedding(ROPE, 64, 10000.0, None, torch.float32).to(DEVICE)
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(6 * BLOCK_SIZE, 1, LATENT + ROPE, generator=g)
    cache[:BLOCK_SIZE] = 0  # block 0, as the engine keeps it
    cache = cache.to(cache_dtype).to(DEVICE)
    tables = torch.tensor([[1, 4], [3, 0], [0, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([21, 8, 0], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([4 * BLOCK_SIZE + 4, 3 * BLOCK_SIZE + 7, -1], device=DEVICE)
    positions = (lens - 1).clamp(min=0).long()
    h = torch.randn(3, 48, generator=g).to(DEVICE)

    def step(fused: bool):
        backend = MlaBackend(torch.device(DEVICE), BLOCK_SIZE, ("mla-triton", mla_decode))
        backend.fuses_decode = fused
        meta = MlaMetadata(backend, slots, 3, tables, lens, [], padded=True)
        own = cache.clone()
        lookup = RotaryLookup(rotary.cos, rotary.signed_sin, positions)
        return layer.attention(h, lookup, own, meta), own

    fused, fused_cache = step(True)
    torch_path, torch_cache = step(False)
    torch.testing.assert_close(fused, torch_path, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused[2], torch.zeros_like(fused[2]))
    torch.testing.assert_close(fused_cache.float(), torch_cache.float(), rtol=1e-5, atol=1e-5)
    untouched = torch.ones(len(cache), dtype=torch.bool)
    untouched[slots[:2].cpu()] = False
    assert torch.equal(fused_cache[untouched.to(DEVICE)].float(), cache[untouched.to(DEVICE)].float())


@pytest.mark.parametrize("rows", [1, 3])
def test_the_few_rows_product_equals_torch_bmm_on_strided_views(rows):
    """few_rows_bmm's kernel on the absorbed products' layouts: the queries' nope parts as a head-major view of the
    projection's rows times W_UK, and head-major latents times W_UV's transpose (a strided view)."""
    from shardserve.kernels.triton.mla_decode import few_rows_products

    g = torch.Generator().manual_seed(6)
    heads, nope, values = 3, 16, 12
    q = torch.randn(rows, heads, nope + ROPE, generator=g).to(DEVICE)
    w = torch.randn(heads, nope + values, LATENT, generator=g).to(DEVICE)
    w_uk, w_uv = w.split([nope, values], dim=1)
    a = q[..., :nope].transpose(0, 1)
    torch.testing.assert_close(few_rows_products(a, w_uk), torch.bmm(a, w_uk), rtol=1e-5, atol=1e-5)
    latents = torch.randn(heads, rows, LATENT, generator=g).to(DEVICE)
    w_uv_t = w_uv.transpose(1, 2)
    torch.testing.assert_close(few_rows_products(latents, w_uv_t), torch.bmm(latents, w_uv_t), rtol=1e-5, atol=1e-5)
