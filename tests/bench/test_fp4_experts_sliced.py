"""benchmarks/fp4_experts_sliced.py: what can go wrong before its GPU run (BENCHMARKS.md has the run): down weights
reordered into other bytes, a ring that does not fit a Hopper block, arguments out of the kernel's order, a probe
whose edit no longer finds its text, helpers copied rather than shared."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from benchmarks.cuda_probes import HERE, kernel_parameters
from benchmarks.fp4_experts_sliced import PROBES, SOURCES, STAMPS, launch_arguments, shared_bytes, sliced_down
from benchmarks.moe_packed_one_token import random_packed
from shardserve.kernels.cuda import fp4_products

PRODUCTS = open(os.path.join(os.path.dirname(fp4_products.__file__), fp4_products.SOURCE)).read()
HELPERS, TEXT = (open(os.path.join(HERE, name)).read() for name in SOURCES)
MAX_SHARED = 227 * 1024  # a Hopper block's dynamic shared memory at most


def test_the_sliced_order_holds_each_rows_16_columns_of_a_group_side_by_side():
    experts = random_packed("fp4", 3, 64, 48, 16, "cpu", "relu2")
    shared = SimpleNamespace(down=torch.randint(0, 256, (64, 2 * 48 // 2), dtype=torch.uint8),
                             down_scale=torch.randint(0, 256, (64, 2 * 48 // 16), dtype=torch.uint8))
    down = sliced_down(experts, shared)
    assert down.codes.shape == (3, 3, 64, 8) and down.scales.shape == (3, 3, 64)
    assert down.shared_codes.shape == (6, 64, 8) and down.shared_scales.shape == (6, 64)
    for e, g, h in ((0, 0, 0), (2, 1, 63), (1, 2, 17)):
        assert torch.equal(down.codes[e, g, h], experts.w2[e, h, 8 * g:8 * g + 8])
        assert down.scales[e, g, h] == experts.scale2[e, h, g]
    assert torch.equal(down.shared_codes[4, 5], shared.down[5, 32:40])  # slot 1's second group
    assert down.shared_scales[4, 5] == shared.down_scale[5, 4]
    assert all(t.is_contiguous() for t in down)


def test_a_ring_of_four_groups_fits_a_block_at_nemotron_nanos_width_and_five_would_not():
    assert shared_bytes(2688, 4) <= MAX_SHARED < shared_bytes(2688, 5)


def test_the_runner_passes_every_argument_the_kernel_declares_in_its_order():
    experts = random_packed("fp4", 4, 64, 32, 16, "cpu", "relu2")
    shared = SimpleNamespace(**{name: torch.zeros(n) for n, name in enumerate(
        ("up", "up_scale", "up_row_scale", "down_row_scale"))})
    down = SimpleNamespace(codes=torch.zeros(5), scales=torch.zeros(6), shared_codes=torch.zeros(7),
                           shared_scales=torch.zeros(8))
    x, weights, ids, sums, out = (torch.zeros(n) for n in (9, 10, 11, 12, 13))
    names = kernel_parameters(TEXT, "fp4_experts_sliced")
    args = launch_arguments(x, experts, weights, ids, shared, down, sums, out)
    assert len(args) == len(names) == 19
    by_name = dict(zip(names, args))
    assert by_name["q13"] is experts.w13 and by_name["shared_rs13"] is shared.up_row_scale
    assert by_name["q2"] is down.codes and by_name["rs2"] is experts.row2 and by_name["shared_s2"] is down.shared_scales
    assert by_name["shared_rs2"] is shared.down_row_scale and by_name["num_experts"] == 4
    assert by_name["sums"] is sums and by_name["out"] is out and by_name["stamps"] is None


def test_the_timeline_names_as_many_points_as_the_kernel_stamps():
    assert "constexpr int STAMPS = 2 + 2 * 9 + 2;" in TEXT and STAMPS == 22


def test_every_probe_edit_finds_its_text_once():
    for edits in PROBES.values():
        for old, _ in edits:
            assert (HELPERS + TEXT).count(old) == 1, old


def test_the_probe_uses_the_products_and_bulk_copy_helpers_rather_than_copies():
    assert "fp4_experts_sliced(" in TEXT and "cp.async.bulk" not in TEXT
    for helper in ("u32 word_products(u32 q, Chunk x, u32 acc)", "int block_pairs(", "float warp_sum(float t)"):
        assert helper in PRODUCTS and helper not in TEXT
    for helper in ("void bulk_copy(", "void bar_wait(", "float chunk_sum_held("):
        assert helper in HELPERS and helper not in TEXT
