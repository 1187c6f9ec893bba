"""The Triton decode step of a Mamba-2 layer equals the torch one: the same SSM output and the same states left in
the same pool slots, for one and two B/C groups, masked head and state sizes, with and without the convolution's
bias and a time-step limit, SSM states kept in float32 or bfloat16; a row with slot -1 (a CUDA graph's padding
row) reads and writes no slot. The grouped gated norm in one kernel equals its torch form.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from shardserve.layers.mamba2_kernels import TorchMamba2Kernels, TritonDecodeMamba2Kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS = 5
HEADS, HEAD_DIM, STATE, KERNEL = 4, 12, 10, 4  # head_dim and state_size below their powers of two: masked lanes


def _inputs(groups: int, ssm_dtype: torch.dtype, bias: bool, limit: tuple[float, float], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    channels = HEADS * HEAD_DIM + 2 * groups * STATE

    def rand(*shape, scale=1.0, dt=torch.float32):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(DEVICE)

    # xbc and dt as views into wider rows, as they come out of the fused input projection.
    projected = rand(4, 3 + channels + HEADS)
    return dict(xbc=projected[:, 3:3 + channels], dt=projected[:, 3 + channels:],
                conv_weight=rand(channels, KERNEL, scale=0.5), conv_bias=rand(channels) if bias else None,
                a_log=rand(HEADS, scale=0.5), d=rand(HEADS), dt_bias=rand(HEADS, scale=0.5), time_step_limit=limit,
                groups=groups, conv_pool=rand(SLOTS, channels, KERNEL - 1),
                ssm_pool=rand(SLOTS, HEADS, HEAD_DIM, STATE, dt=ssm_dtype))


def _step(kernels, inputs: dict, rows: list[int], slots: list[int]):
    pools = {name: inputs[name].clone() for name in ("conv_pool", "ssm_pool")}
    picked = {name: inputs[name][rows] for name in ("xbc", "dt")}
    y = kernels.step_in_pool(**{**inputs, **pools, **picked}, slots=torch.tensor(slots, device=DEVICE))
    return y, pools["conv_pool"], pools["ssm_pool"]


@pytest.mark.parametrize("groups, ssm_dtype, bias, limit", [
    (1, torch.float32, True, (0.0, float("inf"))),
    (2, torch.float32, False, (0.05, 0.8)),  # the limit clamps some heads' steps on both sides
    (2, torch.bfloat16, True, (0.0, float("inf"))),  # states stored rounded, stepped in float32
])
def test_triton_decode_step_equals_torch_and_skips_padding_rows(groups, ssm_dtype, bias, limit):
    inputs = _inputs(groups, ssm_dtype, bias, limit, seed=groups)
    slots = [3, -1, 0, 2]
    y, conv, ssm = _step(TritonDecodeMamba2Kernels, inputs, [0, 1, 2, 3], slots)
    live = [0, 2, 3]
    ref_y, ref_conv, ref_ssm = _step(TorchMamba2Kernels, inputs, live, [slots[r] for r in live])
    tol = dict(atol=1e-5, rtol=1e-5) if ssm_dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(y[live], ref_y, **tol)
    torch.testing.assert_close(conv, ref_conv, atol=0, rtol=0)  # the convolution state is a copy of inputs
    torch.testing.assert_close(ssm.float(), ref_ssm.float(), **tol)
    for slot in (1, 4):  # no row's, and the padding row's slot -1 read as the last
        assert torch.equal(ssm[slot], inputs["ssm_pool"][slot]) and torch.equal(conv[slot], inputs["conv_pool"][slot])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_grouped_gated_norm_equals_the_torch_form(dtype):
    g = torch.Generator().manual_seed(5)
    rows, groups, group_size = 3, 2, 24  # a group of three heads of 8: not a power of two
    weight = (0.5 + torch.rand(groups * group_size, generator=g)).to(dtype).to(DEVICE)
    y = (torch.randn(rows, groups * group_size, generator=g) * 3).to(DEVICE)
    projected = torch.randn(rows, 5 + groups * group_size, generator=g).to(dtype).to(DEVICE)
    z = projected[:, 5:]  # a view with the projection's row stride, as forward splits it
    expected = TorchMamba2Kernels.norm(y, z, weight, group_size, 1e-5)
    out = TritonDecodeMamba2Kernels.norm(y, z, weight, group_size, 1e-5)
    assert out.dtype == dtype and out.shape == (rows, groups * group_size)
    # bfloat16: both round the normalised values, then the product; a last-bit difference in the norm can round a
    # value to its neighbour, which the weight then scales.
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, expected, **tol)


# -- the decode step through the output norm: one kernel (mamba2_decode.py) against the three and torch -------------


def _normed_step(step_and_norm, inputs: dict, steps: list, slots: list[int], group_size: int,
                 graph: bool = False):
    """step_and_norm over `steps` ((xbc, dt, z) rows) in a copy of the pools, each buffer with a guard slot before the
    pool (a row that wrote "slot -1" as an address would land in it), eagerly or replayed from a CUDA graph. Returns
    (each step's output, the conv buffer, the ssm buffer): the buffers' slot 0 is the guard."""
    buffers = {name: torch.cat([inputs[name][:1] * 0 + 7, inputs[name]]) for name in ("conv_pool", "ssm_pool")}
    weights = {k: v for k, v in inputs.items() if k not in ("xbc", "dt", "conv_pool", "ssm_pool")}
    channels, heads = inputs["xbc"].shape[1], inputs["dt"].shape[1]
    projected = torch.cat([t.clone() for t in steps[0]], dim=1)  # one row [xbc | dt | z], as forward splits it
    index = torch.tensor(slots, device=DEVICE)

    def step():
        xbc, dt, z = projected.split([channels, heads, projected.shape[1] - channels - heads], dim=1)
        return step_and_norm(xbc, dt, z, **weights, norm_weight=inputs["norm_weight"], group_size=group_size,
                             eps=1e-5, conv_pool=buffers["conv_pool"][1:], ssm_pool=buffers["ssm_pool"][1:],
                             slots=index)

    weights.pop("norm_weight")
    if graph:
        kept = {name: b.clone() for name, b in buffers.items()}
        step()  # compiles, makes the arrival counts
        for name, b in buffers.items():
            b.copy_(kept[name])
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            out = step()
    outs = []
    for rows in steps:
        projected.copy_(torch.cat(rows, dim=1))
        if graph:
            captured.replay()
        else:
            out = step()
        outs.append(out.clone())
    return outs, buffers["conv_pool"], buffers["ssm_pool"]


def _fused(*args, **kwargs) -> torch.Tensor:
    from shardserve.kernels.triton.mamba2_decode import step_and_norm_in_pool

    out = step_and_norm_in_pool(*args, **kwargs)
    assert out is not None, "the fused kernel did not run"
    return out


def _layer(heads: int, head_dim: int, state: int, groups: int, kernel: int, ssm_dtype: torch.dtype,
           dtype: torch.dtype, bias: bool, seed: int) -> tuple[dict, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    channels = heads * head_dim + 2 * groups * state

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(DEVICE)

    return dict(xbc=rand(1, channels), dt=rand(1, heads), conv_weight=rand(channels, kernel, scale=0.5),
                conv_bias=rand(channels) if bias else None, a_log=rand(heads, scale=0.5, dt=torch.float32),
                d=rand(heads, dt=torch.float32), dt_bias=rand(heads, scale=0.5, dt=torch.float32),
                time_step_limit=(0.05, 0.8), groups=groups, norm_weight=1 + rand(heads * head_dim, scale=0.2),
                conv_pool=rand(SLOTS, channels, kernel - 1),
                ssm_pool=rand(SLOTS, heads, head_dim, state, dt=ssm_dtype)), g


def _step_rows(inputs: dict, rows: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = inputs["conv_weight"].dtype
    channels, heads = inputs["xbc"].shape[1], inputs["dt"].shape[1]
    width = inputs["norm_weight"].shape[0]
    return tuple((torch.randn(rows, n, generator=g) * s).to(dtype).to(DEVICE)
                 for n, s in ((channels, 1.0), (heads, 1.0), (width, 1.0)))


def _arrivals_left_at_zero() -> bool:
    from shardserve.kernels.triton import arrivals

    return all(counts.count_nonzero().item() == 0 for counts in arrivals._counts.values())


def _assert_same(got, expected, live: list[int], dtype: torch.dtype, ssm_dtype: torch.dtype,
                 expected_rows=None) -> None:
    # bfloat16: the same values rounded at the same places, but a last-bit difference in a norm can round an output
    # to its neighbour, which the weight then scales.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=3e-2)
    rows = live if expected_rows is None else expected_rows
    for out, ref in zip(got[0], expected[0]):
        torch.testing.assert_close(out[live], ref[rows], **tol)
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)  # the convolution state is a copy of inputs
    # bfloat16 states are rounded after each step; the torch form's products round a little differently, and two
    # steps can put a value a few bfloat16 steps from the kernels' (which agree with each other to one step)
    state_tol = dict(atol=1e-5, rtol=1e-5) if ssm_dtype == torch.float32 else dict(atol=0.15, rtol=4e-2)
    torch.testing.assert_close(got[2].float(), expected[2].float(), **state_tol)


@pytest.mark.parametrize("heads, head_dim, state, groups, kernel, ssm_dtype, dtype, bias, norm_block", [
    (4, 12, 10, 2, 4, torch.float32, torch.float32, True, None),    # masked head_dim and state lanes
    (3, 40, 16, 1, 4, torch.float32, torch.float32, False, 16),     # three row blocks a head; the norm in chunks
    (6, 16, 8, 3, 2, torch.bfloat16, torch.bfloat16, True, None),   # bfloat16 states, a two-tap convolution
])
def test_the_one_kernel_decode_step_equals_the_three_kernels_and_torch(monkeypatch, heads, head_dim, state, groups,
                                                                       kernel, ssm_dtype, dtype, bias, norm_block):
    """Two steps in a row (the second reads the B and C windows the first shifted), a padding row among three: the
    same normed rows and the same states as the three kernels; torch, without the padding row, agrees; the padding
    row, the slots no row owns and the guard before the pool are left as they were."""
    from shardserve.kernels.triton import mamba2_decode

    if norm_block:
        monkeypatch.setattr(mamba2_decode, "_NORM_BLOCK", norm_block)
    inputs, g = _layer(heads, head_dim, state, groups, kernel, ssm_dtype, dtype, bias, seed=heads + head_dim)
    group_size = heads // groups * head_dim
    slots, live = [4, -1, 2], [0, 2]
    steps = [_step_rows(inputs, len(slots), g) for _ in range(2)]
    fused = _normed_step(_fused, inputs, steps, slots, group_size)
    _assert_same(fused, _normed_step(TritonDecodeMamba2Kernels.step_and_norm_in_pool, inputs, steps, slots,
                                     group_size), live, dtype, ssm_dtype)
    live_steps = [tuple(t[live] for t in rows) for rows in steps]
    reference = _normed_step(TorchMamba2Kernels.step_and_norm_in_pool, inputs, live_steps, [4, 2], group_size)
    _assert_same(fused, reference, live, dtype, ssm_dtype, expected_rows=[0, 1])
    for buffer, name in ((fused[1], "conv_pool"), (fused[2], "ssm_pool")):
        assert torch.equal(buffer[0], inputs[name][0] * 0 + 7), "the guard before the pool was written"
        kept = [0, 1, 3]  # slots no row owns
        assert torch.equal(buffer[1:][kept], inputs[name][kept]), "a slot no row owns was written"
    assert _arrivals_left_at_zero()


def test_where_the_norm_groups_are_not_the_state_groups_the_fused_kernels_take_the_three(monkeypatch):
    """A norm over other groups than B/C's (or no arrival counts): the fused kernels' step is the three kernels'."""
    from shardserve.kernels.triton import mamba2_decode
    from shardserve.layers.mamba2_kernels import TritonFusedDecodeMamba2Kernels

    inputs, g = _layer(4, 8, 8, 2, 4, torch.float32, torch.float32, True, seed=9)
    steps = [_step_rows(inputs, 2, g)]
    assert mamba2_decode.step_and_norm_in_pool(*[t[:, :1] for t in steps[0][:1]], *steps[0][1:], None, None, None,
                                               None, None, (0.0, 1.0), 2, inputs["norm_weight"], 8, 1e-5, None,
                                               inputs["ssm_pool"], None) is None
    for group_size in (8, 16):  # four norm groups of one head, then two of two heads with no arrival counts
        if group_size == 16:
            monkeypatch.setattr(mamba2_decode, "arrival_counts", lambda device, slots: None)
        fused = _normed_step(TritonFusedDecodeMamba2Kernels.step_and_norm_in_pool, inputs, steps, [3, 1], group_size)
        chain = _normed_step(TritonDecodeMamba2Kernels.step_and_norm_in_pool, inputs, steps, [3, 1], group_size)
        assert all(torch.equal(a, b) for a, b in zip(fused[0] + [fused[1], fused[2]], chain[0] + [chain[1], chain[2]]))


def test_a_layer_decodes_through_the_one_kernel_as_through_torch():
    """Mamba2Mixer.forward's decode step (query_start None) on the fused kernels gives the torch kernels' output and
    states: z read in place from the input projection's output, the layer's norm weight, group size and eps."""
    from shardserve.distributed.communicator import Communicator
    from shardserve.layers.mamba2 import Mamba2Dims, Mamba2Mixer
    from shardserve.layers.mamba2_kernels import TritonFusedDecodeMamba2Kernels
    from tests.helpers.state_mixers import check_decode_step_kernels_agree

    layer = Mamba2Mixer(Mamba2Dims(32, 4, 8, 8, 2, 4, 16, 1e-5), Communicator(None, 0, 1), torch.float32)
    check_decode_step_kernels_agree(layer, 32, TorchMamba2Kernels(), TritonFusedDecodeMamba2Kernels(), SLOTS, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
@pytest.mark.parametrize("slots", [[5 - 1], [4, 0, -1, 2]], ids=["batch-1", "batch-4"])
def test_on_cuda_the_one_kernel_equals_the_three_at_nemotron3_nano_size(slots, graph):
    """One rank of Nemotron-3-Nano (64 heads of 64 x 128 in 8 groups, a four-tap convolution with bias) in bfloat16
    with float32 states on a GPU, two steps, eager and replayed from a CUDA graph: the one kernel and the three
    agree."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    inputs, g = _layer(64, 64, 128, 8, 4, torch.float32, torch.bfloat16, True, seed=len(slots))
    steps = [_step_rows(inputs, len(slots), g) for _ in range(2)]
    live = [row for row, slot in enumerate(slots) if slot >= 0]
    fused = _normed_step(_fused, inputs, steps, slots, 512, graph)
    chain = _normed_step(TritonDecodeMamba2Kernels.step_and_norm_in_pool, inputs, steps, slots, 512, graph)
    _assert_same(fused, chain, live, torch.bfloat16, torch.float32)
    assert _arrivals_left_at_zero()


def test_past_a_few_rows_the_fused_kernels_take_the_three(monkeypatch):
    """Batches of more than FUSED_MAX_ROWS rows (where the one kernel is slower) take the three kernels; up to it,
    the one kernel."""
    from shardserve.kernels.triton import mamba2_decode
    from shardserve.layers import mamba2_kernels

    calls = []
    one_kernel = mamba2_decode.step_and_norm_in_pool
    monkeypatch.setattr(mamba2_decode, "step_and_norm_in_pool", lambda *a: calls.append(len(a[0])) or one_kernel(*a))
    inputs, g = _layer(4, 8, 8, 2, 4, torch.float32, torch.float32, True, seed=11)
    rows = mamba2_kernels.FUSED_MAX_ROWS + 1
    steps = [_step_rows(inputs, rows, g)]
    slots = list(range(rows))
    fused = _normed_step(mamba2_kernels.TritonFusedDecodeMamba2Kernels.step_and_norm_in_pool, inputs, steps, slots, 16)
    chain = _normed_step(TritonDecodeMamba2Kernels.step_and_norm_in_pool, inputs, steps, slots, 16)
    assert not calls
    assert all(torch.equal(a, b) for a, b in zip(fused[0] + [fused[1], fused[2]], chain[0] + [chain[1], chain[2]]))
    _normed_step(mamba2_kernels.TritonFusedDecodeMamba2Kernels.step_and_norm_in_pool, inputs,
                 [tuple(t[:rows - 1] for t in steps[0])], slots[:-1], 16)
    assert calls == [rows - 1]
