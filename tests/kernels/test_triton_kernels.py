"""The Triton kernels agree with plain torch references.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors (slow, so shapes are small).
The interpreter neither multiplies bfloat16 matrices nor rounds float32 to bfloat16 to nearest (it truncates),
so bfloat16 results are checked on CUDA only; float16 stands in for the 16-bit paths on CPU.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from shardserve.kernels.triton import fused_ops, paged_attention as pa, paged_decode as pd  # noqa: E402
from shardserve.kernels.triton.all_reduce import _ll_payload, ll_values, with_epoch  # noqa: E402
from shardserve.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.helpers.paged_cache import ATTN_TOL, PagedCache, reference_attention, slots_of_last_positions  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def assert_attention_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------------------------
# Cache write


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_cache_writes_slots_and_skips_negative(dtype, slot_dtype):
    g = torch.Generator().manual_seed(0)
    num_slots, kv_heads, dim, tokens = 64, 2, 32, 7
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=g).to(dtype).to(DEVICE)
    qkv = torch.randn(tokens, 4 + 2 * kv_heads, dim, generator=g).to(dtype).to(DEVICE)
    key, value = qkv[:, 4:4 + kv_heads], qkv[:, 4 + kv_heads:]  # strided views
    slots = torch.tensor([5, -1, 63, 17, -1, 0, 32], dtype=slot_dtype, device=DEVICE)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    expect_k[slots[real].long()] = key[real]
    expect_v[slots[real].long()] = value[real]

    pa.store_kv_cache(key, value, k_cache, v_cache, slots)

    assert torch.equal(k_cache, expect_k)
    assert torch.equal(v_cache, expect_v)


# ---------------------------------------------------------------------------------------------------------------
# Decode


def _decode_case(dtype, block_size, num_heads, num_kv_heads, head_dim=32, seed=1):
    lengths = [0, 1, block_size, 37, 70, 95]
    cache = PagedCache(lengths, num_kv_heads, head_dim, block_size, dtype, seed)
    qkv = torch.randn(len(lengths), num_heads + 2 * num_kv_heads, head_dim, generator=cache.generator)
    q = qkv.to(dtype).to(DEVICE)[:, :num_heads]  # a strided view, like the engine's
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    refs = []
    for s, n in enumerate(lengths):
        k, v = cache.context(s, n)
        refs.append(reference_attention(q[s:s + 1], k, v, torch.tensor([n - 1], device=DEVICE), head_dim ** -0.5))
    return cache, q, context_lens, torch.cat(refs)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference_for_any_split(dtype, block_size):
    cache, q, context_lens, ref = _decode_case(dtype, block_size, num_heads=8, num_kv_heads=2)
    scale = q.shape[-1] ** -0.5
    results = {}
    for splits in (1, 3, 8):
        out = pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, context_lens, scale,
                                        block_size, splits)
        assert out.shape == q.shape and out.dtype == dtype
        assert_attention_close(out, ref, dtype)
        assert torch.equal(out[0], torch.zeros_like(out[0]))  # context 0: a padding row
        results[splits] = out
    if dtype == torch.float32:
        torch.testing.assert_close(results[3], results[1], atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(results[8], results[1], atol=2e-6, rtol=2e-6)


def test_decode_without_grouping_and_into_given_output():
    cache, q, context_lens, ref = _decode_case(torch.float32, 16, num_heads=2, num_kv_heads=2, head_dim=16, seed=2)
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    got = pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, context_lens, 16 ** -0.5, 16, 2,
                                    out=out)
    assert got is out
    assert_attention_close(out, ref, torch.float32)



class _NoSecondKernel:
    """Stands in for the combine kernel where the splits must be joined inside the decode launch."""

    def __getitem__(self, grid):
        raise AssertionError("the split decode launched a second kernel to combine its splits")


def _decode_both_ways(monkeypatch, set_env, cache, q, context_lens, block_size, splits, arrivals=None):
    """(fused, separate) outputs of one split decode; the fused one in a single launch."""
    scale = q.shape[-1] ** -0.5
    set_env(SHARDSERVE_DECODE_COMBINE="separate")
    separate = pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, context_lens, scale, block_size,
                                         splits)
    set_env(SHARDSERVE_DECODE_COMBINE="fused")
    with monkeypatch.context() as one_launch:
        one_launch.setattr(pd, "_combine_splits_kernel", _NoSecondKernel())
        fused = pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, context_lens, scale,
                                          block_size, splits, out=torch.full_like(q, float("nan")),
                                          arrivals=arrivals)
    return fused, separate


def _shared_counts_are_zero() -> bool:
    from shardserve.kernels.triton import arrivals

    return all(counts.count_nonzero().item() == 0 for counts in arrivals._counts.values())


# (context lengths, num_heads, num_kv_heads, splits, dtype): lengths that do not divide into the splits, padding
# rows of length 0 among them, GQA groups of 1, 3 and 4.
FUSED_COMBINE_CASES = [
    ([29], 2, 2, 2, torch.float32),
    ([0, 1, 13, 37, 0], 8, 2, 3, torch.float32),
    ([45, 0, 7], 6, 2, 4, torch.float32),
    ([30, 0, 11, 50], 4, 1, 3, torch.float16),
]


@pytest.mark.parametrize("lengths,num_heads,num_kv_heads,splits,dtype", FUSED_COMBINE_CASES)
def test_fused_split_combine_gives_the_bits_of_the_separate_kernel(monkeypatch, set_env, lengths, num_heads,
                                                                   num_kv_heads, splits, dtype):
    block_size, head_dim = 8, 16
    cache = PagedCache(lengths, num_kv_heads, head_dim, block_size, dtype, seed=len(lengths) + splits)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=cache.generator).to(dtype).to(DEVICE)
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)

    fused, separate = _decode_both_ways(monkeypatch, set_env, cache, q, context_lens, block_size, splits)

    assert torch.equal(fused, separate)
    for s, n in enumerate(lengths):
        k, v = cache.context(s, n)
        ref = reference_attention(q[s:s + 1], k, v, torch.tensor([n - 1], device=DEVICE), head_dim ** -0.5)
        assert_attention_close(fused[s:s + 1], ref, dtype)
    assert _shared_counts_are_zero()


def test_fused_split_combine_resets_its_counts_for_the_next_call(monkeypatch, set_env):
    """A second launch over the same counts (as a CUDA graph replays) finds them at zero: every output is
    written again, with new lengths too."""
    num_kv_heads, block_size = 2, 8
    cache = PagedCache([40, 0, 23], num_kv_heads, 16, block_size, torch.float32, seed=9)
    q = torch.randn(3, 4, 16, generator=cache.generator).to(DEVICE)
    counts = torch.zeros(3 * num_kv_heads, dtype=torch.int32, device=DEVICE)  # as the static metadata holds them
    for lengths in ([40, 0, 23], [40, 0, 23], [17, 9, 0]):
        context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        fused, separate = _decode_both_ways(monkeypatch, set_env, cache, q, context_lens, block_size, 3,
                                            arrivals=counts)
        assert torch.equal(fused, separate), lengths
        assert counts.count_nonzero().item() == 0


def test_decode_combine_setting_rejects_unknown_values(set_env):
    cache = PagedCache([20], 1, 16, 8, torch.float32, seed=10)
    q = torch.randn(1, 2, 16, generator=cache.generator).to(DEVICE)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    set_env(SHARDSERVE_DECODE_COMBINE="fast")
    with pytest.raises(ValueError, match=r"SHARDSERVE_DECODE_COMBINE='fast': expected one of fused, separate"):
        pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, lens, 0.25, 8, 2)
    set_env(SHARDSERVE_DECODE_COMBINE="fused")
    int64_counts = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="needs at least 1 zeroed int32 counts"):
        pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, lens, 0.25, 8, 2, arrivals=int64_counts)


def test_many_splits_are_combined_by_the_second_kernel(monkeypatch, set_env):
    """Past FUSED_COMBINE_MAX_ROWS (query heads of a group x splits) the combine by one program costs more than
    the launch it saves: the second kernel runs, and the result is the same."""
    group = 2
    splits = pd.FUSED_COMBINE_MAX_ROWS // group + 1
    cache = PagedCache([8 * splits + 3], 1, 16, 8, torch.float32, seed=11)
    q = torch.randn(1, group, 16, generator=cache.generator).to(DEVICE)
    lens = torch.tensor([8 * splits + 3], dtype=torch.int32, device=DEVICE)
    set_env(SHARDSERVE_DECODE_COMBINE="separate")
    separate = pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, lens, 0.25, 8, splits)
    set_env(SHARDSERVE_DECODE_COMBINE="fused")
    launches = []
    monkeypatch.setattr(pd, "_combine_splits_kernel", _Counted(pd._combine_splits_kernel, launches))
    fused = pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, lens, 0.25, 8, splits)
    assert len(launches) == 1
    assert torch.equal(fused, separate)


class _Counted:
    """A kernel launched through `kernel[grid](...)` that records each launch."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


