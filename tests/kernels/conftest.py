"""Fixtures for the kernel tests."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.triton_interpreter import allow_one_element_arrays_as_indices, convert_float8_to_nearest


if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        allow_one_element_arrays_as_indices()
        convert_float8_to_nearest()


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
