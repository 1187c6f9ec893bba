"""Triton GPU kernels: paged attention over the block-table KV cache, and fused elementwise/norm ops.

Importing these modules needs the `triton` package; the engine imports them only on CUDA devices.
"""
