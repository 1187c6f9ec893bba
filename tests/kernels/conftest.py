"""Fixtures for the kernel tests."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch


def _allow_one_element_arrays_as_indices() -> None:
    """Triton 3.6's interpreter turns scalars (1-element arrays) into loop bounds with int(), which numpy >= 2.4
    rejects (triton-lang/triton#9171); loops whose bounds are kernel arguments or read from memory need it.
    Interpreter only."""
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.ones(1))
        return
    except TypeError:
        pass
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        _allow_one_element_arrays_as_indices()


@pytest.fixture
def bfloat16_dot_in_the_interpreter(monkeypatch):
    """Triton 3.6's interpreter keeps bfloat16 as its uint16 bits and tl.dot multiplies those bits as integers;
    decode them to float32 first (exact), so bfloat16 kernels can be checked without a GPU. Nothing on CUDA."""
    if torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def decoded(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        lambda self, a, b, d, *rest: dot(self, decoded(a), decoded(b), d, *rest))
