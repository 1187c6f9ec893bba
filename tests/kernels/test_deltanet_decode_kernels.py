"""The Triton decode step of a Gated DeltaNet layer equals the torch one: the same delta-rule output and the same
states left in the same pool slots, for odd and power-of-two head sizes, several value heads a key head, in
float32 and bfloat16; a row with slot -1 (a CUDA graph's padding row) writes no slot. The decode step through the
output norm in one kernel (kernels/triton/deltanet_decode.py) equals the three kernels and torch, in a layer too.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import functools

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from shardserve.layers.deltanet_kernels import (TorchDeltaNetKernels, TritonDecodeDeltaNetKernels,  # noqa: E402
                                                TritonFusedDecodeDeltaNetKernels)

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


# -- the decode step through the output norm: one kernel (deltanet_decode.py) against the three and torch ----------


def _layer(key_heads: int, value_heads: int, key_dim: int, value_dim: int, kernel: int, dtype: torch.dtype,
           seed: int) -> tuple[dict, torch.Generator]:
    """A layer's weights and pools for step_and_norm_in_pool; each pool's buffer has a guard slot before the pool
    (a row that wrote "slot -1" as an address would land in it)."""
    g = torch.Generator().manual_seed(seed)
    channels = 2 * key_heads * key_dim + value_heads * value_dim

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(DEVICE)

    return dict(conv_weight=rand(channels, kernel), a_log=rand(value_heads, scale=0.5, dt=torch.float32),
                dt_bias=rand(value_heads, dt=torch.float32), norm_weight=1 + rand(value_dim, scale=0.2), eps=1e-6,
                scale=key_dim ** -0.5, key_heads=key_heads, conv_buffer=rand(SLOTS + 1, channels, kernel - 1),
                rec_buffer=rand(SLOTS + 1, value_heads, key_dim, value_dim, scale=0.3, dt=torch.float32)), g


def _widths(layer: dict) -> tuple[int, int]:
    """(channels, value_heads * value_dim): the widths of qkv and z."""
    value_heads, _, value_dim = layer["rec_buffer"].shape[1:]
    return layer["conv_weight"].shape[0], value_heads * value_dim


def _rows(layer: dict, rows: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's projection outputs: qkvz [rows, channels + value_heads * value_dim + 7] (qkv and z are views
    into it, as forward splits them), ba [rows, 2 * value_heads]."""
    dtype = layer["conv_weight"].dtype
    return (torch.randn(rows, sum(_widths(layer)) + 7, generator=g).to(dtype).to(DEVICE),
            (torch.randn(rows, 2 * layer["a_log"].shape[0], generator=g) * 2).to(dtype).to(DEVICE))


def _fused(*args, **kwargs) -> torch.Tensor:
    from shardserve.kernels.triton.deltanet_decode import step_and_norm_in_pool

    out = step_and_norm_in_pool(*args, **kwargs)
    assert out is not None, "the fused kernel had no arrival counts"
    return out


def _decode(step_and_norm, layer: dict, steps: list, slots: list[int], graph: bool = False):
    """Runs step_and_norm over `steps` (_rows) in a copy of the layer's pools, eagerly or replayed from a CUDA
    graph. Returns (each step's output, the conv buffer, the rec buffer): the buffers' slot 0 is the guard."""
    conv_buffer, rec_buffer = layer["conv_buffer"].clone(), layer["rec_buffer"].clone()
    weights = {k: v for k, v in layer.items() if not k.endswith("_buffer")}
    channels, z_width = _widths(layer)
    qkvz, ba = (t.clone() for t in steps[0])
    index = torch.tensor(slots, device=DEVICE)

    def step():
        return step_and_norm(qkvz[:, :channels], ba, qkvz[:, channels:channels + z_width], conv_pool=conv_buffer[1:],
                             rec_pool=rec_buffer[1:], slots=index, **weights)

    if graph:
        kept = conv_buffer.clone(), rec_buffer.clone()
        step()  # compiles, makes the arrival counts
        conv_buffer.copy_(kept[0]), rec_buffer.copy_(kept[1])
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            out = step()
    outs = []
    for rows in steps:
        qkvz.copy_(rows[0]), ba.copy_(rows[1])
        if graph:
            captured.replay()
        else:
            out = step()
        outs.append(out.clone())
    return outs, conv_buffer, rec_buffer


def arrivals_left_at_zero() -> bool:
    from shardserve.kernels.triton import arrivals

    return all(counts.count_nonzero().item() == 0 for counts in arrivals._counts.values())


def _assert_same_steps(got, expected, live: list[int], dtype: torch.dtype, expected_rows=None) -> None:
    """Outputs of the live rows (expected_rows: their rows in `expected`, by default the same) and pools alike."""
    # bfloat16: the same values rounded at the same places, but a last-bit difference in a norm can round an output
    # to its neighbour, which the weight and the gate then scale (a few bfloat16 steps).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=3e-2)
    rows = live if expected_rows is None else expected_rows
    for out, ref in zip(got[0], expected[0]):
        torch.testing.assert_close(out[live], ref[rows], **tol)
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)  # the convolution state is a copy of inputs
    torch.testing.assert_close(got[2], expected[2], **(tol if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))


