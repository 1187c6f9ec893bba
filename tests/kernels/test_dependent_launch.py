"""Kernels launched to overlap the one before them (programmatic dependent launch, Hopper and newer) give the
same bits as launched one after another: a chain of decode-step kernels, each reading the output of the one
before, replayed from a CUDA graph (GPU machine)."""

from __future__ import annotations

import pytest
import torch

LAYERS = 24
HIDDEN, INTERMEDIATE = 1024, 2816


def _needs_hopper() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs a GPU of compute capability 9.0 or newer")


def _weights(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g, device="cuda") * shape[-1] ** -0.5).to(torch.bfloat16)

    return [(rand(3 * HIDDEN, HIDDEN), rand(HIDDEN, HIDDEN), rand(2 * INTERMEDIATE, HIDDEN),
             rand(HIDDEN, INTERMEDIATE), 1 + rand(HIDDEN) * 0.1) for _ in range(LAYERS)]


HEADS, HEAD_DIM, BLOCK = 8, 128, 16


def _step_inputs() -> dict:
    """A one-sequence cache of 64 slots (the token at position 39) and rotary tables, made before any capture."""
    g = torch.Generator(device="cuda").manual_seed(5)
    cache = torch.randn(2, 64, HEADS, HEAD_DIM, generator=g, device="cuda").to(torch.bfloat16)
    angles = torch.rand(64, HEAD_DIM, generator=g, device="cuda")
    return dict(k_cache=cache[0], v_cache=cache[1],
                tables=torch.arange(4, dtype=torch.int32, device="cuda").view(1, 4),
                context=torch.tensor([40], dtype=torch.int32, device="cuda"),
                positions=torch.tensor([39], device="cuda"), slots=torch.tensor([39], device="cuda"),
                cos=angles.cos().to(torch.bfloat16), sin=angles.sin().to(torch.bfloat16))


def _chain(x: torch.Tensor, layers, s: dict, rotary: str) -> torch.Tensor:
    """A decoder-like chain at batch 1: norm-fused QKV GEMV, rotary + cache write (rotary "separate": a kernel of
    its own; "fused": inside the decode launch, which loads its first cached tile before its wait), decode
    attention over 40 cached tokens (split in 4), o_proj GEMV, the gate/up GEMV with the norm inside (rotary
    "fused") or after the norm kernel (rotary "separate"), SwiGLU-fused down GEMV; every kernel reads its
    predecessor's output."""
    from shardserve.kernels.triton.fused_ops import apply_rotary_and_store_, fused_add_rms_norm
    from shardserve.kernels.triton.gemv import gemv, gemv_rmsnorm, gemv_swiglu, row_tiles
    from shardserve.kernels.triton.paged_decode import NewTokens, paged_decode_attention

    heads, head_dim = HEADS, HEAD_DIM
    x = x.clone()  # the first layer's residual is x itself, which the norm kernel overwrites with its sum
    residual = None
    for qkv_w, o_w, gate_up_w, down_w, norm_w in layers:
        qkv, residual = gemv_rmsnorm(x, residual, norm_w, 1e-6, qkv_w, 16, 512, 8, 1)
        qkv = qkv.view(1, 3 * heads, head_dim)
        qk, v = qkv[:, :2 * heads], qkv[:, 2 * heads:]
        new = None
        if rotary == "fused":
            new = NewTokens(qk[:, heads:], v, s["slots"], s["cos"], s["sin"])
        else:
            apply_rotary_and_store_(qk, heads, v, s["positions"], s["cos"], s["sin"], s["k_cache"],
                                    s["v_cache"], s["slots"])
        # With the rotation inside, attention lets the o projection launch at its start (next_early), and the o
        # projection loads its whole rows before its wait (as layers/attention.overlap_with_o_projection sets up).
        attn = paged_decode_attention(qk[:, :heads], s["k_cache"], s["v_cache"], s["tables"], s["context"],
                                      head_dim ** -0.5, BLOCK, num_splits=4, new_tokens=new,
                                      next_early=rotary == "fused")
        x = gemv(attn.reshape(1, HIDDEN), o_w, 8, 512, 4, 1, row_tiles(HIDDEN, 512) if rotary == "fused" else None)
        if rotary == "fused":
            gate_up, residual = gemv_rmsnorm(x, residual, norm_w, 1e-6, gate_up_w, 16, 512, 8, 1)
        else:
            # The norm lets the GEMV after it launch at its start (pdl.py's early launches).
            normed, residual = fused_add_rms_norm(x, residual, norm_w, 1e-6, next_early=True)
            gate_up = gemv(normed, gate_up_w, 16, 512, 8, 1)
        x = gemv_swiglu(gate_up, down_w, 4, 1024, 8, 4)
    return x + residual


def _replayed(set_env, pdl: str, layers, x, rotary: str) -> torch.Tensor:
    set_env(SHARDSERVE_PDL=pdl)
    static_x, inputs = x.clone(), _step_inputs()
    _chain(static_x, layers, _step_inputs(), rotary)  # compiles every variant before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(static_x, layers, inputs, rotary)
    results = []
    for _ in range(3):  # the cache slot written is the same each replay, with the same values
        graph.replay()
        results.append(out.clone())
    torch.cuda.synchronize()
    assert all(torch.equal(r, results[0]) for r in results), "replays of one graph disagree"
    return results[0]


@pytest.mark.gpu
@pytest.mark.parametrize("rotary", ["separate", "fused"])
def test_dependent_launch_keeps_every_bit_of_a_decode_chain(monkeypatch, set_env, rotary):
    _needs_hopper()
    from shardserve.kernels.triton import pdl

    layers = _weights(3)
    x = torch.randn(1, HIDDEN, device="cuda").to(torch.bfloat16)
    serial = _replayed(set_env, "off", layers, x, rotary)
    overlapped = _replayed(set_env, "on", layers, x, rotary)
    assert pdl.active(x.device)
    assert torch.isfinite(serial).all()
    assert torch.equal(overlapped, serial)
    # GEMVs that load their first weight tiles before the wait (none, one: the default, two): the same bits.
    for tiles in ("0", "2"):
        set_env(SHARDSERVE_GEMV_PRELOAD=tiles)
        assert torch.equal(_replayed(set_env, "on", layers, x, rotary), serial), f"{tiles} tiles preloaded"
    # Attention letting the o projection launch at its start, or after its wait: the same bits.
    set_env(SHARDSERVE_ATTENTION_OVERLAP="off")
    assert torch.equal(_replayed(set_env, "on", layers, x, rotary), serial)
    # The norm letting the GEMV after it launch at its start, or after its wait: the same bits.
    set_env(SHARDSERVE_NEXT_EARLY="off")
    assert torch.equal(_replayed(set_env, "on", layers, x, rotary), serial)


def test_a_bad_mode_is_named(set_env):
    pytest.importorskip("triton")
    from shardserve.kernels.triton import pdl

    set_env(SHARDSERVE_PDL="yes")
    with pytest.raises(ValueError, match="SHARDSERVE_PDL='yes'.*auto, on, off"):
        pdl.mode()
