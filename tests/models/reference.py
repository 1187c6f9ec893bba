"""transformers as the reference: its float32 greedy tokens for random prompts, computed once per model."""

from __future__ import annotations

import functools

import torch


def random_prompts(lengths: tuple[int, ...], seed: int = 1234) -> list[list[int]]:
    """One prompt of each length, of word ids 5..999 (the tiny models' words), the same on every call."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in lengths]


# transformers' linear-attention helpers that run a kernel package's code where one is installed (fla-core,
# causal-conv1d: GPU-only Triton or CUDA kernels, which fail on the CPU tensors of the reference).
_KERNEL_PACKAGE_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                             "causal_conv1d_update")


def _use_transformers_torch_kernels() -> None:
    """Make the hybrid families' modeling modules call their own torch forms of those helpers: the float32
    reference, whatever kernel packages this machine has."""
    import importlib
    import inspect

    for family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        for name in _KERNEL_PACKAGE_FUNCTIONS:
            if callable(getattr(module, name, None)):
                setattr(module, name, inspect.unwrap(getattr(module, name)))


@functools.lru_cache(maxsize=None)
def transformers_greedy(model_dir: str, prompts: tuple[tuple[int, ...], ...], new_tokens: int,
                        image_text: bool = False) -> tuple[tuple[int, ...], ...]:
    """transformers' greedy continuation of each prompt alone, at float32; `image_text`: by the checkpoint's
    image-text model (AutoModelForImageTextToText) given the prompt's tokens only."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    _use_transformers_torch_kernels()
    auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
            outputs.append(tuple(out[0, len(prompt):].tolist()))
    return tuple(outputs)
