"""benchmarks/fp4_cuda_anatomy.py's variants must edit text that fp4_products.cu really has (an edit that found
nothing would time the kernels as they are under another name); its timings need a Hopper GPU (BENCHMARKS.md)."""

from __future__ import annotations

import os

import pytest

from benchmarks.fp4_cuda_anatomy import EDITS, FLOOR_SOURCE, PARTS, VARIANTS, edited_source, parse_variants
from shardserve.kernels.cuda import fp4_products

SOURCE = open(os.path.join(os.path.dirname(fp4_products.__file__), fp4_products.SOURCE)).read()


def test_every_edit_finds_its_text_once_and_every_part_is_in_a_variant():
    assert {part for v in VARIANTS for part in v.split("+")} == set(PARTS) | {"as-is"}
    for part, edits in EDITS.items():
        for old, new in edits:
            assert SOURCE.count(old) == 1, f"{part}: {old[:60]!r}"
            assert old != new
        assert edited_source(part, SOURCE) != SOURCE


def test_the_one_mask_decode_keeps_the_multiply_adds_and_drops_the_shifts():
    words = edited_source("one-mask", SOURCE)
    assert words.count("acc = fma2(") == SOURCE.count("acc = fma2(")
    assert "e2m1_pair<" not in words.split("static __device__ __forceinline__ u32 word_products")[1].split("}")[0]


def test_an_edit_whose_text_is_gone_names_its_part():
    with pytest.raises(ValueError, match="rotations: fp4_products.cu has 0 copies"):
        edited_source("rotations", SOURCE.replace("e2m1_pair<0>(q)", "e2m1_pair<0>(word)"))


def test_the_floor_probe_reads_the_experts_layouts_with_the_kernels_own_helpers():
    text = open(FLOOR_SOURCE).read()
    assert "one_launch_floor(" in text and "griddepcontrol.wait" in text and "atomicAdd(barrier, 1)" in text
    for helper in ("struct __align__(16) Chunk", "Chunk stream_chunk(const Chunk* p)", "float warp_sum(float t)"):
        assert helper in SOURCE and helper not in text  # compiled after fp4_products.cu's text, not beside a copy


def test_variants_are_named_from_the_list():
    assert parse_variants("as-is,one-mask+no-act-loads") == ["as-is", "one-mask+no-act-loads"]
    with pytest.raises(SystemExit, match="--variants takes names of as-is, one-mask"):
        parse_variants("as-is,fast")
