"""benchmarks/step_floor.py: its phases are the steps the suite's roofline counts (BENCHMARKS.md has the GPU run):
as many kernels as the engine's decode step launches, and the bytes of gpu_suite's active-bytes roofline."""

from __future__ import annotations

import pytest

from benchmarks import gpu_suite
from benchmarks.step_floor import LAYOUTS, SOURCE

QUANTIZATION = {"bf16": None, "NVFP4": "nvfp4", "FP8 blocks": "fp8-block"}
# Kernels of a batch-1 decode step as profile_decode.py --timeline counted them on an H200 (notebook, 2026-11-30):
# Nemotron-3-Nano NVFP4 241, Qwen3-Next FP8 352; two of each read no weights (the embedding's row, the step's inputs).
KERNELS = {"nemotron3-nano-30b-a3b": 239, "qwen3-next-80b-a3b": 350}


@pytest.mark.parametrize("model, layout", sorted(LAYOUTS))
def test_the_phases_read_the_rooflines_bytes_in_the_engines_kernels(model, layout):
    phases, w = LAYOUTS[model, layout]
    steps = phases(w)
    assert len(steps) == KERNELS[model]
    shape = gpu_suite.SHAPES[model]
    # the roofline counts the embedding's row as the whole embedding; the probe streams weights only
    embedding = shape["vocab_size"] * shape["hidden_size"] * 2
    roofline = gpu_suite.weight_bytes(shape, active=True, quantization=QUANTIZATION[layout])
    assert abs(sum(n for _, n in steps) + embedding - roofline) / roofline < 0.01


def test_every_phase_fits_the_launchs_32_bit_chunk_counts():
    for phases, w in LAYOUTS.values():
        assert sum(-(-n // 16) for _, n in phases(w)) < 2**31


def test_the_probe_uses_the_products_loads_rather_than_its_own():
    text = open(SOURCE).read()
    assert "stream_chunk(" in text and "ld.global.nc" not in text


def test_a_kernels_time_in_the_chain_is_its_end_less_the_end_before_summed_by_name():
    from benchmarks.step_floor import by_kernel

    steps = [("norm", 0), ("in_proj", 10), ("norm", 0), ("in_proj", 10)]
    ends = [1_000, 6_000, 7_000, 11_500]  # ns
    assert by_kernel(steps, ends) == {"in_proj": [9.5, 2], "norm": [1.0, 1]}  # the first phase has no start
