"""Moving a model's tensors between the working copy (on its device) and a host copy, for sleep/wake.

Every tensor the forward pass reads is moved: parameters, buffers (RoPE tables) and linear layers'
prepared kernel weights. While offloaded, each is replaced by an empty tensor of its dtype on the
device, so the working memory goes back to the allocator. On a GPU the host copy lives in pinned
memory (fast copies back); on a CPU the host copy is the tensor itself, so the same code path moves
references only and memory stays flat.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class HostCopy:
    """The offloaded tensors, by (module name, attribute, index in a tuple or -1)."""

    tensors: dict[tuple[str, str, int], torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _slots(model: nn.Module):
    """(module name, module, attribute, kind) for every tensor-holding attribute the forward pass reads."""
    for name, module in model.named_modules():
        for attr in list(module._parameters):
            yield name, module, attr, "param"
        for attr in list(module._buffers):
            yield name, module, attr, "buffer"
        if getattr(module, "prepared", None) is not None:
            yield name, module, "prepared", "attr"


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    return host.copy_(t, non_blocking=False)


def _get(module: nn.Module, attr: str, kind: str):
    if kind == "param":
        return module._parameters[attr]
    if kind == "buffer":
        return module._buffers[attr]
    return getattr(module, attr)


def _set(module: nn.Module, attr: str, kind: str, value) -> None:
    if kind == "param":
        module._parameters[attr].data = value
    elif kind == "buffer":
        module._buffers[attr] = value
    else:
        setattr(module, attr, value)


def offload(model: nn.Module, keep_host_copy: bool = True) -> HostCopy:
    """Replace every tensor by an empty placeholder on its device; returns the host copies (none if not
    keep_host_copy: the weights are then gone and must be reloaded from the checkpoint)."""
    copy = HostCopy()
    seen: dict[int, tuple[str, str, int]] = {}  # a tensor shared by two modules (tied embeddings) moves once
    for name, module, attr, kind in _slots(model):
        value = _get(module, attr, kind)
        if value is None:
            continue
        parts = value if isinstance(value, tuple) else (value,)
        placeholders = []
        for i, t in enumerate(parts):
            data = t.data if isinstance(t, nn.Parameter) else t
            key = (name, attr, i if isinstance(value, tuple) else -1)
            if keep_host_copy and data.numel() and id(data) not in seen:
                copy.tensors[key] = _to_host(data)
                seen[id(data)] = key
            elif keep_host_copy and id(data) in seen:
                copy.tensors[key] = copy.tensors[seen[id(data)]]
            placeholders.append(torch.empty(0, dtype=data.dtype, device=data.device))
        _set(module, attr, kind, tuple(placeholders) if isinstance(value, tuple) else placeholders[0])
    return copy


def restore(model: nn.Module, copy: HostCopy, device: torch.device) -> None:
    """Put the host copies back as the working tensors on `device` (the inverse of `offload`)."""
    moved: dict[int, torch.Tensor] = {}
    for name, module, attr, kind in _slots(model):
        value = _get(module, attr, kind)
        parts = value if isinstance(value, tuple) else (value,)
        restored = []
        for i, placeholder in enumerate(parts):
            host = copy.tensors.get((name, attr, i if isinstance(value, tuple) else -1))
            if host is None:
                restored.append(placeholder.data if isinstance(placeholder, nn.Parameter) else placeholder)
                continue
            if id(host) not in moved:
                moved[id(host)] = host.to(device, non_blocking=False)
            restored.append(moved[id(host)])
        _set(module, attr, kind, tuple(restored) if isinstance(value, tuple) else restored[0])
