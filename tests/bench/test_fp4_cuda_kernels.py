"""benchmarks/fp4_cuda_kernels.py's flags: a malformed value names the flag and what it takes (its timings need a
Hopper GPU: BENCHMARKS.md)."""

from __future__ import annotations

import pytest

from benchmarks.fp4_cuda_kernels import parse_tuples


def test_groups_of_numbers_parse_and_malformed_ones_name_the_flag():
    assert parse_tuples("1x8,2x4", 2, "--gemv-configs") == [(1, 8), (2, 4)]
    assert parse_tuples("2x8x4x3", 4, "--expert-tiles") == [(2, 8, 4, 3)]
    for bad in ("1x8x2", "1,8", "0x4", "ax4", ""):
        with pytest.raises(SystemExit, match="--gemv-configs takes comma-separated groups of 2"):
            parse_tuples(bad, 2, "--gemv-configs")
