"""The fused mixture-of-experts kernel's block sizes (kernels/triton/fused_moe.py), apart from the kernel so that
what a layer will run can be known without Triton.

Block sizes come from this table keyed on the expected rows per expert (T*k/E), never from an autotuner, which
would time kernels inside a CUDA graph capture. The entries were chosen from a sweep on an H200 at Qwen3-30B-A3B's
shape (benchmarks/moe_kernels.py --sweep; docs/benchmarks-notebook.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardserve import envs


@dataclass(frozen=True)
class Tile:
    """One GEMM's tiling: output columns and reduction depth per program, warps, pipeline stages."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeConfig:
    """block_m: slots per block (rows of both GEMMs' tiles); up: the w13 GEMM's tile; down: the w2 GEMM's."""
    block_m: int
    up: Tile
    down: Tile


# (largest expected rows per expert, config), first match wins. Decode (a few rows per expert) is bound by
# reading the chosen experts' weights: small row blocks, many narrow column tiles so that every SM streams.
# Larger batches still read each expert once while a block covers the busiest expert's rows; past that the
# GEMMs become compute-bound and take wide tiles.
CONFIGS: tuple[tuple[float, MoeConfig], ...] = (
    (8, MoeConfig(16, Tile(32, 128, 4, 4), Tile(64, 128, 4, 4))),
    (20, MoeConfig(32, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4))),
    (48, MoeConfig(64, Tile(64, 64, 4, 4), Tile(64, 64, 4, 4))),
    (float("inf"), MoeConfig(128, Tile(128, 64, 8, 3), Tile(128, 64, 8, 3))),
)


# Up to this many tokens the router's choice and the alignment run in one program (one launch fewer a layer).
# The program routes its tokens one after another: on an H100 at Qwen3-30B-A3B's shape, 5.0 against 6.3 us for
# the two launches at one token, 7.0 against 6.8 at two (benchmarks/moe_kernels.py).
ROUTE_ALIGN_MAX_TOKENS = 1

# Up to this many tokens the w2 GEMM's last program of each column tile sums the choices (one launch fewer a
# layer); past it a separate kernel sums them, with more programs than the GEMM's column tiles.
SUM_IN_DOWN_MAX_TOKENS = 8


@dataclass(frozen=True)
class OneTokenTiles:
    """A single token's experts as matrix-vector products (fused_moe's one-token path): `up` the w13 product's
    tile (block_n gate rows and the same up rows a program, block_k hidden columns a step), `down` the w2
    product's (block_n output columns of one choice a program, block_k expert features a step)."""
    up: Tile
    down: Tile


# Batch-1 decode: no row block of 16 slots around a single row, no alignment; each program streams its rows of
# one chosen expert (the dense GEMV's shape of work). The fastest of a grid on an H200 at Qwen3-30B-A3B's shape
# (benchmarks/moe_kernels.py --one-token-sweep: block_n 2-16, block_k 128-1024, 4 or 8 warps, 2 or 3 stages):
# 23.7 us a layer's experts, against 26.2 for (4, 512, 4, 3) + (4, 256, 4, 2) and 28.8 for the grouped GEMMs.
ONE_TOKEN_TILES = OneTokenTiles(Tile(2, 1024, 4, 2), Tile(8, 256, 4, 2))
ONE_TOKEN_ENV = envs.MOE_ONE_TOKEN.name
# Other tiles for the one-token path, to tune it on another GPU inside whole decode steps: "up/down", each tile
# "block_n,block_k,num_warps,num_stages" (powers of two), e.g. "2,1024,4,2/8,256,4,2" (the default).
ONE_TOKEN_TILES_ENV = envs.MOE_ONE_TOKEN_TILES.name


