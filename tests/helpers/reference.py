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


@functools.lru_cache(maxsize=None)
def transformers_model(model_dir: str, gguf_file: str | None = None) -> torch.nn.Module:
    """transformers' float32 model of model_dir (of a GGUF file in it: dequantized by transformers' own loader,
    tens of seconds for SmolLM2), loaded once a session; callers only read it."""
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    with one_torch_thread():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra).eval()


@functools.lru_cache(maxsize=None)
def transformers_greedy(model_dir: str, prompts: tuple[tuple[int, ...], ...], new_tokens: int,
                        gguf_file: str | None = None) -> tuple[tuple[int, ...], ...]:
    """transformers' greedy continuation of each prompt alone, at float32."""
    model = transformers_model(model_dir, gguf_file)
    outputs = []
    with one_torch_thread(), torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
            outputs.append(tuple(out[0, len(prompt):].tolist()))
    return tuple(outputs)
