"""Start-up checks: each chosen kernel, on this rank's real shapes, against a float64 reference.

A kernel can be right on the CPU or GPU its authors used and wrong on another (an emulated instruction
path, a tile limit that one shard width crosses). So before serving, every rank runs each kernel it is
about to use on random inputs of the exact shapes it will see and compares with float64 arithmetic on
the same inputs. The error is the relative Frobenius norm ||out - ref|| / ||ref||; a kernel passes below
the tolerance of the dtype it computes in (rounding the output to that dtype alone costs about 2^-9 in
bfloat16 and 2^-12 in float16; float32 kernels land near 1e-7, with room left for the cancellation of a
few short dot products). A wrong layout, a missing tile or weights silently rounded to bfloat16 (about
1e-3) all land far above it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
# Rows of the inputs a linear kernel is checked with: a single-token step and a small batch (kernels such as
# bf16-decode take another path for batches).
LINEAR_ROWS = (1, 5)
# Outputs compared with float64 per weight: all of a smaller weight; of a larger one (an LM head of 128k rows)
# the first and last rows, where tiles end, and rows spread evenly between them.
CHECKED_OUTPUTS = 4096


def sampled_outputs(n: int, limit: int = CHECKED_OUTPUTS) -> torch.Tensor | None:
    """The output features to compare (None: all of them)."""
    if n <= limit:
        return None
    edge = limit // 4
    middle = torch.linspace(edge, n - edge - 1, limit - 2 * edge).long()
    return torch.cat([torch.arange(edge), middle, torch.arange(n - edge, n)])


@dataclass(frozen=True)
class CheckResult:
    name: str  # what was checked, e.g. "onednn-packed 1536x576"
    error: float  # relative error against float64 (inf: failed to run or not finite)
    tolerance: float
    detail: str = ""  # why it failed to run

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance

    def describe(self) -> str:
        if self.detail:
            return f"{self.name}: {self.detail}"
        return f"{self.name}: error {self.error:.2g} (tolerance {self.tolerance:.2g})"


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().double().cpu()
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_linear(kernel, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, name: str,
                 seed: int = 0) -> CheckResult:
    """kernel.prepare(weight), then kernel(x, prepared, bias) for LINEAR_ROWS rows of random x in `dtype`,
    against F.linear in float64 on the same values."""
    tolerance = TOLERANCE.get(dtype, 1e-2)
    try:
        prepared = kernel.prepare(weight)
        generator = torch.Generator().manual_seed(seed)
        sampled = sampled_outputs(weight.shape[0])
        outputs = slice(None) if sampled is None else sampled.to(weight.device)
        # The reference in float64 on the weight's own device, for the sampled outputs only.
        w64 = weight[outputs].detach().double()
        b64 = None if bias is None else bias[outputs].double()
        worst = 0.0
        for rows in LINEAR_ROWS:
            x = torch.randn(rows, weight.shape[1], generator=generator).to(dtype).to(weight.device)
            out = kernel(x, prepared, bias)[:, outputs]
            worst = max(worst, relative_error(out, F.linear(x.double(), w64, b64).cpu()))
        return CheckResult(name, worst, tolerance)
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run on these shapes fails its check
        return CheckResult(name, math.inf, tolerance, f"{type(e).__name__}: {e}")


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_index: list[int], scale: float,
                        first_position: int) -> torch.Tensor:
    """float64 causal attention of q [n, heads, dim] (positions first_position..) over k, v [ctx, kv_heads, dim]
    (positions 0..); query head h reads KV head kv_index[h]. Returns [n, heads * dim]."""
    k = k[:, kv_index].transpose(0, 1)  # [heads, ctx, dim]
    v = v[:, kv_index].transpose(0, 1)
    scores = torch.einsum("nhd,hcd->hnc", q, k) * scale
    query_pos = torch.arange(first_position, first_position + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[1]).unsqueeze(0) > query_pos, float("-inf"))
    out = torch.einsum("hnc,hcd->nhd", torch.softmax(scores, dim=-1), v)
    return out.reshape(q.shape[0], -1)


def head_norm_reference(qk: torch.Tensor, num_q_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """Qwen3's per-head RMSNorm in float64: query heads (the first num_q_heads) with q_weight, key heads with
    k_weight. qk: [tokens, heads, dim]."""
    qk = qk.double()
    normed = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps)
    weight = torch.cat((q_weight.double().cpu().expand(num_q_heads, -1),
                        k_weight.double().cpu().expand(qk.shape[1] - num_q_heads, -1)))
    return normed * weight


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, dim] rotated in float64 with per-token tables [tokens, rotary_dim]: the first rotary_dim
    dims of each head rotate, the rest pass through."""
    r = cos.shape[-1]
    rot = x[..., :r]
    rot = rot * cos.unsqueeze(1) + torch.roll(rot, r // 2, dims=-1) * signed_sin.unsqueeze(1)
    return torch.cat((rot, x[..., r:]), dim=-1)