# (context lengths, query heads, KV heads, splits, head norms, dtype): padding rows, the new token alone in its
# range or at a range's end, one split and several (joined in the launch or by the second kernel).
ROTATED_DECODE_CASES = [
    ([0, 1, 8, 37, 70], 8, 2, 1, False, torch.float32),
    ([0, 1, 8, 37, 70], 8, 2, 3, False, torch.float32),
    ([24, 0, 17], 6, 2, 4, True, torch.float32),
    ([33, 9], 4, 1, 2, True, torch.float16),
    ([16, 5], 4, 2, 20, False, torch.float16),  # group x splits past FUSED_COMBINE_MAX_ROWS: a second kernel
]


def _new_token_inputs(lengths, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, dtype,
                      norm: bool, seed: int, block_size: int = 8):
    """A paged cache of `lengths`, random q/k/v heads [B, heads + 2 * kv_heads, head_dim] of one new token each at
    position length - 1, rotary tables rotary_dim wide, head norms or None, the new tokens' slots and the context
    lengths; k_cache and v_cache are copies of the cache for the launch under test."""
    cache = PagedCache(lengths, num_kv_heads, head_dim, block_size, dtype, seed=seed)
    g = cache.generator
    rope = RotaryEmbedding(rotary_dim, 128, 10000.0, None, dtype)
    qkv = (2 * torch.randn(len(lengths), num_heads + 2 * num_kv_heads, head_dim, generator=g)).to(dtype).to(DEVICE)
    head_norm = None
    if norm:
        head_norm = tuple((1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE) for _ in range(2))
        head_norm += (1e-6,)
    return SimpleNamespace(
        cache=cache, cos=rope.cos.to(DEVICE), sin=rope.signed_sin.to(DEVICE), qkv=qkv, head_norm=head_norm,
        positions=torch.tensor([max(n - 1, 0) for n in lengths], device=DEVICE),
        slots=slots_of_last_positions(cache, lengths),
        context_lens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE), scale=head_dim ** -0.5,
        k_cache=cache.k.clone(), v_cache=cache.v.clone())


def _assert_as_separate_launches(got, expected, inputs, norm: bool, dtype) -> None:
    """The one launch's output equals the separate launches' to rounding (the new token is attended last, from
    registers: its products are summed in another order than a tile's) and its cache their cache."""
    close = {"atol": 2e-6, "rtol": 2e-6} if dtype == torch.float32 else {"atol": 1e-3, "rtol": 8e-3}  # 1-2 units
    torch.testing.assert_close(got, expected, **close)
    if norm and CUDA:  # the head norm's sum of squares runs in the tile's order: a last-bit flip may differ
        torch.testing.assert_close(inputs.k_cache, inputs.cache.k)
    else:
        assert torch.equal(inputs.k_cache, inputs.cache.k)
    assert torch.equal(inputs.v_cache, inputs.cache.v)


@pytest.mark.parametrize("lengths,num_heads,num_kv_heads,splits,norm,dtype", ROTATED_DECODE_CASES)
def test_decode_that_rotates_and_stores_its_new_token_equals_the_rotary_kernel_then_decode(
        lengths, num_heads, num_kv_heads, splits, norm, dtype):
    """With NewTokens the decode launch normalises and rotates q and the new keys and writes the keys and values
    to the cache itself: the same cache as the rotary + cache-write kernel then decode, the same output to
    rounding, and attention over the whole context (the new token included) as the float64 reference."""
    block_size, head_dim = 8, 16
    inputs = _new_token_inputs(lengths, num_heads, num_kv_heads, head_dim, head_dim, dtype, norm, sum(lengths) + splits)
    cache, cos, sin, qkv, head_norm = inputs.cache, inputs.cos, inputs.sin, inputs.qkv, inputs.head_norm
    positions, slots, context_lens, scale = inputs.positions, inputs.slots, inputs.context_lens, inputs.scale
    k_cache, v_cache = inputs.k_cache, inputs.v_cache
    before = qkv.clone()

    expected_qkv = qkv.clone()
    qk = expected_qkv[:, :num_heads + num_kv_heads]
    fused_ops.apply_rotary_and_store_(qk, num_heads, expected_qkv[:, num_heads + num_kv_heads:], positions, cos,
                                      sin, cache.k, cache.v, slots, head_norm)
    expected = pd.paged_decode_attention(qk[:, :num_heads], cache.k, cache.v, cache.block_tables, context_lens,
                                         scale, block_size, splits)

    new = pd.NewTokens(qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:], slots, cos,
                       sin, head_norm)
    got = pd.paged_decode_attention(qkv[:, :num_heads], k_cache, v_cache, cache.block_tables, context_lens, scale,
                                    block_size, splits, new_tokens=new)

    _assert_as_separate_launches(got, expected, inputs, norm, dtype)
    for s, n in enumerate(lengths):
        k, v = cache.context(s, n)
        assert_attention_close(got[s:s + 1], reference_attention(expected_qkv[s:s + 1, :num_heads], k, v,
                                                                 positions[s:s + 1], scale), dtype)
    assert torch.equal(qkv, before)  # the heads are rotated in registers, not in place
    for row in (s for s, n in enumerate(lengths) if n == 0):
        assert torch.equal(got[row], torch.zeros_like(got[row]))  # a padding row: zeros, nothing stored
    if splits > 1:  # the next kernel launched at attention's start (dependent launch on GPUs): the same bits
        assert torch.equal(pd.paged_decode_attention(qkv[:, :num_heads], k_cache, v_cache, cache.block_tables,
                                                     context_lens, scale, block_size, splits, new_tokens=new,
                                                     next_early=True), got)
    assert _shared_counts_are_zero()