def one_token_tiles() -> OneTokenTiles | None:
    """The one-token path's tiles (ONE_TOKEN_TILES unless SHARDSERVE_MOE_ONE_TOKEN_TILES says others), or None
    where SHARDSERVE_MOE_ONE_TOKEN=gemm keeps a single token on the grouped GEMMs of the table (default gemv)."""
    if envs.MOE_ONE_TOKEN.get() != "gemv":
        return None
    value = envs.MOE_ONE_TOKEN_TILES.get()
    return ONE_TOKEN_TILES if value is None else parse_one_token_tiles(value)


# Packed experts (FP8, 4-bit) at batch 1: the same two products, each weight tile dequantized in registers, in
# tiles of block_n rows by block_k columns (the columns in sub-tiles inside one scale group). Chosen on an H200 at
# Qwen3-Next-80B-A3B's shape in FP8 blocks of 128 (benchmarks/moe_kernels.py --one-token-packed-sweep).
ONE_TOKEN_PACKED_TILES = OneTokenTiles(Tile(2, 1024, 4, 2), Tile(8, 512, 4, 2))
ONE_TOKEN_PACKED_TILES_ENV = envs.MOE_ONE_TOKEN_PACKED_TILES.name


def one_token_packed_tiles() -> OneTokenTiles | None:
    """The packed experts' one-token tiles (ONE_TOKEN_PACKED_TILES unless SHARDSERVE_MOE_ONE_TOKEN_PACKED_TILES
    says others), or None where SHARDSERVE_MOE_ONE_TOKEN=gemm keeps a single token on the table's GEMMs."""
    if one_token_tiles() is None:
        return None
    value = envs.MOE_ONE_TOKEN_PACKED_TILES.get()
    return ONE_TOKEN_PACKED_TILES if value is None else parse_one_token_tiles(value, ONE_TOKEN_PACKED_TILES_ENV)


def parse_one_token_tiles(value: str, variable: str = ONE_TOKEN_TILES_ENV) -> OneTokenTiles:
    """OneTokenTiles from "up/down" (ONE_TOKEN_TILES_ENV's form); a ValueError naming the variable otherwise."""
    try:
        up, down = (Tile(*(int(n) for n in tile.split(","))) for tile in value.split("/"))
        ok = all(n > 0 and not n & (n - 1) for tile in (up, down)
                 for n in (tile.block_n, tile.block_k, tile.num_warps)) and min(up.num_stages, down.num_stages) > 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{variable}={value!r}: expected two tiles 'up/down', each "
                         "'block_n,block_k,num_warps,num_stages' with powers of two, e.g. '2,1024,4,2/8,256,4,2'")
    return OneTokenTiles(up, down)


def pick_config(tokens: int, top_k: int, num_experts: int, element_size: int = 2) -> MoeConfig:
    """The table's config for this many tokens (fixed for a given T, so a captured graph keeps its shapes).
    The table is for 16-bit inputs; 4-byte inputs halve the reduction depth so a pipeline stage keeps its bytes
    (and fits in shared memory)."""
    rows = tokens * top_k / num_experts
    config = next(config for limit, config in CONFIGS if rows <= limit)
    if element_size > 2:
        config = MoeConfig(config.block_m, *(replace(t, block_k=max(16, t.block_k * 2 // element_size))
                                             for t in (config.up, config.down)))
    return config


def token_counts_per_config(top_k: int, num_experts: int) -> list[int]:
    """One token count that picks each config a layer of this shape can take (the smallest that does): a
    self-check over these runs every one."""
    counts, previous = [], 0.0
    for limit, _ in CONFIGS:
        first = int(previous * num_experts // top_k) + 1
        if first * top_k <= limit * num_experts:
            counts.append(first)
        previous = limit
    return counts


# Past this many (token, choice) pairs per expert, torch's grouped GEMM beats the table's widest config on an H200
# (Qwen3-30B-A3B's shape: 1,024 tokens, 64 rows per expert, 724 against 851 us); layers use it there when both
# passed their self-check.
FUSED_MAX_ROWS_PER_EXPERT = 48
