"""benchmarks/fp4_one_launch_specialised.py: what can go wrong before its GPU run (BENCHMARKS.md has the run): a
shared-memory layout that does not fit a Hopper block, arguments out of the kernel's order, a probe that copies the
helpers of the kernels it is measured against instead of using them."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from benchmarks.cuda_probes import kernel_parameters
from benchmarks.fp4_one_launch_specialised import (MAX_SHARED, SOURCE, fitting_shared_bytes, launch_arguments,
                                                   shared_bytes)
from benchmarks.moe_packed_one_token import random_packed
from shardserve.kernels.cuda import fp4_products

PRODUCTS = open(os.path.join(os.path.dirname(fp4_products.__file__), fp4_products.SOURCE)).read()
TEXT = open(SOURCE).read()
HELPERS = open(os.path.join(os.path.dirname(SOURCE), "fp4_bulk_copies.cu")).read()


def test_nemotron_nano_experts_fit_a_block_an_sm_of_an_h200_or_h100():
    # hidden 2688, expert width 1856, 6 routed choices and the shared expert's 2 slots, 132 SMs: 21 down rows a block
    nbytes = fitting_shared_bytes(2688, 1856, 132, 8)
    assert nbytes == shared_bytes(2688, 1856, 21, 8) <= MAX_SHARED
    assert shared_bytes(2688, 1856, 22, 8) > MAX_SHARED  # a row more a block would not


def test_a_gpu_with_too_few_sms_is_refused_by_name():
    with pytest.raises(ValueError, match=r"27 down rows of 8 choices .*\(hidden 2688 over 100 SMs\)"):
        fitting_shared_bytes(2688, 1856, 100, 8)


def test_the_runner_passes_every_argument_the_kernel_declares_in_its_order():
    experts = random_packed("fp4", 4, 64, 32, 16, "cpu", "relu2")
    shared = SimpleNamespace(up=torch.zeros(1), up_scale=torch.zeros(2), up_row_scale=torch.zeros(3),
                             down=torch.zeros(4), down_scale=torch.zeros(5), down_row_scale=torch.zeros(6))
    x, weights, ids, flagged, state, out = (torch.zeros(n) for n in (7, 8, 9, 10, 11, 12))
    args = launch_arguments(x, experts, weights, ids, shared, flagged, state, out, None)
    names = kernel_parameters(TEXT, "fp4_experts_one_launch")
    assert len(args) == len(names) == 21
    by_name = dict(zip(names, args))
    assert by_name["q"] is experts.w13 and by_name["rs2"] is experts.row2 and by_name["shared_s2"] is shared.down_scale
    assert (by_name["num_experts"], by_name["hidden"]) == (4, 64) and by_name["stamps"] is None
    assert by_name["flagged"] is flagged and by_name["out"] is out


def test_the_probe_uses_the_products_helpers_rather_than_copies():
    assert "fp4_experts_one_launch(" in TEXT and "bulk_rate(" in TEXT and "cp.async.bulk" in HELPERS
    assert "block_pairs<K, THREADS, BF16, 1>(" in TEXT  # x's pairs by the row warps alone, under named barrier 1
    for helper in ("struct __align__(16) Chunk", "u32 word_products(u32 q, Chunk x, u32 acc)", "int block_pairs(",
                   "void store_pairs(const float* f, float up, Chunk* xs, int b)", "float warp_sum(float t)"):
        assert helper in PRODUCTS and helper not in TEXT and helper not in HELPERS
    for helper in ("void bulk_copy(", "bool bar_try(", "float chunk_sum_held("):
        assert helper in HELPERS and helper not in TEXT
