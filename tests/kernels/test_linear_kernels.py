"""Linear layers on CPUs in bfloat16: oneDNN's packed layout where it works, with the results of F.linear
to bfloat16 rounding, and an engine whose packed weights survive sleep, wake and a reload."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardserve.entrypoints.llm import LLM
from shardserve.layers.linear_kernels import build_linear_kernel
from shardserve.requests.sampling_params import SamplingParams


def _needs_packed_bf16() -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n, k", [(96, 64), (960, 576), (576, 1536)])
def test_packed_bfloat16_matches_a_float64_reference(rows, n, k):
    _needs_packed_bf16()
    kernel, _ = build_linear_kernel("onednn-packed")
    g = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    out = kernel(x, kernel.prepare(w), bias)
    reference = F.linear(x.double(), w.double(), bias.double())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    assert ((out.double() - reference).norm() / reference.norm()).item() < 1e-2


def test_a_bfloat16_engine_packs_its_weights_and_keeps_them_through_sleep_and_reload(tiny_model_dir):
    _needs_packed_bf16()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 13, 21], [40, 41, 42]]
    with LLM(tiny_model_dir("llama-untied"), dtype="bfloat16", kv_cache_memory_gb=0.05) as llm:
        layers = [m for m in llm.engine.runner.model.modules() if hasattr(m, "use_kernel")]
        assert layers and all(m.prepared is not None for m in layers), "linear layers were not packed"
        expected = [o.token_ids for o in llm.generate(prompts, params)]
        for level in (1, 2):  # level 2 reloads the checkpoint and packs it again
            llm.sleep(level)
            llm.wake_up()
            assert [o.token_ids for o in llm.generate(prompts, params)] == expected, f"after sleep level {level}"


def test_an_unknown_gemv_setting_names_the_accepted_values(set_env):
    """A typo in SHARDSERVE_GEMV stops start-up instead of silently keeping the timed GEMVs."""
    from shardserve.layers.cuda_gemv import use_batch1_gemv

    set_env(SHARDSERVE_GEMV="cublass")
    with pytest.raises(ValueError, match="SHARDSERVE_GEMV='cublass': expected one of auto, cublas"):
        use_batch1_gemv(torch.nn.Linear(4, 4), log=False)
    set_env(SHARDSERVE_GEMV="cublas")
    assert use_batch1_gemv(torch.nn.Linear(4, 4), log=False) is None  # turned off: no GEMV kernel
