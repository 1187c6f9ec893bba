"""transformers as the reference: its float32 greedy tokens for random prompts, computed once per model."""

from __future__ import annotations

import functools

import torch


def random_prompts(lengths: tuple[int, ...], seed: int = 1234) -> list[list[int]]:
    """One prompt of each length, of word ids 5..999 (the tiny models' words), the same on every call."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in lengths]


@functools.lru_cache(maxsize=None)
def transformers_greedy(model_dir: str, prompts: tuple[tuple[int, ...], ...], new_tokens: int,
                        image_text: bool = False) -> tuple[tuple[int, ...], ...]:
    """transformers' greedy continuation of each prompt alone, at float32; `image_text`: by the checkpoint's
    image-text model (AutoModelForImageTextToText) given the prompt's tokens only."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
            outputs.append(tuple(out[0, len(prompt):].tolist()))
    return tuple(outputs)
