"""4-bit float (e2m1) checkpoints, read as the float matrices they encode: NVFP4 and MXFP4.

NVFP4 (NVIDIA ModelOpt, `quant_method: modelopt`, `quant_algo: NVFP4`): a linear layer stores
- `weight` uint8 [N, K / 2]: two e2m1 codes a byte, column 2j in the low nibble of byte j (vLLM's and ModelOpt's
  order), 2j + 1 in the high one;
- `weight_scale` float8_e4m3fn [N, K / 16]: a scale per row and group of 16 columns;
- `weight_scale_2` float32, one value: the layer's global scale;
- `input_scale` float32: the activation scale of NVFP4's 4-bit activations. Ignored: shardserve keeps activations
  in the compute dtype (weight-only 4-bit; logged once at start-up).
W[n, k] = e2m1(code[n, k]) * group_scale[n, k // 16], group_scale = float32(float(weight_scale) * weight_scale_2).
The group scale is rounded to float32 once, before the product, and the product once more. The packed layout "fp4"
(kernels/quant_pack.py) keeps the e4m3 bytes and the global scale as it is and rounds the same way, so its
dequantizers give this module's bits.

MXFP4 (OCP microscaling, gpt-oss's `quant_method: mxfp4`): `{name}_blocks` uint8 [N, K / 32, 16] (the e2m1 codes of
32 columns in 16 bytes, low nibble first) and `{name}_scales` uint8 [N, K / 32], an e8m0 exponent: a group's scale
is 2 ** (scale - 127). A dense linear layer stores them as `{module}.weight_blocks` and `{module}.weight_scales`.
The packed layout takes them as e4m3 group scales under a power-of-two row scale (mxfp4_as_e4m3), exactly where a
row's scales span at most E4M3_POWERS powers of two.

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
        scale, row_scale = mxfp4_as_e4m3(checkpoint.tensor(parts["weight_scales"]), parts["weight_scales"])
        return Fp4Weight(parts["weight_blocks"], blocks.reshape(n, groups * width), scale, row_scale, MXFP4_GROUP)
    missing = [p for p in ("weight", "weight_scale", "weight_scale_2") if p not in parts]
    if missing:
        raise ValueError(f"{prefix}: the NVFP4 layer lacks {', '.join(missing)}")
    global _logged_input_scales
    if "input_scale" in parts and not _logged_input_scales:
        _logged_input_scales = True
        logger.info("NVFP4 input_scale (4-bit activations) ignored: activations stay in the compute dtype")
    scale = checkpoint.tensor(parts["weight_scale"])
    global_scale = checkpoint.tensor(parts["weight_scale_2"])
    _check_nvfp4_scales(scale, global_scale)
    row_scale = global_scale.float().reshape(()).expand(scale.shape[0]).contiguous()
    return Fp4Weight(parts["weight"], checkpoint.slice(parts["weight"]), scale, row_scale, NVFP4_GROUP)


def nvfp4_group_scales(weight_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K / 16]: each float8_e4m3fn group scale times the layer's global scale, rounded once."""
    _check_nvfp4_scales(weight_scale, global_scale)
    return weight_scale.float() * global_scale.float().reshape(())


def _check_nvfp4_scales(weight_scale: torch.Tensor, global_scale: torch.Tensor) -> None:
    if weight_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"an NVFP4 weight_scale must be float8_e4m3fn, found {weight_scale.dtype}")
    if global_scale.numel() != 1:
        raise ValueError(f"an NVFP4 weight_scale_2 is one value, found shape {tuple(global_scale.shape)}")


def mxfp4_group_scales(scales: torch.Tensor) -> torch.Tensor:
    """float32 [N, K / 32] from e8m0 exponents (uint8): 2 ** (e - 127); 255 (NaN in e8m0) is refused."""
    return torch.ldexp(torch.ones(scales.shape), _e8m0_powers(scales))


def _e8m0_powers(scales: torch.Tensor) -> torch.Tensor:
    """int32 e - 127 of e8m0 exponents (uint8); 255 (NaN in e8m0) is refused."""
    if scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 scales must be uint8 (e8m0), found {scales.dtype}")
    if scales.numel() and int(scales.max()) == 255:
        raise ValueError("an MXFP4 scale is 255, e8m0's NaN")
    return scales.int() - E8M0_BIAS


# Powers of two float8_e4m3fn holds exactly, 2**-9 (its smallest subnormal) to 2**8.
E4M3_POWERS = 18


