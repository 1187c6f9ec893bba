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

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
# Attention over an FP8 (e4m3) cache, against float64 on the keys and values rounded as the cache holds them: a key
# computed in the compute dtype can land one e4m3 step (6-12%) away from the reference's where it sits near a
# rounding boundary, which the float32 tolerance leaves too little room for. A missing scale or reading keys
# unrounded (about 2-3% of every key) lands well above these.
FP8_KV_TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}
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


def attention_tolerance(dtype: torch.dtype, kv_dtype: torch.dtype) -> float:
    """The tolerance of attention computing in `dtype` over a cache of `kv_dtype`."""
    table = FP8_KV_TOLERANCE if kv_dtype == torch.float8_e4m3fn else TOLERANCE
    return max(table.get(dtype, 1e-2), table.get(kv_dtype, 0.0))


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


def delta_net_reference(qkv: torch.Tensor, ba: torch.Tensor, conv_weight: torch.Tensor, a_log: torch.Tensor,
                        dt_bias: torch.Tensor, scale: float, key_heads: int, conv: torch.Tensor,
                        rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer's token mixing of one sequence in float64, token by token, from its convolution's
    input qkv [T, channels] ([q | k | v]) and ba [T, 2 * value_heads] ([b | a]) and its states conv [channels,
    K - 1] and rec [value_heads, key_dim, value_dim]. Returns (o [T, value_heads, value_dim], conv, rec)."""
    value_heads, key_dim, value_dim = rec.shape
    group = value_heads // key_heads
    weight, conv, rec = conv_weight.double().cpu(), conv.double().cpu(), rec.double().cpu()
    a_log, dt_bias = a_log.double().cpu(), dt_bias.double().cpu()
    outputs = []
    for x, gates in zip(qkv.double().cpu(), ba.double().cpu()):
        window = torch.cat((conv, x[:, None]), dim=1)
        y = (window * weight).sum(-1)
        y, conv = y * torch.sigmoid(y), window[:, 1:]
        q, k, v = y.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim])
        q, k = (F.normalize(t.reshape(key_heads, key_dim), dim=-1).repeat_interleave(group, 0) for t in (q, k))
        b, a = gates.chunk(2)
        decay = torch.exp(-a_log.exp() * F.softplus(a + dt_bias))
        rec = rec * decay[:, None, None]
        write = (v.reshape(value_heads, value_dim) - torch.einsum("hkv,hk->hv", rec, k)) * torch.sigmoid(b)[:, None]
        rec = rec + k[:, :, None] * write[:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", rec, q * scale))
    return torch.stack(outputs), conv, rec


def gated_norm_reference(o: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet's output norm in float64: each head of o [T, heads, D] RMS-normalised, times norm_weight [D]
    and silu(z) (z [T, heads * D]). Returns [T, heads * D]."""
    z = z.double().cpu().reshape(o.shape)
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double().cpu()
    return (normed * F.silu(z)).reshape(o.shape[0], -1)


def check_delta_net(kernels, key_heads: int, value_heads: int, key_dim: int, value_dim: int, conv_kernel: int,
                    dtype: torch.dtype, device: torch.device, seed: int = 0) -> CheckResult:
    """Gated DeltaNet kernels (layers/deltanet_kernels.py) on one rank's head sizes against float64: a prompt of
    70 tokens (two chunks of the chunked rule) from empty states, then two decode steps of three sequences in a
    pool of four slots, that prompt's sequence among them, and two more through the output norm
    (step_and_norm_in_pool); kernels that say they are graph-safe get a padding row (slot -1) too, which must
    leave every slot alone."""
    from shardserve.kernels.gated_delta_rule import delta_rule_gates, split_heads

    name = (f"{kernels.name} Gated DeltaNet ({key_heads}x{key_dim} key heads, {value_heads}x{value_dim} value "
            f"heads, conv {conv_kernel})")
    tolerance = TOLERANCE.get(dtype, 1e-2)
    try:
        g = torch.Generator().manual_seed(seed)
        channels = 2 * key_heads * key_dim + value_heads * value_dim

        def rand(*shape, dt=dtype, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(dt).to(device)

        f32 = torch.float32
        layer = dict(conv_weight=rand(channels, conv_kernel, scale=0.5), a_log=rand(value_heads, dt=f32, scale=0.5),
                     dt_bias=rand(value_heads, dt=f32), scale=key_dim ** -0.5, key_heads=key_heads)
        norm = dict(norm_weight=1 + rand(value_dim, scale=0.2), eps=1e-6)
        # Each pool a view past a guard slot: a padding row that wrote "slot -1" as an address would land there.
        conv_buffer = rand(5, channels, conv_kernel - 1)
        rec_buffer = rand(5, value_heads, key_dim, value_dim, dt=torch.float32, scale=0.1)
        conv_pool, rec_pool = conv_buffer[1:], rec_buffer[1:]
        conv_pool[2], rec_pool[2] = 0, 0
        untouched = [t[[0, 2]] for t in (conv_buffer, rec_buffer)]  # copies of the guard and slot 1, no sequence's
        expected = {s: (conv_pool[s].clone(), rec_pool[s].clone()) for s in (0, 2, 3)}
        # The prompt, through the chunked forms, into slot 2.
        qkv, ba = rand(70, channels), rand(70, 2 * value_heads)
        mixed, conv_pool[2] = kernels.conv(qkv, layer["conv_weight"], conv_pool[2])
        q, k, v = split_heads(mixed, key_heads, key_dim, value_heads, value_dim)
        gate, beta = delta_rule_gates(ba, layer["a_log"], layer["dt_bias"])
        o, rec_pool[2] = kernels.rule(q, k, v, gate, beta, layer["scale"], rec_pool[2])
        conv, rec = expected[2]
        ref, *expected[2] = delta_net_reference(qkv, ba, **layer, conv=conv, rec=rec)
        worst = relative_error(o, ref)
        step = functools.partial(_delta_net_step_error, kernels, rand, layer, norm,
                                 dict(conv_pool=conv_pool, rec_pool=rec_pool), expected,
                                 [2, 0, 3] + ([-1] if kernels.graph_safe else []))
        for normed in (False, False, True, True):
            worst = max(worst, step(normed))
        for slot, (conv, rec) in expected.items():
            worst = max(worst, relative_error(rec_pool[slot], rec), relative_error(conv_pool[slot], conv))
        if not all(torch.equal(t[[0, 2]], kept) for t, kept in zip((conv_buffer, rec_buffer), untouched)):
            return CheckResult(name, math.inf, tolerance, "a slot no sequence owns was written (or before the pool)")
        return CheckResult(name, worst, tolerance)
    except Exception as e:  # noqa: BLE001 - kernels that cannot run these shapes fail their check
        return CheckResult(name, math.inf, tolerance, f"{type(e).__name__}: {e}")


def _delta_net_step_error(kernels, rand, layer: dict, norm: dict, pools: dict, expected: dict, slots: list[int],
                          normed: bool) -> float:
    """One decode step of random inputs for rows of `slots` (step_and_norm_in_pool where normed, else
    step_in_pool): the worst relative error of a live row's output against float64, whose expected states
    (expected[slot]: conv, rec) it steps."""
    value_heads, value_dim = layer["a_log"].shape[0], norm["norm_weight"].shape[0]
    qkv, ba = rand(len(slots), pools["conv_pool"].shape[1]), rand(len(slots), 2 * value_heads)
    z = rand(len(slots), value_heads * value_dim)
    common = dict(slots=torch.tensor(slots, device=qkv.device), **layer, **pools)
    if normed:
        out = kernels.step_and_norm_in_pool(qkv, ba, z, **norm, **common)
    else:
        out = kernels.step_in_pool(qkv, ba, **common)
    worst = 0.0
    for row, slot in enumerate(slots):
        if slot < 0:  # a padding row: its output is never read
            continue
        conv, rec = expected[slot]
        ref, *expected[slot] = delta_net_reference(qkv[row:row + 1], ba[row:row + 1], **layer, conv=conv, rec=rec)
        if normed:
            ref = gated_norm_reference(ref, z[row:row + 1], **norm)
        worst = max(worst, relative_error(out[row:row + 1], ref))
    return worst


def mamba2_reference(xbc: torch.Tensor, dt: torch.Tensor, z: torch.Tensor, params: dict, groups: int,
                     conv: torch.Tensor, ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Mamba-2 layer's token mixing of one sequence in float64, token by token, from its input projection's
    outputs xbc [T, channels] ([x | B | C]), dt [T, heads] (before softplus) and z [T, heads * head_dim], and its
    states conv [channels, K - 1] and ssm [heads, head_dim, state_size]; params as check_mamba2 makes them.
    The convolution's output is rounded to xbc's dtype, where the layer keeps it (a 16-bit rounding of x, B and C
    that the dot products S C and x B^T can amplify past the dtype's tolerance otherwise); everything else is
    exact. Returns (the gated norm's output [T, heads * head_dim], conv, ssm)."""
    heads, head_dim, state_size = ssm.shape
    p = {k: v.double().cpu() if isinstance(v, torch.Tensor) else v for k, v in params.items()}
    conv, ssm = conv.double().cpu(), ssm.double().cpu()
    low, high = p["time_step_limit"]
    outputs = []
    for x, step, gate in zip(xbc.double().cpu(), dt.double().cpu(), z.double().cpu()):
        window = torch.cat((conv, x[:, None]), dim=1)
        y = (window * p["conv_weight"]).sum(-1) + (0 if p["conv_bias"] is None else p["conv_bias"])
        y = y.to(xbc.dtype).double()
        y, conv = (y * torch.sigmoid(y)).to(xbc.dtype).double(), window[:, 1:]
        xs, b, c = y.split([heads * head_dim, groups * state_size, groups * state_size])
        b, c = (t.reshape(groups, state_size).repeat_interleave(heads // groups, 0) for t in (b, c))
        xs = xs.reshape(heads, head_dim)
        step = F.softplus(step + p["dt_bias"]).clamp(low, high)
        ssm = ssm * torch.exp(-p["a_log"].exp() * step)[:, None, None] + (step[:, None] * xs)[..., None] * b[:, None]
        y = (torch.einsum("hpn,hn->hp", ssm, c) + p["d"][:, None] * xs).reshape(-1)
        h = (y * F.silu(gate)).reshape(groups, -1)
        outputs.append((h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + p["eps"])).reshape(-1) * p["norm_weight"])
    return torch.stack(outputs), conv, ssm


def _mamba2_parameters(rand, heads: int, channels: int, conv_kernel: int, conv_bias: bool,
                       time_step_limit: tuple[float, float], dtype: torch.dtype, head_dim: int) -> dict:
    """Random parameters of one rank's Mamba-2 layer (rand(*shape, dt, scale) draws them on the device)."""
    f32 = torch.float32
    return dict(conv_weight=rand(channels, conv_kernel, scale=0.5), conv_bias=rand(channels) if conv_bias else None,
                a_log=rand(heads, dt=f32, scale=0.5), d=rand(heads, dt=f32), dt_bias=rand(heads, dt=f32, scale=0.5),
                time_step_limit=time_step_limit, norm_weight=1 + rand(heads * head_dim, scale=0.2), eps=1e-5)


def check_mamba2(kernels, heads: int, groups: int, head_dim: int, state_size: int, conv_kernel: int,
                 chunk_size: int, time_step_limit: tuple[float, float], conv_bias: bool, dtype: torch.dtype,
                 ssm_dtype: torch.dtype, device: torch.device, seed: int = 0) -> CheckResult:
    """Mamba-2 kernels (layers/mamba2_kernels.py) on one rank's sizes against float64, the outputs through the
    gated norm: a prompt of chunk_size + 5 tokens (two chunks of the scan) from empty states, then two decode
    steps (step_and_norm_in_pool: the first in two calls of two rows, the second in one) of three sequences in a
    pool of four slots whose SSM states are kept in ssm_dtype, that prompt's sequence among them; kernels that say
    they are graph-safe get a padding row (slot -1) too, which must leave every slot alone."""
    from shardserve.kernels.mamba2_ssd import split_channels, step_sizes

    name = (f"{kernels.name} Mamba-2 ({heads}x{head_dim} heads in {groups} groups, state {state_size}, conv "
            f"{conv_kernel}, {str(ssm_dtype).removeprefix('torch.')} states)")
    tolerance = max(TOLERANCE.get(dtype, 1e-2), TOLERANCE.get(ssm_dtype, 1e-2))
    try:
        g = torch.Generator().manual_seed(seed)

        def rand(*shape, dt=dtype, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(dt).to(device)

        channels, inner = heads * head_dim + 2 * groups * state_size, heads * head_dim
        p = _mamba2_parameters(rand, heads, channels, conv_kernel, conv_bias, time_step_limit, dtype, head_dim)
        norm = functools.partial(kernels.norm, weight=p["norm_weight"], group_size=inner // groups, eps=p["eps"])
        # Each pool a view past a guard slot: a padding row that wrote "slot -1" as an address would land there.
        conv_buffer = rand(5, channels, conv_kernel - 1)
        ssm_buffer = rand(5, heads, head_dim, state_size, dt=ssm_dtype, scale=0.1)
        conv_pool, ssm_pool = conv_buffer[1:], ssm_buffer[1:]
        conv_pool[2], ssm_pool[2] = 0, 0
        untouched = [t[[0, 2]] for t in (conv_buffer, ssm_buffer)]  # copies of the guard and slot 1, no sequence's
        expected = {s: (conv_pool[s].clone(), ssm_pool[s].clone()) for s in (0, 2, 3)}
        # The prompt, through the chunked forms, into slot 2.
        xbc, dt, z = rand(chunk_size + 5, channels), rand(chunk_size + 5, heads), rand(chunk_size + 5, inner)
        mixed, conv_pool[2] = kernels.conv(xbc, p["conv_weight"], conv_pool[2], p["conv_bias"])
        xs, b, c = split_channels(mixed, heads, head_dim, groups)
        y, ssm = kernels.scan(xs, step_sizes(dt, p["dt_bias"], time_step_limit), -torch.exp(p["a_log"]), b, c, p["d"],
                              ssm_pool[2], chunk_size)
        ssm_pool[2] = ssm.to(ssm_dtype)
        ref, *expected[2] = mamba2_reference(xbc, dt, z, p, groups, *expected[2])
        worst = relative_error(norm(y.reshape(-1, inner), z), ref)
        slots = [2, 0, 3] + ([-1] if kernels.graph_safe else [])
        step_params = [p[k] for k in ("conv_weight", "conv_bias", "a_log", "d", "dt_bias", "time_step_limit")]
        # The first step in calls of two rows, the second in one call of all: kernels that take small batches
        # another way (the fused decode step) are checked in both.
        for calls in ([slots[0::2], slots[1::2]], [slots]):
            for call in calls:
                xbc, dt, z = rand(len(call), channels), rand(len(call), heads), rand(len(call), inner)
                out = kernels.step_and_norm_in_pool(xbc, dt, z, *step_params, groups, p["norm_weight"],
                                                    inner // groups, p["eps"], conv_pool, ssm_pool,
                                                    torch.tensor(call, device=device))
                for row, slot in enumerate(call):
                    if slot < 0:
                        continue
                    ref, *expected[slot] = mamba2_reference(xbc[row:row + 1], dt[row:row + 1], z[row:row + 1], p,
                                                            groups, *expected[slot])
                    worst = max(worst, relative_error(out[row:row + 1], ref))
        for slot, (conv, ssm) in expected.items():
            worst = max(worst, relative_error(ssm_pool[slot], ssm), relative_error(conv_pool[slot], conv))
        if not all(torch.equal(t[[0, 2]], kept) for t, kept in zip((conv_buffer, ssm_buffer), untouched)):
            return CheckResult(name, math.inf, tolerance, "a slot no sequence owns was written (or before the pool)")
        return CheckResult(name, worst, tolerance)
    except Exception as e:  # noqa: BLE001 - kernels that cannot run these shapes fail their check
        return CheckResult(name, math.inf, tolerance, f"{type(e).__name__}: {e}")
