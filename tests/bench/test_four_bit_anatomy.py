"""benchmarks/four_bit_anatomy.py's variants must replace what the 4-bit kernels really look up when they compile
(a renamed global would leave a variant timing the kernels as they are); its timings need a GPU (BENCHMARKS.md)."""

from __future__ import annotations

import inspect

import pytest

from benchmarks.four_bit_anatomy import ONE_AND, PARTS, VARIANTS, parse_variants, patches
from shardserve.kernels.triton import quant_gemv


def test_every_part_replaces_a_global_of_the_same_kind_that_the_kernels_use():
    table = patches()
    assert set(table) == set(PARTS)
    assert {part for v in VARIANTS for part in v.split("+")} == set(PARTS) | {"as-is"}
    for part, replacements in table.items():
        for module, name, value in replacements:
            assert hasattr(module, name), f"{part}: {module.__name__}.{name} is gone"
            assert type(getattr(module, name)) is type(value), f"{part}: {module.__name__}.{name}"
            sources = "".join(inspect.getsource(fn.fn) for fn in vars(module).values()  # jitted or interpreted
                              if inspect.isfunction(getattr(fn, "fn", None)))
            assert name in sources, f"{part}: no kernel of {module.__name__} uses {name}"


def test_the_one_and_decode_keeps_the_kernels_multiply_adds_and_operands():
    kernel = quant_gemv._FP4_PAIR_SUMS_ASM.value.splitlines()
    variant = ONE_AND.value.splitlines()
    fmas = [line for line in variant if "f16x2" in line]
    assert len(fmas) == 8 and all(line in kernel for line in fmas)
    # one AND a pair, where the kernel takes two masks (and two shifts)
    assert sum("and.b32" in line for line in variant) == 8 and sum("and.b32" in line for line in kernel) == 16


def test_variants_are_named_from_the_list():
    assert parse_variants("as-is,no-math+x-loaded") == ["as-is", "no-math+x-loaded"]
    with pytest.raises(SystemExit, match="--variants takes names of as-is, one-and"):
        parse_variants("as-is,fast")
