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
