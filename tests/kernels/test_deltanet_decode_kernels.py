"""The Triton decode step of a Gated DeltaNet layer equals the torch one: the same delta-rule output and the same
states left in the same pool slots, for odd and power-of-two head sizes, several value heads a key head, in
float32 and bfloat16; a row with slot -1 (a CUDA graph's padding row) writes no slot.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from shardserve.layers.deltanet_kernels import TorchDeltaNetKernels, TritonDecodeDeltaNetKernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS = 6


def _inputs(rows: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int, kernel: int,
            dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    channels = 2 * key_heads * key_dim + value_heads * value_dim

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(DEVICE)

    # qkv and ba as views into wider rows, as they come out of the fused input projection.
    qkvz = rand(rows, channels + 7)
    return dict(qkv=qkvz[:, :channels], ba=rand(rows, 2 * value_heads, scale=2.0), conv_weight=rand(channels, kernel),
                a_log=rand(value_heads, scale=0.5, dt=torch.float32),
                dt_bias=rand(value_heads, dt=torch.float32), scale=key_dim ** -0.5, key_heads=key_heads,
                conv_pool=rand(SLOTS, channels, kernel - 1),
                rec_pool=rand(SLOTS, value_heads, key_dim, value_dim, scale=0.3, dt=torch.float32))


def _step(kernels, inputs: dict, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pools = {name: inputs[name].clone() for name in ("conv_pool", "rec_pool")}
    o = kernels.step_in_pool(**{**inputs, **pools}, slots=torch.tensor(slots, device=DEVICE))
    return o, pools["conv_pool"], pools["rec_pool"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("key_heads, value_heads, key_dim, value_dim, kernel", [
    (1, 3, 12, 20, 4),   # odd sizes: masked lanes in both kernels
    (2, 4, 16, 64, 4),   # two value blocks a head
    (3, 3, 8, 8, 2),     # one value head a key head, a two-tap convolution
])
def test_triton_decode_step_equals_torch(dtype, key_heads, value_heads, key_dim, value_dim, kernel):
    inputs = _inputs(3, key_heads, value_heads, key_dim, value_dim, kernel, dtype, seed=key_dim + kernel)
    slots = [4, 0, 2]
    o, conv, rec = _step(TritonDecodeDeltaNetKernels, inputs, slots)
    ref_o, ref_conv, ref_rec = _step(TorchDeltaNetKernels, inputs, slots)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(o, ref_o, **tol)
    torch.testing.assert_close(conv, ref_conv, atol=0, rtol=0)  # the convolution state is a copy of inputs
    torch.testing.assert_close(rec, ref_rec, **tol)
    untouched = [s for s in range(SLOTS) if s not in slots]
    assert torch.equal(rec[untouched], inputs["rec_pool"][untouched]), "a slot no row owns was written"


def test_a_padding_row_writes_no_slot():
    inputs = _inputs(3, 1, 2, 8, 8, 4, torch.float32, seed=3)
    o, conv, rec = _step(TritonDecodeDeltaNetKernels, inputs, [1, -1, 3])
    live = _inputs(3, 1, 2, 8, 8, 4, torch.float32, seed=3)
    keep = torch.tensor([0, 2], device=DEVICE)
    live = {**live, "qkv": live["qkv"][keep], "ba": live["ba"][keep]}
    ref_o, ref_conv, ref_rec = _step(TorchDeltaNetKernels, live, [1, 3])
    torch.testing.assert_close(o[keep], ref_o, atol=1e-5, rtol=1e-5)
    assert torch.equal(conv, ref_conv) and torch.allclose(rec, ref_rec, atol=1e-5)
    for slot in (0, 2, 4, 5):
        assert torch.equal(rec[slot], inputs["rec_pool"][slot]) and torch.equal(conv[slot], inputs["conv_pool"][slot])
