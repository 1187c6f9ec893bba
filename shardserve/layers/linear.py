"""Linear layers that hold one rank's slice of a checkpoint tensor.

Each parameter carries `weight_loader(param, loaded, shard_id)`: the layer knows which rows or
columns of the checkpoint tensor it owns, so sharding lives next to the layer, not in the loader.
`loaded` is anything sliceable like a tensor (a safetensors slice reads only the rows asked for).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Hashable

import torch
from torch import nn

from shardserve.distributed.communicator import NORMED, Communicator, reduced_first
from shardserve.layers.activation import silu_and_mul
from shardserve.layers.linear_kernels import LinearKernel
from shardserve.weight_format import as_tensor

_DEFAULT_KERNEL = LinearKernel()
_deferred = False  # inside deferred_weights(): layers' weights (linear layers, experts) are built on the meta device


@contextlib.contextmanager
def deferred_weights():
    """Column- and row-parallel layers built inside take weights on the meta device (no memory), so each can
    become packed (layers/quantization/packed.py) or take its real weight (`materialize`) before loading."""
    global _deferred
    _deferred, before = True, _deferred
    try:
        yield
    finally:
        _deferred = before

Rows = tuple[int, int]  # [start, end) of the checkpoint tensor's first dimension


def copy_exact(target: torch.Tensor, loaded: Any) -> None:
    """target.copy_(loaded) where the shapes are equal; never a broadcast (a [1, H] weight read from a
    vector of H values would otherwise fill with its first value)."""
    tensor = as_tensor(loaded)
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"checkpoint tensor slice has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)


def weights_device() -> str | None:
    """Where a layer built now puts its weights: the meta device inside deferred_weights(), else the default."""
    return "meta" if _deferred else None


def empty_parameter(*shape: int, dtype: torch.dtype = torch.float32, device=None) -> nn.Parameter:
    """An uninitialised weight that takes no gradient."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def materialized(param: nn.Parameter, device) -> nn.Parameter:
    """param, or where it waits on the meta device (deferred_weights()), a real empty one on `device` with its
    weight_loader."""
    if not param.is_meta:
        return param
    real = empty_parameter(*param.shape, dtype=param.dtype, device=device)
    real.weight_loader = param.weight_loader
    return real


class KernelLinear(nn.Module):
    """A layer whose matmul runs through a LinearKernel. Before `use_kernel` it is plain F.linear on
    `self.weight`; afterwards the kernel's prepared form (`self.prepared`) replaces the weight, which
    must then not be reloaded in place."""

    kernel: LinearKernel = _DEFAULT_KERNEL
    prepared: Any = None
    # Whole on every rank (a block that does not split): the ranks compare its weights after loading
    # (weights/consistency.py), by the digest taken before a kernel prepared its own layout.
    replicated = False
    loaded_digest: str | None = None
    # Quantized weights kept packed (layers/quantization/packed.PackedWeights): its own matmul replaces the kernel's.
    packed: Any = None
    # Launched while decode attention runs (the o projection; kernels/triton/pdl.py): the batch-1 GEMV's programs
    # load all their weight rows before their wait, where start-up found a form that holds them (cuda_gemv.py).
    preloads_rows = False
    # A router: few rows whose programs load them whole before their wait in its norm-fused batch-1 GEMV
    # (cuda_gemv.whole_row_tiles), as grouped_topk's float32 routers do in theirs.
    loads_whole_rows = False
    # Whether the output goes to the next kernel as it is, no collective taking it first: then the batch-1 GEMV may
    # let that kernel launch at its start (kernels/triton/pdl.py's early launches).
    feeds_next_directly = False

    def _new_weight(self, rows: int, cols: int, dtype: torch.dtype, loader) -> None:
        self.weight = empty_parameter(rows, cols, dtype=dtype, device=weights_device())
        self.weight.weight_loader = loader

    def materialize(self, device: torch.device | str) -> None:
        """Give a layer built under deferred_weights() its real (empty) weight on `device`."""
        self.weight = materialized(self.weight, device)

    @property
    def fusable(self) -> bool:
        """Whether the kernel's fused forms (norm, SwiGLU) may read self.weight: a plain loaded weight."""
        return self.prepared is None and self.packed is None

    def use_kernel(self, kernel: LinearKernel) -> None:
        self.kernel = kernel
        if self.replicated:
            self.loaded_digest = tensor_digest(self.weight.data)
        self.prepared = kernel.prepare(self.weight.data)
        # Drop this module's reference to the loaded weight so its memory can go (a tied embedding
        # keeps its own reference for lookups).
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is not None:
            out = self.packed.matmul(self, x)
            return out if bias is None else out + bias
        return self.kernel(x, self.weight if self.prepared is None else self.prepared, bias)

    def matmul_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """matmul(silu(gate) * up) for gate_up = [gate | up]; one launch where the kernel fuses the two."""
        swiglu = getattr(self.kernel, "swiglu", None)
        if swiglu is not None and self.fusable:
            return swiglu(gate_up, self.weight)
        return self.matmul(silu_and_mul(gate_up))


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the weights as the model computes with them, bytes of extra copies) on this rank: parameters,
    plus linear layers' prepared forms (a kernel's packed layout replaces the parameter; a compact copy for
    decode steps, the tail of a prepared tuple, is extra)."""
    main = sum(p.numel() * p.element_size() for p in model.parameters())
    extra = 0
    for module in model.modules():
        prepared = getattr(module, "prepared", None)
        if prepared is None:
            continue
        parts = prepared if isinstance(prepared, tuple) else (prepared,)
        sizes = [t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor)]
        if sizes:
            main += sizes[0]
            extra += sum(sizes[1:])
    return main, extra


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 (first 16 hex digits) of a tensor's bytes."""
    data = t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def load_whole(param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
    tensor = as_tensor(loaded[:])
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)


