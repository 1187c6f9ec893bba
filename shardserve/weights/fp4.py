"""4-bit float (e2m1) checkpoints, read as the float matrices they encode: NVFP4 and MXFP4.

NVFP4 (NVIDIA ModelOpt, `quant_method: modelopt`, `quant_algo: NVFP4`): a linear layer stores
- `weight` uint8 [N, K / 2]: two e2m1 codes a byte, column 2j in the low nibble of byte j (vLLM's and ModelOpt's
  order), 2j + 1 in the high one;
- `weight_scale` float8_e4m3fn [N, K / 16]: a scale per row and group of 16 columns;
- `weight_scale_2` float32, one value: the layer's global scale;
- `input_scale` float32: the activation scale of NVFP4's 4-bit activations. Ignored: shardserve keeps activations
  in the compute dtype (weight-only 4-bit; logged once at start-up).
W[n, k] = e2m1(code[n, k]) * group_scale[n, k // 16], group_scale = float32(float(weight_scale) * weight_scale_2).
The group scale is rounded to float32 once, before the product, and the product once more: the packed layout
"fp4" keeps that float32 group scale, so its dequantizers give this module's bits.

MXFP4 (OCP microscaling, gpt-oss's `quant_method: mxfp4`): `{name}_blocks` uint8 [N, K / 32, 16] (the e2m1 codes of
32 columns in 16 bytes, low nibble first) and `{name}_scales` uint8 [N, K / 32], an e8m0 exponent: a group's scale
is 2 ** (scale - 127). A dense linear layer stores them as `{module}.weight_blocks` and `{module}.weight_scales`.

e2m1 (sign, two exponent bits, one mantissa bit; bias 1): codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6, and bit 3 is
the sign (codes 8..15 their negatives).
"""

from __future__ import annotations

import logging

import torch

from shardserve.weight_format import MXFP4_GROUP, NVFP4_GROUP, Checkpoint, DequantizedWeight, QuantScheme, _expand

logger = logging.getLogger(__name__)

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
E8M0_BIAS = 127

NVFP4_PARTS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
MXFP4_PARTS = ("weight_blocks", "weight_scales")


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of e2m1 codes (integers 0..15)."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def unpack_fp4_rows(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., C / 2] two codes a byte, low nibble first -> uint8 [..., C] codes 0..15."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def fp4_modules(names: list[str], scheme: QuantScheme) -> dict[str, dict[str, str]]:
    """module prefix -> {part: tensor name} for every e2m1 linear layer: NVFP4 layers are those with an fp8
    `weight_scale` beside `weight`, MXFP4 ones those with `weight_blocks`."""
    known = NVFP4_PARTS if scheme.method == "nvfp4" else MXFP4_PARTS
    marker = "weight_scale" if scheme.method == "nvfp4" else "weight_blocks"
    parts: dict[str, dict[str, str]] = {}
    for name in names:
        prefix, _, part = name.rpartition(".")
        if part in known:
            parts.setdefault(prefix, {})[part] = name
    return {p: s for p, s in parts.items() if marker in s}


_logged_input_scales = False


def fp4_weight(prefix: str, parts: dict[str, str], checkpoint: Checkpoint, scheme: QuantScheme) -> "Fp4Weight":
    """The DequantizedWeight of one NVFP4 or MXFP4 layer."""
    if scheme.method == "mxfp4":
        missing = [p for p in MXFP4_PARTS if p not in parts]
        if missing:
            raise ValueError(f"{prefix}: the MXFP4 layer lacks {', '.join(missing)}")
        blocks = checkpoint.tensor(parts["weight_blocks"])
        n, groups, width = blocks.shape
        if width != MXFP4_GROUP // 2:
            raise ValueError(f"{prefix}.weight_blocks: blocks of {width} bytes, MXFP4's are {MXFP4_GROUP // 2}")
        scales = checkpoint.tensor(parts["weight_scales"])
        return Fp4Weight(parts["weight_blocks"], blocks.reshape(n, groups * width), mxfp4_group_scales(scales),
                         MXFP4_GROUP)
    missing = [p for p in ("weight", "weight_scale_2") if p not in parts]
    if missing:
        raise ValueError(f"{prefix}: the NVFP4 layer lacks {', '.join(missing)}")
    global _logged_input_scales
    if "input_scale" in parts and not _logged_input_scales:
        _logged_input_scales = True
        logger.info("NVFP4 input_scale (4-bit activations) ignored: activations stay in the compute dtype")
    scales = nvfp4_group_scales(checkpoint.tensor(parts["weight_scale"]), checkpoint.tensor(parts["weight_scale_2"]))
    return Fp4Weight(parts["weight"], checkpoint.slice(parts["weight"]), scales, NVFP4_GROUP)