@pytest.mark.parametrize("splits,norm,dtype", [(1, False, torch.float32), (3, True, torch.float32),
                                               (4, True, torch.float16)])
def test_decode_that_rotates_part_of_each_head_equals_the_separate_launches(splits, norm, dtype):
    """Qwen3-Next rotates the first quarter of each head: the decode launch given tables that narrow rotates
    those dims of q and the new keys and leaves the others as they are, giving the cache the bits of the head
    norm, the rotary kernel on the rotated dims and the cache store as separate launches, and their output to
    rounding; a launch that rotated whole heads would store other keys."""
    block_size, head_dim, rotary_dim, num_heads, num_kv_heads = 8, 32, 8, 4, 2
    inputs = _new_token_inputs([0, 1, 9, 26], num_heads, num_kv_heads, head_dim, rotary_dim, dtype, norm, 7 + splits)
    cache, cos, sin, qkv, head_norm = inputs.cache, inputs.cos, inputs.sin, inputs.qkv, inputs.head_norm
    slots, context_lens, scale = inputs.slots, inputs.context_lens, inputs.scale

    qk = qkv[:, :num_heads + num_kv_heads].clone()
    if norm:
        fused_ops.qk_rms_norm_(qk, num_heads, *head_norm)
    fused_ops.apply_rotary_(qk[..., :rotary_dim], inputs.positions, cos, sin)
    pa.store_kv_cache(qk[:, num_heads:], qkv[:, num_heads + num_kv_heads:], cache.k, cache.v, slots)
    expected = pd.paged_decode_attention(qk[:, :num_heads], cache.k, cache.v, cache.block_tables, context_lens,
                                         scale, block_size, splits)

    new = pd.NewTokens(qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:], slots, cos,
                       sin, head_norm)
    got = pd.paged_decode_attention(qkv[:, :num_heads], inputs.k_cache, inputs.v_cache, cache.block_tables,
                                    context_lens, scale, block_size, splits, new_tokens=new)

    _assert_as_separate_launches(got, expected, inputs, norm, dtype)
    stored = slots[slots >= 0]
    unrotated = cache.k.view(-1, num_kv_heads, head_dim)[stored, :, rotary_dim:]
    assert not torch.equal(unrotated, torch.zeros_like(unrotated))  # the dims past the rotation were stored too
    whole = RotaryEmbedding(head_dim, 128, 10000.0, None, dtype)
    k_whole = cache.k.clone()
    pd.paged_decode_attention(qkv[:, :num_heads], k_whole, cache.v.clone(), cache.block_tables, context_lens, scale,
                              block_size, splits, new_tokens=pd.NewTokens(
                                  new.keys, new.values, slots, whole.cos.to(DEVICE), whole.signed_sin.to(DEVICE),
                                  head_norm))
    assert not torch.equal(k_whole, cache.k)
    assert _shared_counts_are_zero()


@pytest.mark.parametrize("splits", [1, 3, 20])
def test_decode_that_gates_its_output_equals_decode_then_the_sigmoid_gate(splits):
    """Gated attention's output gate in the decode launch: the output times sigmoid(gate), the gate strided as
    the q projection leaves it, the bits of decode then sigmoid_gate_; with one split, with splits joined in the
    launch, and with the second kernel joining them (20 splits)."""
    dtype = torch.float32
    lengths, num_heads, num_kv_heads, head_dim, block_size = [0, 5, 40], 4, 2, 16, 8
    cache = PagedCache(lengths, num_kv_heads, head_dim, block_size, dtype, seed=30 + splits)
    q_gate = torch.randn(len(lengths), num_heads, 2, head_dim, generator=cache.generator).to(DEVICE)
    q, gate = q_gate[:, :, 0], q_gate[:, :, 1]
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    plain = pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, lens, 0.25, block_size, splits)
    want = fused_ops.sigmoid_gate_(plain.reshape(len(lengths), -1).clone(), gate)
    got = pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, lens, 0.25, block_size, splits,
                                    gate=gate)
    assert torch.equal(got.reshape(len(lengths), -1), want)
    assert not torch.equal(got, plain)
    with pytest.raises(ValueError, match=r"gate: \(3, 4, 8\) torch.float32; needs \(3, 4, 16\)"):
        pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, lens, 0.25, block_size, splits,
                                  gate=gate[..., :8])
    assert _shared_counts_are_zero()


def test_decode_rejects_new_tokens_that_do_not_fit_the_batch():
    cache = PagedCache([20], 2, 16, 8, torch.float32, seed=12)
    q = torch.randn(1, 4, 16, generator=cache.generator).to(DEVICE)
    rope = RotaryEmbedding(16, 64, 10000.0, None, torch.float32)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    slot = torch.tensor([3], device=DEVICE)
    wrong = pd.NewTokens(torch.zeros(1, 1, 16, device=DEVICE), torch.zeros(1, 2, 16, device=DEVICE), slot,
                         rope.cos.to(DEVICE), rope.signed_sin.to(DEVICE))
    with pytest.raises(ValueError, match=r"new keys: \(1, 1, 16\) torch.float32; decode of this batch needs "
                                         r"\(1, 2, 16\)"):
        pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, lens, 0.25, 8, 1, new_tokens=wrong)
    wide = RotaryEmbedding(32, 64, 10000.0, None, torch.float32)
    too_wide = pd.NewTokens(torch.zeros(1, 2, 16, device=DEVICE), torch.zeros(1, 2, 16, device=DEVICE), slot,
                            wide.cos.to(DEVICE), wide.signed_sin.to(DEVICE))
    with pytest.raises(ValueError, match=r"rotary table cos: \(64, 32\) torch.float32; needs rows of an even width "
                                         r"up to 16"):
        pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, lens, 0.25, 8, 1, new_tokens=too_wide)
    keys = torch.zeros(1, 2, 16, device=DEVICE)
    half_weight = torch.ones(16, dtype=torch.float16, device=DEVICE)
    wrong_norm = pd.NewTokens(keys, keys, slot, rope.cos.to(DEVICE), rope.signed_sin.to(DEVICE),
                              (half_weight, half_weight, 1e-6))
    with pytest.raises(ValueError, match=r"weight must be \[16\] in torch.float32, got \(16,\) torch.float16"):
        pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, lens, 0.25, 8, 1, new_tokens=wrong_norm)