@pytest.mark.parametrize("dtype, sizes", [
    (torch.bfloat16, (2, 4, 16, 32, 4)),  # Qwen3-Next's layout, smaller: two value heads a key head
    (torch.float32, (3, 6, 48, 80, 4)),   # dims not powers of two: masked keys, a masked last block of columns
    (torch.bfloat16, (1, 3, 12, 20, 2)),  # three value heads a key head, a two-tap convolution
])
def test_the_one_kernel_decode_step_equals_the_three_kernels_and_torch(dtype, sizes):
    """Two steps in a row (the second reads the convolution window the first shifted), a padding row among three:
    the same normed rows and the same states as the three kernels; torch, without the padding row, agrees; the
    padding row, the slots no row owns and the guard before the pool are left as they were."""
    layer, g = _layer(*sizes, dtype, seed=sum(sizes))
    slots, live = [4, -1, 2], [0, 2]
    steps = [_rows(layer, len(slots), g) for _ in range(2)]
    fused = _decode(_fused, layer, steps, slots)
    _assert_same_steps(fused, _decode(TritonDecodeDeltaNetKernels.step_and_norm_in_pool, layer, steps, slots),
                       live, dtype)
    live_steps = [tuple(t[live] for t in rows) for rows in steps]
    reference = _decode(TorchDeltaNetKernels.step_and_norm_in_pool, layer, live_steps, [4, 2])
    _assert_same_steps(fused, reference, live, dtype, expected_rows=[0, 1])
    for buffer, name in ((fused[1], "conv_buffer"), (fused[2], "rec_buffer")):
        kept = [0, 1, 2, 4, 6]  # the guard and slots 0, 1, 3, 5 (buffer index = slot + 1)
        assert torch.equal(buffer[kept], layer[name][kept]), "a slot no row owns was written"
    assert arrivals_left_at_zero()


@pytest.mark.parametrize("value_block, num_warps", [(8, 2), (16, 8)])
def test_the_one_kernel_at_other_launch_shapes_equals_the_three_kernels(value_block, num_warps):
    """Narrower column blocks (more programs to count in before a key head's norm, a masked last block at 20
    columns) and other warps: the same steps as the three kernels."""
    layer, g = _layer(2, 4, 16, 20, 4, torch.float32, seed=value_block)
    slots = [1, -1, 3]
    steps = [_rows(layer, len(slots), g) for _ in range(2)]
    fused = _decode(functools.partial(_fused, value_block=value_block, num_warps=num_warps), layer, steps, slots)
    _assert_same_steps(fused, _decode(TritonDecodeDeltaNetKernels.step_and_norm_in_pool, layer, steps, slots),
                       [0, 2], torch.float32)
    assert arrivals_left_at_zero()


def test_without_arrival_counts_the_fused_kernels_take_the_three(monkeypatch):
    """Where the device's arrival counts are too few for B x key heads (or would be made inside a capture), the fused
    kernels' decode step is the three kernels'."""
    from shardserve.kernels.triton import deltanet_decode

    layer, g = _layer(1, 2, 8, 8, 4, torch.float32, seed=5)
    steps = [_rows(layer, 2, g)]
    monkeypatch.setattr(deltanet_decode, "arrival_counts", lambda device, slots: None)
    fused = _decode(TritonFusedDecodeDeltaNetKernels.step_and_norm_in_pool, layer, steps, [3, 1])
    chain = _decode(TritonDecodeDeltaNetKernels.step_and_norm_in_pool, layer, steps, [3, 1])
    assert all(torch.equal(a, b) for a, b in zip(fused[0] + [fused[1], fused[2]], chain[0] + [chain[1], chain[2]]))


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
@pytest.mark.parametrize("slots", [[5], [5, 0, -1, 2]], ids=["batch-1", "batch-4"])
def test_on_cuda_the_one_kernel_equals_the_three_at_qwen3_next_size(slots, graph):
    """One rank of Qwen3-Next-80B-A3B (16 key heads, 32 value heads of 128 x 128, a four-tap convolution) in
    bfloat16 on a GPU, two steps, eager and replayed from a CUDA graph: the one kernel and the three agree."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    layer, g = _layer(16, 32, 128, 128, 4, torch.bfloat16, seed=len(slots))
    steps = [_rows(layer, len(slots), g) for _ in range(2)]
    live = [row for row, slot in enumerate(slots) if slot >= 0]
    fused = _decode(_fused, layer, steps, slots, graph)
    _assert_same_steps(fused, _decode(TritonDecodeDeltaNetKernels.step_and_norm_in_pool, layer, steps, slots, graph),
                       live, torch.bfloat16)
    assert arrivals_left_at_zero()


def test_a_layer_decodes_through_the_one_kernel_as_through_torch():
    """GatedDeltaNet.forward's decode step (query_start None) on the fused kernels gives the torch kernels' output
    and states: z read in place from the input projection's output, the layer's norm weight and eps."""
    from shardserve.distributed.communicator import Communicator
    from shardserve.layers.gated_deltanet import DeltaNetDims, GatedDeltaNet
    from tests.helpers.state_mixers import check_decode_step_kernels_agree

    layer = GatedDeltaNet(DeltaNetDims(32, 2, 4, 16, 24, 4, 1e-6), Communicator(None, 0, 1), torch.float32)
    check_decode_step_kernels_agree(layer, 32, TorchDeltaNetKernels(), TritonFusedDecodeDeltaNetKernels(), SLOTS,
                                    DEVICE)
