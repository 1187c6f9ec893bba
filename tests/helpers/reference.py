"""transformers as the reference: its float32 greedy tokens for random prompts, computed once per model."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch


def random_prompts(lengths, seed: int = 1234, vocab: int = 1000) -> list[list[int]]:
    """One prompt of each length, of word ids 5..vocab - 1 (by default the tiny models' words "w5".."w999"), the
    same on every call."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread inside, and the count it had after. A reference computation's tokens do not depend on
    it, but its time did: the test process keeps whatever count the last engine it started chose, and two OpenMP
    threads on a 2-core machine whose cores other processes hold (the ranks of a test, another pytest) made
    SmolLM2's matmuls 20 times slower than one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


def transformers_model(model_dir: str, gguf_file: str | None = None, image_text: bool = False) -> torch.nn.Module:
    """transformers' float32 model of model_dir (of a GGUF file in it: dequantized by transformers' own loader,
    tens of seconds for SmolLM2; `image_text`: the checkpoint's image-text model, AutoModelForImageTextToText),
    loaded once a session however the arguments are passed; callers only read it."""
    return _transformers_model(str(model_dir), gguf_file, image_text)


@functools.lru_cache(maxsize=None)
def _transformers_model(model_dir: str, gguf_file: str | None, image_text: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    _use_transformers_torch_kernels()
    auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    with one_torch_thread():
        return auto.from_pretrained(model_dir, dtype=torch.float32, **extra).eval()


def transformers_greedy(model_dir: str, prompts: tuple[tuple[int, ...], ...], new_tokens: int,
                        image_text: bool = False, gguf_file: str | None = None) -> tuple[tuple[int, ...], ...]:
    """transformers' greedy continuation of each prompt alone, at float32; `image_text`: by the checkpoint's
    image-text model given the prompt's tokens only; `gguf_file`: of that GGUF file in model_dir. Computed once a
    session however the arguments are passed."""
    return _transformers_greedy(str(model_dir), tuple(map(tuple, prompts)), new_tokens, image_text, gguf_file)


@functools.lru_cache(maxsize=None)
def _transformers_greedy(model_dir: str, prompts: tuple[tuple[int, ...], ...], new_tokens: int, image_text: bool,
                         gguf_file: str | None) -> tuple[tuple[int, ...], ...]:
    model = transformers_model(model_dir, gguf_file, image_text)
    outputs = []
    with one_torch_thread(), torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
            outputs.append(tuple(out[0, len(prompt):].tolist()))
    return tuple(outputs)