def test_choose_num_splits():
    assert pd.choose_num_splits(1, 8, 4096) == 16  # wants 33 for 2 programs per SM, 4096 // 256 caps it
    assert pd.choose_num_splits(1, 1, 100_000) == 32
    assert pd.choose_num_splits(256, 8, 4096) == 1
    assert pd.choose_num_splits(4, 8, 100) == 1
    assert pd.choose_num_splits(2, 8, 8192, num_sms=66) == 9


# ---------------------------------------------------------------------------------------------------------------
# Prefill


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_matches_reference(dtype):
    # (new tokens, context including them): a full prompt not a multiple of the block size, a one-token prompt,
    # a one-token chunk and a longer chunk after a cached prefix, a chunk spanning two query tiles.
    seqs = [(5, 5), (1, 1), (1, 30), (20, 45), (70, 90), (33, 33)]
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    cache = PagedCache([c for _, c in seqs], num_kv_heads, head_dim, block_size, dtype, seed=3)
    lens = [n for n, _ in seqs]
    total = sum(lens)
    qkv = torch.randn(total, num_heads + 2 * num_kv_heads, head_dim, generator=cache.generator)
    q = qkv.to(dtype).to(DEVICE)[:, :num_heads]
    query_start = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    context_lens = torch.tensor([c for _, c in seqs], dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5

    out = pa.paged_prefill_attention(q, cache.k, cache.v, cache.block_tables, query_start, context_lens,
                                     max(lens), scale, block_size)

    assert out.shape == q.shape and out.dtype == dtype
    start = 0
    for s, (n, c) in enumerate(seqs):
        k, v = cache.context(s, c)
        ref = reference_attention(q[start:start + n], k, v, torch.arange(c - n, c, device=DEVICE), scale)
        assert_attention_close(out[start:start + n], ref, dtype)
        start += n


def test_prefill_and_decode_agree_on_last_token():
    """A prompt's last row in prefill equals decode of that token over the same context."""
    num_heads, num_kv_heads, head_dim, block_size, n = 8, 2, 16, 8, 41
    cache = PagedCache([n], num_kv_heads, head_dim, block_size, torch.float32, seed=4)
    q = torch.randn(n, num_heads, head_dim, generator=cache.generator).to(DEVICE)
    lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    prefill = pa.paged_prefill_attention(q, cache.k, cache.v, cache.block_tables,
                                         torch.tensor([0, n], dtype=torch.int32, device=DEVICE), lens, n, 0.25,
                                         block_size)
    decode = pd.paged_decode_attention(q[-1:], cache.k, cache.v, cache.block_tables, lens, 0.25, block_size, 2)
    torch.testing.assert_close(decode[0], prefill[-1], atol=2e-6, rtol=2e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="model-sized heads are too slow for the interpreter")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_model_sized_heads(dtype, head_dim):
    """Every tile configuration (they depend on head_dim and dtype) on longer contexts."""
    seqs = [(150, 150), (77, 300), (1, 200)]
    num_heads, num_kv_heads, block_size = 8, 2, 16
    cache = PagedCache([c for _, c in seqs], num_kv_heads, head_dim, block_size, dtype, seed=head_dim)
    lens = [n for n, _ in seqs]
    q = torch.randn(sum(lens), num_heads, head_dim, generator=cache.generator).to(dtype).to(DEVICE)
    query_start = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    context_lens = torch.tensor([c for _, c in seqs], dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    prefill = pa.paged_prefill_attention(q, cache.k, cache.v, cache.block_tables, query_start, context_lens,
                                         max(lens), scale, block_size)
    last_rows = query_start[1:].long() - 1
    decode = pd.paged_decode_attention(q[last_rows], cache.k, cache.v, cache.block_tables, context_lens, scale,
                                       block_size, 3)
    start = 0
    for s, (n, c) in enumerate(seqs):
        k, v = cache.context(s, c)
        ref = reference_attention(q[start:start + n], k, v, torch.arange(c - n, c, device=DEVICE), scale)
        assert_attention_close(prefill[start:start + n], ref, dtype)
        assert_attention_close(decode[s:s + 1], ref[-1:], dtype)
        start += n


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_decode_replays_in_cuda_graph_with_new_lengths():
    cache, q, context_lens, _ = _decode_case(torch.bfloat16, 16, num_heads=8, num_kv_heads=2)
    scale = q.shape[-1] ** -0.5
    q = q.contiguous()

    def run():
        return pd.paged_decode_attention(q, cache.k, cache.v, cache.block_tables, context_lens, scale, 16, 4)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    context_lens.copy_(torch.tensor([3, 0, 16, 90, 1, 95], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run())


# ---------------------------------------------------------------------------------------------------------------
# Fused ops


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As shardserve.layers.norm.RMSNorm computes it without the kernel."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_query_and_key_head_norms_in_place_on_a_fused_projection(dtype):
    """Qwen3's q_norm and k_norm in one launch on the q and k heads of a qkv output (a strided view): each head
    as RMSNorm computes it with its own weight; the values beside them untouched."""
    g = torch.Generator().manual_seed(3)
    tokens, nq, nkv, hd, eps = 5, 6, 2, 32, 1e-6
    qkv = (3 * torch.randn(tokens, (nq + 2 * nkv) * hd, generator=g)).to(dtype)
    q_weight, k_weight = ((1 + 0.1 * torch.randn(hd, generator=g)).to(dtype) for _ in range(2))
    qk_ref = qkv[:, :(nq + nkv) * hd].view(tokens, -1, hd)
    want = torch.cat((reference_rms_norm(qk_ref[:, :nq], q_weight, eps),
                      reference_rms_norm(qk_ref[:, nq:], k_weight, eps)), dim=1)
    on_device = qkv.to(DEVICE)
    qk = on_device[:, :(nq + nkv) * hd].view(tokens, -1, hd)
    assert fused_ops.qk_rms_norm_(qk, nq, q_weight.to(DEVICE), k_weight.to(DEVICE), eps) is qk
    if dtype == torch.float32:
        torch.testing.assert_close(qk.cpu(), want, atol=1e-6, rtol=1e-6)
    else:
        _mostly_identical(qk.cpu(), want)
    assert torch.equal(on_device[:, (nq + nkv) * hd:].cpu(), qkv[:, (nq + nkv) * hd:])


def reference_rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     signed_sin: torch.Tensor) -> torch.Tensor:
    cos, signed_sin = cos[positions].unsqueeze(1), signed_sin[positions].unsqueeze(1)
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def _mostly_identical(out: torch.Tensor, ref: torch.Tensor) -> None:
    """16-bit results: equal to the reference except rare last-bit flips of float32 intermediates."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert (out == ref).float().mean().item() > 0.99
    torch.testing.assert_close(out, ref)  # the dtype's default tolerance, about one unit in the last place


@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_add(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    eps = 1e-5
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    x = (3 * torch.randn(2, 5, hidden, generator=g)).to(dtype)
    residual = torch.randn(2, 5, hidden, generator=g).to(dtype)
    ref_out = reference_rms_norm(x, weight, eps)
    ref_sum = x + residual
    ref_fused = reference_rms_norm(ref_sum, weight, eps)
    weight, x, residual = weight.to(DEVICE), x.to(DEVICE), residual.to(DEVICE)

    out = fused_ops.rms_norm(x, weight, eps)
    x_ptr, r_ptr = x.data_ptr(), residual.data_ptr()
    fused, summed = fused_ops.fused_add_rms_norm(x, residual, weight, eps)

    assert fused.data_ptr() == x_ptr and summed.data_ptr() == r_ptr  # in place
    assert torch.equal(summed.cpu(), ref_sum)
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref_out, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(fused.cpu(), ref_fused, atol=1e-6, rtol=1e-6)
    else:
        _mostly_identical(out.cpu(), ref_out)
        _mostly_identical(fused.cpu(), ref_fused)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(5)
    for shape in [(3, 2 * 200), (2, 3, 2 * 64)]:
        x = (4 * torch.randn(shape, generator=g)).to(dtype)
        gate, up = x.chunk(2, dim=-1)
        ref = F.silu(gate) * up
        out = fused_ops.silu_and_mul(x.to(DEVICE)).cpu()
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        else:
            _mostly_identical(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_bit_exact_and_in_place(dtype):
    g = torch.Generator().manual_seed(6)
    head_dim, q_heads, kv_heads, tokens = 32, 4, 2, 9
    rope = RotaryEmbedding(head_dim, 128, 500000.0, None, dtype)
    qkv = torch.randn(tokens, q_heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 128, (tokens,), generator=g)
    ref = reference_rotary(qkv[:, :q_heads + kv_heads], positions, rope.cos, rope.signed_sin)

    qkv = qkv.to(DEVICE)
    untouched = qkv[:, q_heads + kv_heads:].clone()
    qk = qkv[:, :q_heads + kv_heads]  # query and key heads of the fused projection: a strided view
    got = fused_ops.apply_rotary_(qk, positions.to(torch.int32).to(DEVICE), rope.cos.to(DEVICE),
                                  rope.signed_sin.to(DEVICE))

    assert got is qk
    assert torch.equal(qkv[:, :q_heads + kv_heads].cpu(), ref)
    assert torch.equal(qkv[:, q_heads + kv_heads:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_fused_with_the_cache_write_equals_the_two_kernels(dtype):
    """One launch gives the same rotated heads and the same cache as apply_rotary_ then store_kv_cache; padding
    rows (slot -1) are rotated but not stored."""
    g = torch.Generator().manual_seed(8)
    head_dim, q_heads, kv_heads, tokens, slots = 32, 6, 2, 7, 40
    rope = RotaryEmbedding(head_dim, 128, 500000.0, None, dtype)
    cos, sin = rope.cos.to(DEVICE), rope.signed_sin.to(DEVICE)
    qkv = torch.randn(tokens, q_heads + 2 * kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    positions = torch.randint(0, 128, (tokens,), generator=g).to(DEVICE)
    slot_mapping = torch.tensor([3, 9, -1, 0, 39, 17, -1], device=DEVICE)
    cache = torch.randn(2, slots, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)

    expected_qkv, expected_cache = qkv.clone(), cache.clone()
    fused_ops.apply_rotary_(expected_qkv[:, :q_heads + kv_heads], positions, cos, sin)
    pa.store_kv_cache(expected_qkv[:, q_heads:q_heads + kv_heads], expected_qkv[:, q_heads + kv_heads:],
                      expected_cache[0], expected_cache[1], slot_mapping)

    qk = qkv[:, :q_heads + kv_heads]
    got = fused_ops.apply_rotary_and_store_(qk, q_heads, qkv[:, q_heads + kv_heads:], positions, cos, sin,
                                            cache[0], cache[1], slot_mapping)
    assert got is qk
    assert torch.equal(qkv, expected_qkv)
    assert torch.equal(cache, expected_cache)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_norm_rotary_and_cache_write_in_one_launch_equal_the_two_kernels(dtype):
    """Qwen3: the per-head norms inside the rotary kernel give what qk_rms_norm_ then the rotary kernel give."""
    g = torch.Generator().manual_seed(9)
    head_dim, q_heads, kv_heads, tokens, slots, eps = 32, 6, 2, 5, 20, 1e-6
    rope = RotaryEmbedding(head_dim, 128, 1000000.0, None, dtype)
    cos, sin = rope.cos.to(DEVICE), rope.signed_sin.to(DEVICE)
    qkv = (3 * torch.randn(tokens, q_heads + 2 * kv_heads, head_dim, generator=g)).to(dtype).to(DEVICE)
    q_weight, k_weight = ((1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE) for _ in range(2))
    positions = torch.randint(0, 128, (tokens,), generator=g).to(DEVICE)
    slot_mapping = torch.tensor([3, -1, 0, 19, 7], device=DEVICE)
    cache = torch.zeros(2, slots, kv_heads, head_dim).to(dtype).to(DEVICE)

    expected_qkv, expected_cache = qkv.clone(), cache.clone()
    qk = expected_qkv[:, :q_heads + kv_heads]
    fused_ops.qk_rms_norm_(qk, q_heads, q_weight, k_weight, eps)
    fused_ops.apply_rotary_and_store_(qk, q_heads, expected_qkv[:, q_heads + kv_heads:], positions, cos, sin,
                                      expected_cache[0], expected_cache[1], slot_mapping)

    fused_ops.apply_rotary_and_store_(qkv[:, :q_heads + kv_heads], q_heads, qkv[:, q_heads + kv_heads:], positions,
                                      cos, sin, cache[0], cache[1], slot_mapping, (q_weight, k_weight, eps))
    if dtype == torch.float32:
        torch.testing.assert_close(qkv, expected_qkv, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(cache, expected_cache, atol=1e-6, rtol=1e-6)
    else:
        _mostly_identical(qkv.cpu(), expected_qkv.cpu())
        _mostly_identical(cache.cpu(), expected_cache.cpu())


# -- batch-1 GEMV -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,block_k", [(48, 256, 128), (37, 200, 64), (16, 96, 128)])
def test_gemv_matches_linear(dtype, n, k, block_k, set_env):
    """Rows not a multiple of the row block and K not a multiple of the column block are masked, not dropped."""
    from shardserve.kernels.triton.gemv import gemv, row_tiles

    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    expected = F.linear(x.float(), w.float())
    got = gemv(x, w, block_n=8, block_k=block_k, num_warps=4, num_stages=1)
    assert got.shape == (1, n) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tol * k ** 0.5, rtol=tol)
    # The first weight tiles loaded before the wait for the kernel before (dependent launch on GPUs) add the same
    # products in the same order: the same bits.
    for tiles in ("1", "2"):
        set_env(SHARDSERVE_GEMV_PRELOAD=tiles)
        assert torch.equal(gemv(x, w, block_n=8, block_k=block_k, num_warps=4, num_stages=1), got), tiles
    # So do all of the row's tiles (the o projection's form, loaded while attention runs).
    all_tiles = row_tiles(k, block_k)
    assert torch.equal(gemv(x, w, 8, block_k, 4, 1, all_tiles), got)


def test_batch1_kernel_uses_the_chosen_shape_only(monkeypatch):
    """The Triton path runs for one-row inputs on weights of a chosen shape; anything else goes to F.linear."""
    from shardserve.kernels.triton import gemv as gemv_module
    from shardserve.layers.cuda_gemv import Batch1GemvKernel

    calls = []
    original = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: calls.append(a[1].shape) or original(*a, **kw))
    kernel = Batch1GemvKernel({(24, 64): (8, 64, 4, 1)}, {}, {})
    for shape, rows, triton_expected in (((24, 64), 1, True), ((24, 64), 3, False), ((16, 64), 1, False)):
        w, bias = torch.randn(*shape, device=DEVICE), torch.randn(shape[0], device=DEVICE)
        x = torch.randn(rows, 64, device=DEVICE)
        calls.clear()
        torch.testing.assert_close(kernel(x, w, bias), F.linear(x, w, bias), atol=1e-4, rtol=1e-4)
        assert bool(calls) == triton_expected, (shape, rows)


def test_the_o_projection_loads_its_whole_rows_before_the_wait(monkeypatch):
    """A configuration with a fifth element (chosen for the o projection among forms that hold its rows) runs the
    GEMV with that many tiles loaded before its wait, and its attention block then lets it launch at attention's
    start. A form holds the rows where they fit in ROW_PRELOAD_MAX_BYTES a thread and every program is placed at
    once: Qwen3-30B-A3B's 2048x4096 o projection on 132 SMs, not Llama-3-8B's 4096x4096."""
    from torch import nn

    from shardserve.kernels.triton import gemv as gemv_module
    from shardserve.layers.attention import PagedAttention, overlap_with_o_projection
    from shardserve.layers.cuda_gemv import ROW_PRELOAD_MAX_BYTES, Batch1GemvKernel, _row_preload_forms
    from shardserve.layers.linear import RowParallelLinear

    seen = []
    original = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: seen.append(a[2:]) or original(*a, **kw))
    kernel = Batch1GemvKernel({(24, 64): (8, 16, 4, 1, 4), (24, 32): (8, 16, 4, 1)}, {}, {})
    w, x = torch.randn(24, 64, device=DEVICE), torch.randn(1, 64, device=DEVICE)
    torch.testing.assert_close(kernel(x, w, None), F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert seen == [(8, 16, 4, 1, 4)]

    forms = _row_preload_forms((2048, 4096), 132)
    assert (4, 1024, 8, 4, 4) in forms and (8, 512, 4, 1, 8) not in forms  # 128 and 512 bytes a thread
    assert all(tiles * bk >= 4096 and bn * bk * tiles * 2 <= ROW_PRELOAD_MAX_BYTES * warps * 32
               and 2048 // bn <= 132 * 1024 // (warps * 32) for bn, bk, warps, _, tiles in forms)
    assert _row_preload_forms((4096, 4096), 132) == []  # 1,024 programs: half of them would wait for a place

    blocks = []
    for k in (64, 32):  # an o projection with the preloading form, one without
        block = nn.Module()
        block.attn, block.o_proj = PagedAttention(2, 1, 32, (0, 0)), RowParallelLinear((0, k), 24, False,
                                                                                      torch.float32, None)
        block.o_proj.preloads_rows, block.o_proj.kernel = True, kernel
        blocks.append(block)
    assert overlap_with_o_projection(nn.ModuleList(blocks)) == 1
    assert [b.attn.launches_next_early for b in blocks] == [True, False]


def test_a_down_projection_without_its_fused_form_runs_the_plain_winner(monkeypatch):
    """Where the SwiGLU-fused GEMV lost its timing, the layer runs SwiGLU and then the Triton GEMV chosen for
    its shape (what the fused form was timed against), not cuBLAS."""
    from shardserve.kernels.triton import gemv as gemv_module
    from shardserve.layers.cuda_gemv import Batch1GemvKernel

    calls = []
    original = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: calls.append(a[1].shape) or original(*a, **kw))
    kernel = Batch1GemvKernel({(24, 64): (8, 64, 4, 1)}, {}, {})
    gate_up, w = torch.randn(1, 128, device=DEVICE), torch.randn(24, 64, device=DEVICE)
    expected = F.linear(F.silu(gate_up[:, :64]) * gate_up[:, 64:], w)
    torch.testing.assert_close(kernel.swiglu(gate_up, w), expected, atol=1e-4, rtol=1e-4)
    assert calls == [(24, 64)]


@triton.jit
def _word_round_trip(x_ptr, out_ptr, epochs_ptr, n_cols, BLOCK: tl.constexpr, PACK: tl.constexpr):
    words = with_epoch(_ll_payload(x_ptr, 0, n_cols, BLOCK, PACK), tl.load(epochs_ptr) + 0)
    tl.store(epochs_ptr + 1 + tl.arange(0, BLOCK // PACK), (words >> 32).to(tl.int32))
    cols = tl.arange(0, BLOCK)
    tl.store(out_ptr + cols, ll_values(words, x_ptr.dtype.element_ty, BLOCK, PACK), mask=cols < n_cols)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_all_reduce_word_format_keeps_every_bit(dtype):
    """The low-latency all-reduce sends a row as 8-byte words of 4 value bytes and the call's epoch; the
    receiving side's decoding gives back the row bit for bit, and reads the epoch."""
    n_cols, block = 94, 128
    pack = 4 // torch.empty(0, dtype=dtype).element_size()
    x = torch.randn(n_cols, device=DEVICE).to(dtype)
    x[:4] = torch.tensor([-0.0, float("inf"), -3.5e-5, 65000 if dtype == torch.float16 else -1e30])
    out = torch.zeros_like(x)
    epochs = torch.full((1 + block // pack,), 0, dtype=torch.int32, device=DEVICE)
    epochs[0] = 123456
    _word_round_trip[(1,)](x, out, epochs, n_cols, BLOCK=block, PACK=pack)
    assert torch.equal(out.view(torch.int16 if pack == 2 else torch.int32),
                       x.view(torch.int16 if pack == 2 else torch.int32))
    assert (epochs[1:] == 123456).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,block_k", [(40, 128, 64), (19, 100, 64)])
def test_gemv_with_swiglu_input_matches_the_two_kernels(dtype, n, k, block_k):
    """down(silu(gate) * up) in one launch: the activation is rounded as the SwiGLU kernel rounds it."""
    from shardserve.kernels.triton.gemv import gemv_swiglu

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    gate_up = torch.randn(1, 2 * k, generator=g).mul_(3).to(DEVICE, dtype)
    expected = F.linear(fused_ops.silu_and_mul(gate_up).float(), w.float())
    got = gemv_swiglu(gate_up, w, block_n=8, block_k=block_k, num_warps=4, num_stages=1)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tol * k ** 0.5, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_gemv_with_the_norm_before_it_matches_norm_then_linear(dtype, with_residual, set_env):
    """RMSNorm(x + residual) @ W^T in one launch, and the new residual x + residual exactly; the same bits
    whatever number of weight tiles is loaded before the norm."""
    from shardserve.kernels.triton.gemv import gemv_rmsnorm

    n, k = 24, 192
    g = torch.Generator().manual_seed(11)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    residual = torch.randn(1, k, generator=g).to(DEVICE, dtype) if with_residual else None
    norm_weight = torch.rand(k, generator=g).add_(0.5).to(DEVICE, dtype)
    if with_residual:
        h, expected_sum = fused_ops.fused_add_rms_norm(x.clone(), residual.clone(), norm_weight, 1e-5)
    else:
        h, expected_sum = fused_ops.rms_norm(x, norm_weight, 1e-5), x
    y, summed = gemv_rmsnorm(x, residual, norm_weight, 1e-5, w, block_n=8, block_k=64, num_warps=4, num_stages=1)
    assert torch.equal(summed, expected_sum)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), F.linear(h.float(), w.float()), atol=tol * k ** 0.5, rtol=tol)
    # Kept for the layers beside this one (an MoE's experts beside its router).
    kept_y, kept_sum, normed = gemv_rmsnorm(x, residual, norm_weight, 1e-5, w, block_n=8, block_k=64, num_warps=4,
                                            num_stages=1, keep_normed=True)
    assert torch.equal(kept_sum, expected_sum) and torch.equal(kept_y, y)
    # The norm's own output, to its rounding (the two kernels sum the squares in different orders).
    torch.testing.assert_close(normed.float(), h.float(), atol=0, rtol=1e-6 if dtype == torch.float32 else 8e-3)
    for tiles in ("0", "2"):  # the default is one
        set_env(SHARDSERVE_GEMV_PRELOAD=tiles)
        again = gemv_rmsnorm(x, residual, norm_weight, 1e-5, w, block_n=8, block_k=64, num_warps=4, num_stages=1,
                             keep_normed=True)
        assert all(torch.equal(a, b) for a, b in zip(again, (kept_y, kept_sum, normed))), f"{tiles} tiles preloaded"
    whole = gemv_rmsnorm(x, residual, norm_weight, 1e-5, w, block_n=8, block_k=64, num_warps=4, num_stages=1,
                         keep_normed=True, preload=3)  # a router's whole rows: all three tiles
    assert all(torch.equal(a, b) for a, b in zip(whole, (kept_y, kept_sum, normed)))


def test_a_routers_programs_load_as_much_of_their_rows_before_the_wait_as_fits(set_env):
    """whole_row_tiles: all of a program's rows where they fit in WHOLE_ROWS_MAX_BYTES a thread, else as many tiles
    as do, never fewer than SHARDSERVE_GEMV_PRELOAD's; a mixture of experts' router asks for it."""
    from shardserve.layers.cuda_gemv import WHOLE_ROWS_MAX_BYTES, whole_row_tiles
    from shardserve.layers.moe import SparseMoE

    router = torch.empty(512, 2048, dtype=torch.bfloat16)
    assert WHOLE_ROWS_MAX_BYTES == 256
    assert whole_row_tiles((16, 512, 8, 1), router) == 4  # 16 rows of 4 KB over 256 threads: 256 bytes a thread
    assert whole_row_tiles((32, 512, 8, 1), router) == 2  # 512 a thread for all 4: the 2 tiles that fit
    assert whole_row_tiles((8, 512, 4, 1), router) == 4
    set_env(SHARDSERVE_GEMV_PRELOAD="2")
    assert whole_row_tiles((64, 512, 4, 1), router) == 2  # none fits: the default stands
    comm = type("Whole", (), {"rank": 0, "world_size": 1})()
    moe = SparseMoE(64, 32, 4, 2, True, comm, torch.float32, shared_intermediate_size=32)
    assert moe.gate.loads_whole_rows and not moe.shared_expert_gate.loads_whole_rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("features,block_n", [(12, 8), (13, 4), (3, 16)])
def test_gemv_with_swiglu_output_equals_the_product_then_swiglu(dtype, features, block_n):
    """A [gate | up] projection whose launch returns silu(gate) * up: the same bits as the product followed by the
    SwiGLU kernel, plain and with the norm inside (then the new residual too); features not a multiple of a
    program's share are masked, not dropped."""
    from shardserve.kernels.triton.gemv import gemv, gemv_rmsnorm

    k = 96
    g = torch.Generator().manual_seed(features * block_n)
    w = torch.randn(2 * features, k, generator=g).to(DEVICE, dtype)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    residual = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    norm_weight = torch.rand(k, generator=g).add_(0.5).to(DEVICE, dtype)
    config = (block_n, 64, 4, 1)
    got = gemv(x, w, *config, swiglu_out=True)
    assert got.shape == (1, features) and got.dtype == dtype
    assert torch.equal(got, fused_ops.silu_and_mul(gemv(x, w, *config)))
    got, summed = gemv_rmsnorm(x, residual, norm_weight, 1e-5, w, *config, swiglu_out=True)
    product, expected_sum = gemv_rmsnorm(x, residual, norm_weight, 1e-5, w, *config)
    assert torch.equal(got, fused_ops.silu_and_mul(product)) and torch.equal(summed, expected_sum)


def test_a_swiglu_output_gemv_names_what_it_needs():
    from shardserve.kernels.triton.gemv import gemv

    with pytest.raises(ValueError, match="even number of weight rows and block_n, got 7 rows"):
        gemv(torch.randn(1, 64, device=DEVICE), torch.randn(7, 64, device=DEVICE), 8, 64, 4, 1, swiglu_out=True)
    with pytest.raises(ValueError, match="block_n 3"):
        gemv(torch.randn(1, 64, device=DEVICE), torch.randn(8, 64, device=DEVICE), 3, 64, 4, 1, swiglu_out=True)


@pytest.mark.parametrize("form", ["plain", "normed"])
def test_an_mlp_takes_swiglu_from_its_gate_up_launch_where_chosen(form, monkeypatch):
    """Where start-up chose a SwiGLU-out form for the gate/up shape, the MLP's single-token step runs the gate/up
    GEMV with SwiGLU inside and the down projection on its output (no SwiGLU launch between), with the output and
    the new residual of the path without that form."""
    from shardserve.kernels.triton import gemv as gemv_module
    from shardserve.layers import cuda_gemv, linear
    from shardserve.layers.cuda_gemv import Batch1GemvKernel
    from shardserve.layers.mlp import SwiGLUMLP
    from shardserve.layers.norm import RMSNorm

    hidden, features, dtype = 64, 24, torch.float32
    g = torch.Generator().manual_seed(3)
    mlp = SwiGLUMLP(hidden, (0, features), False, dtype, None, False).to(DEVICE)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.weight.data = (torch.randn(layer.weight.shape, generator=g) / 8).to(DEVICE, dtype)
    norm = RMSNorm(hidden, 1e-5, dtype).to(DEVICE)
    norm.weight.data = (0.5 + torch.rand(hidden, generator=g)).to(DEVICE, dtype)
    x, residual = (torch.randn(1, hidden, generator=g).to(DEVICE, dtype) for _ in range(2))
    config = (8, 64, 4, 1)
    plain = {(2 * features, hidden): config, (hidden, features): config}
    gate_up_shape = {(2 * features, hidden): config}
    fused = (Batch1GemvKernel(plain, {}, {}, gate_up_shape) if form == "plain"
             else Batch1GemvKernel(plain, {}, {}, {}, gate_up_shape))

    def run(kernel):
        mlp.gate_up_proj.kernel = mlp.down_proj.kernel = kernel
        return mlp.forward_normed(x.clone(), residual.clone(), norm)  # on CUDA the norm updates both in place

    # Against the same norm: the norm module, or the norm-fused GEMV without SwiGLU.
    expected = run(Batch1GemvKernel(plain, {}, {} if form == "plain" else gate_up_shape))
    swiglu_out, swiglu_launches = [], []
    original_gemv, original_normed = gemv_module.gemv, gemv_module.gemv_rmsnorm
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: swiglu_out.append(kw.get("swiglu_out", False))
                        or original_gemv(*a, **kw))
    monkeypatch.setattr(gemv_module, "gemv_rmsnorm", lambda *a, **kw: swiglu_out.append(kw.get("swiglu_out", False))
                        or original_normed(*a, **kw))
    for module in (cuda_gemv, linear):  # where the down projection would apply SwiGLU to a [gate | up] input
        monkeypatch.setattr(module, "silu_and_mul", lambda t, f=module.silu_and_mul: swiglu_launches.append(1) or f(t))
    got = run(fused)
    assert swiglu_out[0] and not any(swiglu_out[1:]) and not swiglu_launches  # gate/up with SwiGLU, then down
    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=1e-5)
    assert torch.equal(got[1], expected[1]) and got[2] is None


