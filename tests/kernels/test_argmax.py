"""The greedy-token kernel gives exactly torch.argmax(logits.float(), -1): the first maximum, the first NaN, 0 for
a row of -inf, in every logits dtype, over split rows and whole-row programs alike.

On a machine without CUDA the kernel runs in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from shardserve.kernels.triton import argmax  # noqa: E402
from shardserve.kernels.triton.argmax import greedy_tokens  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(params=["split rows", "a program a row"])
def layout(request, monkeypatch):
    """Both ways the kernel covers a row: split into parts merged by a second launch (few rows), or one program
    streaming the whole row (many rows; forced here by aiming at a single program)."""
    if request.param == "a program a row":
        monkeypatch.setattr(argmax, "_PROGRAMS", 1)
    return request.param


def _expect_torch(logits: torch.Tensor) -> None:
    tokens = greedy_tokens(logits)
    assert tokens.dtype == torch.int64 and tokens.device == logits.device
    assert tokens.tolist() == torch.argmax(logits.float(), dim=-1).tolist()


def _random(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 4).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 4097, 20011])
def test_random_rows_give_torchs_argmax(dtype, vocab, layout):
    _expect_torch(_random(3, vocab, dtype, seed=vocab))


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_llama3_row_gives_torchs_argmax(dtype):
    _expect_torch(_random(1, 128256, dtype, seed=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_give_the_first_maximum(dtype, layout):
    """Tied maxima in one lane, in different lanes (a later lane holding the earlier index), in different parts."""
    logits = _random(5, 9000, dtype, seed=2)
    for row, positions in enumerate([(300, 300 + 2048, 4096 + 300), (2048, 2047), (8999, 4500, 6000),
                                     (0, 8999)]):
        logits[row, list(positions)] = 100.0
    logits[4] = torch.where(torch.rand(9000, generator=torch.Generator().manual_seed(3)) < 0.5, 0.0, -0.0)
    _expect_torch(logits)
    assert greedy_tokens(logits)[:4].tolist() == [300, 2047, 4500, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_counts_as_the_largest_and_the_first_nan_wins(dtype, layout):
    logits = _random(4, 9000, dtype, seed=4)
    logits[0, [7000, 5000]] = float("nan")
    logits[0, 10] = float("inf")
    logits[1, [8999, 4097]] = float("nan")
    logits[2] = float("nan")
    logits[3, 3] = float("inf")  # +inf without NaN: the first +inf
    logits[3, 6001] = float("inf")
    _expect_torch(logits)
    assert greedy_tokens(logits).tolist() == [5000, 4097, 0, 3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_minus_infinity_give_zero(dtype, layout):
    logits = torch.full((3, 9000), float("-inf"), dtype=dtype, device=DEVICE)
    logits[1, 6500] = -1e4  # one finite logit among -inf
    logits[2, 8000] = float("nan")
    _expect_torch(logits)
    assert greedy_tokens(logits).tolist() == [0, 6500, 8000]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_a_wider_tensor_are_read_through_their_stride(dtype, layout):
    wide = _random(3, 9000 + 123, dtype, seed=5)
    wide[:, :100] = 1e4  # outside the slice: must not be read
    logits = wide[:, 100:100 + 4097]
    assert not logits.is_contiguous()
    _expect_torch(logits)


def test_no_rows_give_no_tokens():
    tokens = greedy_tokens(torch.empty(0, 50, dtype=torch.bfloat16, device=DEVICE))
    assert tokens.shape == (0,) and tokens.dtype == torch.int64


def test_unsupported_logits_are_refused_with_their_layout():
    with pytest.raises(ValueError, match=r"unit stride in the last dim.*strides \(1, 3\)"):
        greedy_tokens(torch.zeros(4, 3, device=DEVICE).t())
    with pytest.raises(ValueError, match="torch.float64"):
        greedy_tokens(torch.zeros(2, 3, dtype=torch.float64, device=DEVICE))