def mxfp4_as_e4m3(scales: torch.Tensor, name: str = "weight_scales") -> tuple[torch.Tensor, torch.Tensor]:
    """e8m0 exponents [N, G] -> (float8_e4m3fn [N, G], float32 [N]) of the same products: each row's scale is the
    power of two that puts its largest group scale at 2**8, and each group scale the power of two left. ValueError
    where a row's scales span more than E4M3_POWERS powers of two (its smallest would not be exact)."""
    exponents = _e8m0_powers(scales)
    if not exponents.numel():
        return torch.zeros(scales.shape, dtype=torch.float8_e4m3fn), torch.ones(scales.shape[0])
    top = exponents.amax(dim=1)
    relative = exponents - top[:, None] + 8
    if int(relative.min()) < 8 - E4M3_POWERS + 1:
        raise ValueError(f"{name}: a row's MXFP4 scales span more than 2**{E4M3_POWERS - 1}, more than the packed "
                         "layout's e4m3 group scales hold exactly; SHARDSERVE_QUANTIZED_LAYERS=dequantized serves "
                         "this checkpoint with the values it encodes")
    return (torch.ldexp(torch.ones(relative.shape), relative).to(torch.float8_e4m3fn),
            torch.ldexp(torch.ones(top.shape), top - 8))


class Fp4Weight(DequantizedWeight):
    """e2m1 codes two a byte [N, K / 2] times float32(an e4m3 scale per row and group of `group` columns times a
    float32 scale a row)."""

    def __init__(self, name: str, codes, scale: torch.Tensor, row_scale: torch.Tensor, group: int) -> None:
        rows, half = (list(codes.get_shape()) if hasattr(codes, "get_shape") else list(codes.shape))
        super().__init__(name, (rows, 2 * half))
        if tuple(scale.shape) != (rows, 2 * half // group) or (2 * half) % group:
            raise ValueError(f"{name}: {rows}x{2 * half} e2m1 weights need [{rows}, {2 * half // group}] scales "
                             f"(groups of {group}), found {tuple(scale.shape)}")
        if scale.dtype != torch.float8_e4m3fn or tuple(row_scale.shape) != (rows,):
            raise ValueError(f"{name}: e2m1 weights take float8_e4m3fn group scales and a scale a row, found "
                             f"{scale.dtype} and {tuple(row_scale.shape)}")
        self.codes, self.scale, self.row_scale, self.group = codes, scale, row_scale.float(), group

    def _codes(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """uint8 codes 0..15 of rows [r0, r1), columns [c0, c1): only the bytes holding them are read."""
        packed = torch.as_tensor(self.codes[r0:r1, c0 // 2:-(-c1 // 2)])
        if packed.dtype != torch.uint8:
            raise ValueError(f"{self.name}: e2m1 codes must be stored as uint8, found {packed.dtype}")
        return unpack_fp4_rows(packed)[:, c0 % 2:c0 % 2 + c1 - c0]

    def _group_scales(self, r0: int, r1: int, g0: int, g1: int) -> torch.Tensor:
        """float32 scales of rows [r0, r1) and groups [g0, g1): e4m3 times the row's scale, rounded once."""
        return self.scale[r0:r1, g0:g1].float() * self.row_scale[r0:r1, None]

    def read(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        values = e2m1_values(self._codes(r0, r1, c0, c1))
        if r1 == r0 or c1 == c0:
            return values
        scales = self._group_scales(r0, r1, c0 // self.group, (c1 - 1) // self.group + 1)
        return values * _expand(scales, c0, c1 - c0, self.group, 1)

    def packed_group(self, c0: int, c1: int) -> int | None:
        """The group of columns [c0, c1) in `read_packed`, or None where they are not whole groups."""
        return self.group if c0 % self.group == 0 and (c1 - c0) % self.group == 0 else None

    def read_packed(self, r0: int, r1: int, c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows [r0, r1), columns [c0, c1) (whole groups) as (codes uint8 [rows, columns] in 0..15, group scales
        float8_e4m3fn [rows, columns / group], row scales float32 [rows])."""
        if self.packed_group(c0, c1) is None:
            raise ValueError(f"{self.name}: columns [{c0}, {c1}) are not whole groups of {self.group}")
        scale = self.scale[r0:r1, c0 // self.group:c1 // self.group].contiguous()
        return self._codes(r0, r1, c0, c1).contiguous(), scale, self.row_scale[r0:r1].contiguous()