# ---------------------------------------------------------------------------------------------------------------
# Penalties


def test_fused_penalties_equal_the_dense_version():
    from shardserve.engine.sampler import _check_fused_penalties, _dense_penalties
    from shardserve.kernels.triton.penalties import apply_penalties

    g = torch.Generator().manual_seed(3)
    vocab = 4100  # two full blocks and a partial one
    logits = (torch.randn(4, vocab, generator=g) * 3).to(DEVICE)
    counts = torch.randint(0, 4, (5, vocab), generator=g).float().to(DEVICE)
    in_prompt = (torch.rand(5, vocab, generator=g) < 0.2).to(DEVICE)
    rows = torch.tensor([3, 1], device=DEVICE)
    slots = torch.tensor([0, 4], device=DEVICE)
    factors = torch.tensor([[1.2, 0.3, 0.7], [0.9, -0.5, 0.0]], device=DEVICE)
    fused, dense = logits.clone(), logits.clone()
    apply_penalties(fused, rows, slots, counts, in_prompt, factors)
    _dense_penalties(dense, rows, counts.index_select(0, slots), in_prompt.index_select(0, slots), factors)
    torch.testing.assert_close(fused, dense, rtol=0, atol=1e-6)
    assert torch.equal(fused[[0, 2]], logits[[0, 2]])  # rows without penalties untouched
    # The start-up comparison the sampler runs before it uses the kernel on a device passes here too.
    assert _check_fused_penalties(torch.device(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_start_up_check_passes_the_paged_backend_with_qwen3_head_norms(dtype, monkeypatch):
    """The backend normalises the heads inside its rotary kernel; the check (float64 norm, rotation, attention)
    goes through the layer as the model does, so a wrong fused norm would fail start-up."""
    from shardserve.attention.triton_paged import TritonPagedBackend
    from shardserve.engine import kernel_setup
    from shardserve.layers import rotary as rotary_module
    from shardserve.layers.attention import PagedAttention
    from shardserve.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(5)
    attn = PagedAttention(4, 2, 32, (0, 0, 1, 1))
    norms = (RMSNorm(32, 1e-6, dtype), RMSNorm(32, 1e-6, dtype))
    for norm in norms:
        norm.weight.data = (0.5 + torch.rand(32, generator=g)).to(dtype).to(DEVICE)
    attn.head_norm = norms
    rotary = RotaryEmbedding(32, 128, 10000.0, None, dtype).to(DEVICE)
    monkeypatch.setattr(rotary_module, "use_triton", lambda t: True)  # CPU tensors too: the kernel path
    backend = TritonPagedBackend(torch.device(DEVICE), 16, 2)
    result = kernel_setup.check_attention(backend, attn, rotary, dtype, torch.device(DEVICE), 16)
    assert result.passed, result.describe()


@pytest.mark.parametrize("mode", ["fused", "separate"])
def test_the_start_up_check_passes_the_paged_backend_with_a_partial_rotation(mode, monkeypatch, set_env):
    """Qwen3-Next rotates the first quarter of each head: the backend rotates those dims apart from its fused
    rotation (decode and prefill alike), checked against float64 attention over partially rotated heads."""
    from shardserve.attention.triton_paged import TritonPagedBackend
    from shardserve.engine import kernel_setup
    from shardserve.layers import rotary as rotary_module
    from shardserve.layers.attention import PagedAttention

    set_env(SHARDSERVE_DECODE_ROTARY=mode)
    attn = PagedAttention(4, 2, 32, (0, 0, 1, 1))
    rotary = RotaryEmbedding(8, 128, 10000.0, None, torch.float32).to(DEVICE)
    monkeypatch.setattr(rotary_module, "use_triton", lambda t: True)  # CPU tensors too: the kernel path
    backend = TritonPagedBackend(torch.device(DEVICE), 16, 2)
    result = kernel_setup.check_attention(backend, attn, rotary, torch.float32, torch.device(DEVICE), 16)
    assert result.passed, result.describe()


def test_sigmoid_gate_rounds_like_torch_on_a_strided_gate():
    """Gated attention's output gate in one launch: x * sigmoid(gate) in place, the gate read from every other
    head-sized block of a wider tensor (as q_proj's rows interleave query and gate), as torch computes it (the
    sigmoid rounded, then the product; exp may differ by an ulp of float32)."""
    from shardserve.kernels.triton.fused_ops import sigmoid_gate_

    g = torch.Generator().manual_seed(0)
    # The interpreter rounds to bfloat16 its own way: bfloat16 on GPUs only.
    for dtype in (torch.bfloat16, torch.float32) if CUDA else (torch.float32,):
        x = torch.randn(3, 4 * 24, generator=g).to(dtype).to(DEVICE)
        q_gate = torch.randn(3, 4, 2, 24, generator=g).to(dtype).to(DEVICE)
        gate = q_gate[:, :, 1]
        want = x * torch.sigmoid(gate.reshape(3, -1))
        got = sigmoid_gate_(x, gate)
        assert got.data_ptr() == x.data_ptr()  # in place
        torch.testing.assert_close(got, want)