def nvfp4_group_scales(weight_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K / 16]: each float8_e4m3fn group scale times the layer's global scale, rounded once."""
    if weight_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"an NVFP4 weight_scale must be float8_e4m3fn, found {weight_scale.dtype}")
    if global_scale.numel() != 1:
        raise ValueError(f"an NVFP4 weight_scale_2 is one value, found shape {tuple(global_scale.shape)}")
    return weight_scale.float() * global_scale.float().reshape(())


def mxfp4_group_scales(scales: torch.Tensor) -> torch.Tensor:
    """float32 [N, K / 32] from e8m0 exponents (uint8): 2 ** (e - 127); 255 (NaN in e8m0) is refused."""
    if scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 scales must be uint8 (e8m0), found {scales.dtype}")
    if scales.numel() and int(scales.max()) == 255:
        raise ValueError("an MXFP4 scale is 255, e8m0's NaN")
    return torch.ldexp(torch.ones(scales.shape), scales.int() - E8M0_BIAS)


class Fp4Weight(DequantizedWeight):
    """e2m1 codes two a byte [N, K / 2] times a float32 scale per row and group of `group` columns."""

    def __init__(self, name: str, codes, scales: torch.Tensor, group: int) -> None:
        rows, half = (list(codes.get_shape()) if hasattr(codes, "get_shape") else list(codes.shape))
        super().__init__(name, (rows, 2 * half))
        if tuple(scales.shape) != (rows, 2 * half // group) or (2 * half) % group:
            raise ValueError(f"{name}: {rows}x{2 * half} e2m1 weights need [{rows}, {2 * half // group}] scales "
                             f"(groups of {group}), found {tuple(scales.shape)}")
        self.codes, self.scales, self.group = codes, scales.float(), group

    def _codes(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """uint8 codes 0..15 of rows [r0, r1), columns [c0, c1): only the bytes holding them are read."""
        packed = torch.as_tensor(self.codes[r0:r1, c0 // 2:-(-c1 // 2)])
        if packed.dtype != torch.uint8:
            raise ValueError(f"{self.name}: e2m1 codes must be stored as uint8, found {packed.dtype}")
        return unpack_fp4_rows(packed)[:, c0 % 2:c0 % 2 + c1 - c0]

    def read(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        values = e2m1_values(self._codes(r0, r1, c0, c1))
        if r1 == r0 or c1 == c0:
            return values
        scales = self.scales[r0:r1, c0 // self.group:(c1 - 1) // self.group + 1]
        return values * _expand(scales, c0, c1 - c0, self.group, 1)

    def packed_group(self, c0: int, c1: int) -> int | None:
        """The group of columns [c0, c1) in `read_packed`, or None where they are not whole groups."""
        return self.group if c0 % self.group == 0 and (c1 - c0) % self.group == 0 else None

    def read_packed(self, r0: int, r1: int, c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [r0, r1), columns [c0, c1) (whole groups) as (codes uint8 [rows, columns] in 0..15, group scales
        float32 [rows, columns / group])."""
        if self.packed_group(c0, c1) is None:
            raise ValueError(f"{self.name}: columns [{c0}, {c1}) are not whole groups of {self.group}")
        scales = self.scales[r0:r1, c0 // self.group:c1 // self.group].contiguous()
        return self._codes(r0, r1, c0, c1).contiguous(), scales