class ColumnParallelLinear(KernelLinear):
    """y = x W^T + b where this rank holds some row ranges of one or more checkpoint tensors.

    `parts` maps a shard id (None for a plain layer, "q"/"k"/"v" or 0/1 for fused layers) to the rows
    of that checkpoint tensor this rank owns; the local weight stacks the parts in the given order.
    No communication: the output is this rank's slice of the features.
    """

    def __init__(self, input_size: int, parts: dict[Hashable, Rows], bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.offsets: dict[Hashable, tuple[int, Rows]] = {}
        offset = 0
        for shard_id, rows in parts.items():
            self.offsets[shard_id] = (offset, rows)
            offset += rows[1] - rows[0]
        self.output_size = offset
        self._new_weight(offset, input_size, dtype, self._load_rows)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(offset, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self._load_rows

    def _load_rows(self, param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        offset, (start, end) = self.offsets[shard_id]
        if self.packed is not None and param is not self.bias:
            self.packed.load(self, loaded, slice(offset, offset + end - start), (start, end), None, shard_id)
            return
        copy_exact(param.data[offset:offset + end - start], loaded[start:end])

    # A [gate | up] projection whose consumer takes silu(gate) * up (SwiGLUMLP): start-up times the kernel forms
    # that return that activation in place of the product (cuda_gemv.use_batch1_gemv).
    makes_swiglu_output = False
    feeds_next_directly = True  # no collective: each rank's slice of the features is its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def forward_swiglu(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(silu(gate) * up of forward(x), True) for a [gate | up] layer where the kernel computes it in the
        product's own launch (single tokens on GPUs), else (forward(x), False): the caller applies SwiGLU."""
        y = None
        if self.bias is None and self.packed is not None:
            y = self.packed.swiglu_out(self, x)
        elif self.bias is None and getattr(self.kernel, "swiglu_out", None) is not None and self.fusable:
            y = self.kernel.swiglu_out(x, self.weight)
        return (y, True) if y is not None else (self.forward(x), False)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm,
                       reduce: Communicator | None = None, keep_normed: bool = False) -> tuple[torch.Tensor, ...]:
        """(forward(norm(s)), s) with s = x + residual, or x without a residual: the norm before this layer
        (an RMSNorm module), fused into the matmul where the kernel can (single-token steps on GPUs). With
        `keep_normed`, (forward(norm(s)), norm(s), s), for other layers that take the same input.

        With `reduce`, x is the previous row-parallel layer's partial sum (RowParallelLinear.pending): it is
        all-reduced first, in the same kernel as the add and the norm where the communicator has one. With
        `reduce` NORMED, x is already norm(s) and residual s (RowParallelLinear.forward_add)."""
        y, h, residual, _ = self._normed(x, residual, norm, reduce, keep_normed, swiglu_out=False)
        return (y, h, residual) if keep_normed else (y, residual)

    def forward_normed_swiglu(self, x: torch.Tensor, residual: torch.Tensor | None, norm,
                              reduce: Communicator | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(y, s, activated): forward_normed of a [gate | up] layer, where y is silu(gate) * up of the product
        when `activated` (the kernel's SwiGLU-out forms, as forward_swiglu), else the product itself."""
        y, _, residual, activated = self._normed(x, residual, norm, reduce, False, swiglu_out=True)
        return y, residual, activated

    def _normed(self, x, residual, norm, reduce, keep_normed: bool, swiglu_out: bool):
        """(y, norm(s) with keep_normed, s, whether y is activated) for forward_normed and forward_normed_swiglu:
        the kernel's norm-fused launch where it has one (_norm_fused), else the norm followed by the product
        (forward_swiglu's where swiglu_out)."""
        x, residual, reduce = reduced_first(x, residual, norm, reduce)
        if reduce is NORMED:
            h = x
        else:
            out, activated = self._norm_fused(x, residual, norm, keep_normed, swiglu_out)
            if out is not None:
                y = out[0] if self.bias is None else out[0] + self.bias
                return y, (out[2] if keep_normed else None), out[1], activated
            h, residual = norm.with_sum(x, residual, next_early=True)
        y, activated = self.forward_swiglu(h) if swiglu_out else (self.forward(h), False)
        return y, (h if keep_normed else None), residual, activated

    def _norm_fused(self, x, residual, norm, keep_normed: bool, swiglu_out: bool) -> tuple[tuple | None, bool]:
        """(the result of one launch that normalises x + residual and multiplies, whether its product is
        activated): the packed weights' or the kernel's norm-fused form, with SwiGLU out first where asked and
        the layer has no bias; (None, False) where the norm must run on its own."""
        if self.packed is not None and not keep_normed:
            def fused(activate):
                return self.packed.normed(self, x, residual, norm.weight, norm.eps, swiglu_out=activate)
        elif getattr(self.kernel, "normed", None) is not None and self.fusable:
            def fused(activate):
                if not activate:
                    return self.kernel.normed(x, residual, norm.weight, norm.eps, self.weight, keep_normed=keep_normed,
                                              whole_rows=self.loads_whole_rows)
                form = getattr(self.kernel, "normed_swiglu_out", None)
                return None if form is None else form(x, residual, norm.weight, norm.eps, self.weight)
        else:
            return None, False
        if swiglu_out and self.bias is None:
            out = fused(True)
            if out is not None:
                return out, True
        return fused(False), False


class RowParallelLinear(KernelLinear):
    """y = sum over ranks of x_r W_r^T, plus b once: each rank holds the input columns `cols`.

    With `comm` None the layer is whole on this rank (replicated) and nothing is reduced. With
    `defer_reduction` the layer returns its partial sum and `pending` names the communicator the next
    layer must reduce it with (fused there with the residual add and the norm); only without a bias, which
    must be added once, after the reduction.
    """

    defer_reduction = False

    def __init__(self, cols: Rows, output_size: int, bias: bool, dtype: torch.dtype,
                 comm: Communicator | None) -> None:
        super().__init__()
        self.cols = cols
        self.comm = comm
        self._new_weight(output_size, cols[1] - cols[0], dtype, self._load_cols)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = load_whole

    @property
    def feeds_next_directly(self) -> bool:
        return self.comm is None  # else an all-reduce takes the partial sum first

    def defer(self) -> None:
        """Leave the reduction to the consumer of the output (see `pending`), where this layer can."""
        self.defer_reduction = self.comm is not None and self.bias is None

    @property
    def pending(self) -> Communicator | None:
        """The communicator the output still has to be all-reduced with, or None if it is complete."""
        return self.comm if self.defer_reduction else None

    def _load_cols(self, param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        start, end = self.cols
        if self.packed is not None:
            self.packed.load(self, loaded, slice(None), None, (start, end), shard_id)
            return
        copy_exact(param.data, loaded[:, start:end])

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor | None, next_norm,
                    swiglu_input: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, object]:
        """(forward(x), residual, pending), except where the layer defers its reduction and its kernel can do
        the all-reduce, the residual add and `next_norm` (the RMSNorm module the next layer starts with) in the
        GEMV's own launch (single tokens on GPUs of one host, kernels/triton/gemv_all_reduce.py): then
        (next_norm(s), s, NORMED) with s = residual + the output summed over the ranks, written over residual."""
        if self.defer_reduction and residual is not None and next_norm is not None and self.fusable:
            fused = getattr(self.kernel, "reduce_add_norm", None)
            out = fused(x, self.weight, residual, next_norm.weight, next_norm.eps, self.comm, swiglu_input) \
                if fused is not None else None
            if out is not None:
                return out[0], out[1], NORMED
        return self.forward(x, swiglu_input), residual, self.pending

    def forward(self, x: torch.Tensor, swiglu_input: bool = False) -> torch.Tensor:
        """With swiglu_input, x is [gate | up] and the layer's input is silu(gate) * up."""
        y = self.matmul_swiglu(x) if swiglu_input else self.matmul(x)
        if self.comm is not None and not self.defer_reduction:
            y = self.comm.all_reduce(y)
        # The bias is added after the reduction so it counts once, not once per rank.
        return y if self.bias is None else y + self.bias
