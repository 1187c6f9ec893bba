"""Quantization formats of packed weights, one file each: what a format's tensors are, how a checkpoint's stored
form or float values become them, what they encode (for the start-up checks), and the kernels of its products.

- fp8.py: e4m3 bytes with float32 scales per row and group of columns (per-channel, per-tensor and 128 x 128 block
  checkpoints, and --quantization fp8);
- int4.py: GPTQ's 4-bit integers with a scale and zero point a group (GPTQ and AutoRound checkpoints);
- fp4.py: e2m1 codes in int4's nibbles, an e4m3 scale byte a group and a float32 scale a row (NVFP4 and MXFP4
  checkpoints).

Packed linear layers (packed.PackedWeights) and packed expert blocks (layers/moe_packed.py) hold
their tensors through a format; nothing else branches on the kind. A new format is a new file here and an entry in
FORMATS.
"""

from __future__ import annotations

from shardserve.layers.quantization.base import QuantFormat
from shardserve.layers.quantization.fp4 import Fp4Format
from shardserve.layers.quantization.fp8 import Fp8Format
from shardserve.layers.quantization.int4 import Int4Format

FORMATS: dict[str, QuantFormat] = {f.kind: f for f in (Fp8Format(), Int4Format(), Fp4Format())}


def format_of(kind: str) -> QuantFormat:
    """The format of a packed layout's kind ("fp8", "int4" or "fp4")."""
    try:
        return FORMATS[kind]
    except KeyError:
        raise ValueError(f"no packed format {kind!r}: one of {sorted(FORMATS)}") from None
