"""GGUF blocks recovered from dequantized weights (exactly, or not at all), and the 4-/8-bit CPU kernel on
them: float64-accurate, and each row the same bits alone as inside a batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize, quantize

from shardserve.kernels.block_quant import recover_4bit, recover_8bit
from shardserve.layers.linear_kernels import BlockQuantDecodeKernel, build_linear_kernel


def _gguf_round_trip(n: int, k: int, qtype: QType, seed: int = 0) -> torch.Tensor:
    """What the loader holds for an [n, k] weight stored as qtype: the file's values dequantized to float32."""
    values = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * 0.05
    return torch.from_numpy(dequantize(quantize(values, qtype), qtype).copy())


@pytest.mark.parametrize("qtype, recover", [(QType.Q4_1, recover_4bit), (QType.Q4_0, recover_4bit),
                                            (QType.Q8_0, recover_8bit)])
def test_quantized_weights_recover_exactly_into_their_blocks(qtype, recover):
    w = _gguf_round_trip(96, 320, qtype)
    blocks = recover(w)
    assert blocks is not None
    if recover is recover_4bit:
        packed, d, m = blocks
        q = torch.cat([packed.view(96, 10, 16) & 15, packed.view(96, 10, 16) >> 4], dim=-1).float()
        assert torch.equal(d.unsqueeze(-1) * q + m.unsqueeze(-1), w.view(96, 10, 32))
    else:
        q, d = blocks
        assert torch.equal(d.unsqueeze(-1) * q.view(96, 10, 32).float(), w.view(96, 10, 32))


def test_weights_that_are_not_those_blocks_do_not_recover():
    assert recover_4bit(torch.randn(64, 128)) is None  # never quantized
    assert recover_8bit(torch.randn(64, 128)) is None
    w = _gguf_round_trip(64, 128, QType.Q4_1)
    assert recover_4bit(w[:, 16:112].contiguous()) is None  # a shard boundary inside a block
    assert recover_4bit(w[:, 32:96].contiguous()) is not None  # one on a block boundary
    assert recover_4bit(w[:, :100]) is None  # not whole blocks
    assert recover_8bit(_gguf_round_trip(64, 128, QType.Q4_1)) is None  # 16 levels in 255 is not Q8_0's grid


@pytest.fixture(scope="module")
def kernel() -> BlockQuantDecodeKernel:
    kernel, why = build_linear_kernel("blockq-decode")
    if kernel is None:
        pytest.skip(why)
    return kernel


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_0, QType.Q8_0])
@pytest.mark.parametrize("n, k", [(300, 96), (75, 576), (1, 32)])
def test_the_kernel_matches_float64_and_each_row_is_the_same_alone_and_batched(kernel, qtype, n, k):
    w = _gguf_round_trip(n, k, qtype, seed=n + k)
    prepared = kernel.prepare(w)
    assert len(prepared) == (3 if qtype == QType.Q8_0 else 4), "the blocks were not recovered"
    bias = torch.randn(n)
    x = torch.randn(5, k)
    reference = F.linear(x.double(), w.double(), bias.double())
    rows = [kernel(x[i:i + 1], prepared, bias) for i in range(5)]  # one row at a time: the 4/8-bit path
    for got in (torch.cat(rows), kernel(x[:2], prepared, bias), kernel(x, prepared, bias)):
        assert ((got.double() - reference[:len(got)]).norm() / reference[:len(got)].norm()).item() < 1e-6
    pair = kernel(x[:2], prepared, bias)
    assert torch.equal(pair, torch.cat(rows[:2])), "a row inside a pair differs from the same row alone"


def test_unrecovered_weights_run_on_the_float32_form(kernel):
    w = torch.randn(64, 96)
    prepared = kernel.prepare(w)
    assert len(prepared) == 1
    x = torch.randn(1, 96)
    assert torch.allclose(kernel(x, prepared, None), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_symmetric_gptq_groups_recover_as_q4_0_blocks(group):
    """w = s * (q - 8) with a float16 scale per group of input features: every block of 32 inside a group has
    Q4_0's form, whether or not it holds the group's largest weight (at level 7 or -7)."""
    g = torch.Generator().manual_seed(group)
    n, k = 48, 256
    scales = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).half().float()
    q = torch.randint(1, 16, (n, k), generator=g)
    q[:, 0] = 1  # each group's first block holds its extreme (-7 s); the others mostly do not
    w = (q - 8).float() * scales.repeat_interleave(group, dim=1)
    packed, d, m = recover_4bit(w)
    codes = torch.cat([packed.view(n, k // 32, 16) & 15, packed.view(n, k // 32, 16) >> 4], dim=-1).float()
    assert torch.equal(d.unsqueeze(-1) * codes + m.unsqueeze(-1), w.view(n, k // 32, 32))


@pytest.mark.parametrize("every_block_spans_all_codes", [True, False])
def test_asymmetric_gptq_groups_recover_exactly_or_not_at_all(every_block_spans_all_codes):
    """w = s * (q - z) with a float16 scale and a zero point per group of 128: a block of 32 whose codes run from
    0 to 15 has Q4_1's form (d = s, m = -z s) and comes back bit for bit; a block missing code 0 or 15 is not
    found, and then the whole weight stays unrecovered (None), never partly or approximately recovered."""
    g = torch.Generator().manual_seed(0)
    scales = (torch.rand(48, 2, generator=g) * 0.01 + 1e-3).half().float()
    zeros = torch.randint(3, 13, (48, 2), generator=g)
    q = torch.randint(0, 16, (48, 256), generator=g)
    if every_block_spans_all_codes:
        q[:, 0::32], q[:, 1::32] = 0, 15
    spans = (q.view(48, 8, 32).amin(-1) == 0) & (q.view(48, 8, 32).amax(-1) == 15)
    assert bool(spans.all()) == every_block_spans_all_codes and bool(spans.any())
    w = (q - zeros.repeat_interleave(128, dim=1)).float() * scales.repeat_interleave(128, dim=1)
    recovered = recover_4bit(w)
    if every_block_spans_all_codes:
        assert recovered is not None
        packed, d, m = recovered
        codes = torch.cat([packed.view(48, 8, 16) & 15, packed.view(48, 8, 16) >> 4], dim=-1).float()
        assert torch.equal(d.unsqueeze(-1) * codes + m.unsqueeze(-1), w.view(48, 8, 32))
    else:
        assert recovered is None, "blocks without codes 0 and 15 must leave the whole weight unrecovered"
        assert recover_4bit(w[:, :32][spans[:, 0]].contiguous()) is not None, "the blocks that span do recover"
