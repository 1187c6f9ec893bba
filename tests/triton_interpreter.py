"""A fix for Triton's interpreter (the kernels' tests without a GPU)."""

from __future__ import annotations


def allow_one_element_arrays_as_indices() -> None:
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
    if original is None or getattr(original, "allows_one_element_arrays", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.allows_one_element_arrays = True
    interpreter._patch_lang_tensor = patched


def convert_float8_to_nearest() -> None:
    """Triton 3.6's interpreter narrows float32 to float8 e4m3 by cutting the significand and adding the first
    dropped bit without carrying it into the exponent (1.98 becomes 1.0), nor making subnormals: narrow to e4m3
    with torch instead (round to nearest even, as the GPU's conversion does; callers saturate first). Interpreter
    only."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "float8_to_nearest", False):
        return

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype != tl.float8e4nv or input_dtype.primitive_bitwidth <= 8:
            return original(data, input_dtype, output_dtype, rounding_mode)
        if input_dtype == tl.bfloat16:  # held as its uint16 bits
            data = original(data, input_dtype, tl.float32, None).view(np.float32)
        wide = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
        return wide.to(torch.float8_e4m3fn).view(torch.uint8).numpy()

    convert.float8_to_nearest = True
    interpreter._convert_float = convert


def convert_float32_to_bfloat16_nearest(monkeypatch) -> None:
    """Triton 3.6's interpreter narrows float32 to bfloat16 by cutting the significand (toward zero): twice the
    GPU's rounding error on average, which a float64 comparison at bfloat16's tolerance can notice. Narrow with
    torch instead (round to nearest even, as the GPU's conversion does), for one test (monkeypatch). Interpreter
    only: call it where TRITON_INTERPRET=1."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype != tl.bfloat16 or input_dtype != tl.float32:
            return original(data, input_dtype, output_dtype, rounding_mode)
        wide = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
        return wide.to(torch.bfloat16).view(torch.uint16).numpy()

    monkeypatch.setattr(interpreter, "_convert_float", convert)
