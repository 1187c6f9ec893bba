"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral): greedy tokens equal transformers'
float32 greedy generate on the same weights at TP 1, 2 and 3, from per-expert and from fused expert tensors, and
with experts that do not split (replicated on every rank)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.helpers.greedy import NEW_TOKENS, check_matches, prompts, reference


@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_moe_greedy_tokens_match_transformers(tiny_model_dir, name, tp):
    check_matches(tiny_model_dir(name), name, tp, device="cpu")


def test_experts_that_do_not_split_are_replicated(tiny_model_dir, caplog, monkeypatch):
    from shardserve.layers import sharding

    monkeypatch.setattr(sharding, "_logged", set())  # logged once a process: maybe already, by another test
    with caplog.at_level("INFO"):
        check_matches(tiny_model_dir("qwen3-moe-odd"), "qwen3-moe-odd", 3, device="cpu")
    assert any("moe experts" in r.getMessage() and "replicat" in r.getMessage() for r in caplog.records)


def test_fused_expert_tensors_load_as_per_expert_ones(tiny_model_dir, tmp_path):
    """Newer checkpoints stack each layer's experts: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]."""
    from safetensors.torch import load_file, save_file

    source = tiny_model_dir("qwen3-moe")
    fused_dir = tmp_path / "fused"
    shutil.copytree(source, fused_dir)
    tensors = {}
    for name in os.listdir(source):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(source, name)))
            os.remove(fused_dir / name)
    layers = {n.split(".experts.")[0] for n in tensors if ".experts." in n}
    for layer in layers:
        count = len({n.split(".")[5] for n in tensors if n.startswith(layer + ".experts.")})
        pop = lambda e, part: tensors.pop(f"{layer}.experts.{e}.{part}.weight")  # noqa: E731
        tensors[f"{layer}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([pop(e, "gate_proj"), pop(e, "up_proj")]) for e in range(count)])
        tensors[f"{layer}.experts.down_proj"] = torch.stack([pop(e, "down_proj") for e in range(count)])
    save_file(tensors, fused_dir / "model.safetensors")
    index = fused_dir / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    assert json.loads((fused_dir / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    # The reference is transformers on the per-expert checkpoint: the same weights.

    check_matches(str(fused_dir), "qwen3-moe (fused experts)", 2, device="cpu", expected=reference(source))


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_dummy_weights_know_the_experts(tiny_model_dir, name):
    """--load-format dummy: the experts in the fused layout, the same tokens at TP 1 and 2."""
    from shardserve import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [40] * 9]
    outputs = {}
    for tp in (1, 2):
        with LLM(tiny_model_dir(name), tensor_parallel_size=tp, load_format="dummy", dtype="float32",
                 kv_cache_memory_gb=0.05) as llm:
            outputs[tp] = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert outputs[1] == outputs[2]


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_expert_parallel_matches_transformers(tiny_model_dir, name, tp, caplog):
    """--enable-expert-parallel: 4 experts, 2 whole experts a rank at TP 2; at TP 3 they do not divide, and each
    expert is split by features instead (logged)."""
    from shardserve import LLM, SamplingParams

    model_dir = tiny_model_dir(name)
    expected = reference(model_dir)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with caplog.at_level("INFO"), LLM(model_dir, tensor_parallel_size=tp, dtype="float32", kv_cache_memory_gb=0.05,
                                      enable_expert_parallel=True) as llm:
        outputs = llm.generate(prompts(), greedy)
        layer = next(m for m in llm.engine.runner.model.modules() if type(m).__name__ == "SparseMoE")
        held = layer.experts_held
    assert [tuple(o.token_ids) for o in outputs] == list(expected)
    assert held == ((0, 2) if tp == 2 else (0, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_moe_greedy_tokens_match_transformers_on_a_gpu(tiny_model_dir, name):
    """The CUDA path (the fused kernel where it passed its start-up check, with CUDA graphs), float32."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    check_matches(tiny_model_dir(name), name, 1, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe"])
def test_router_choice_in_the_router_gemv_keeps_the_tokens_on_a_gpu(tiny_model_dir, monkeypatch, set_env, name, tp):
    """Batch-1 decode in bfloat16 (where the router's GEMV can be a Triton one), one prompt at a time, with the
    router's choice in the router's GEMV launch (SHARDSERVE_MOE_ROUTE=gemv) and in a launch of its own (separate):
    the same greedy tokens (renormalised top 2, and Qwen2-MoE's over all experts). At TP 1 the one-launch form ran
    wherever start-up chose the norm-fused GEMV for the router's shape."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPU(s), found {torch.cuda.device_count()}")
    import shardserve.kernels.triton.router_gemv as router_gemv
    from shardserve import LLM, SamplingParams
    from shardserve.layers import moe

    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    launches = []
    real = router_gemv._launch
    monkeypatch.setattr(router_gemv, "_launch", lambda *args: launches.append(real(*args)) or launches[-1])
    tokens, fused_norm_chosen = {}, False
    for route in ("separate", "gemv"):
        set_env({moe.ROUTE_ENV: route})
        with LLM(tiny_model_dir(name), tensor_parallel_size=tp, device="cuda", dtype="bfloat16",
                 kv_cache_memory_gb=0.05) as llm:
            tokens[route] = [tuple(llm.generate([prompt], greedy)[0].token_ids) for prompt in prompts()]
            if route == "separate":
                assert not launches
            layer = next(m for m in llm.engine.runner.model.modules() if isinstance(m, moe.SparseMoE))
            one_row = torch.empty(1, layer.hidden_size, dtype=torch.bfloat16, device="cuda")
            fused_norm_chosen = moe.router_gemv_config(layer.gate.kernel, one_row, layer.gate.weight, True) is not None
    assert tokens["gemv"] == tokens["separate"]
    if tp == 1 and fused_norm_chosen:
        assert any(out is not None for out in launches)


@pytest.mark.parametrize("held", [(0, 4), (2, 4)])
def test_the_device_only_expert_path_equals_the_grouped_one(held):
    """torch's grouped GEMM path (what CUDA graphs capture) against the host-grouped version, here on the CPU:
    all experts, and a rank holding experts 2 and 3 under expert parallelism (other ranks' choices count 0)."""
    from shardserve.layers.moe import grouped_experts, grouped_mm_experts

    g = torch.Generator().manual_seed(0)
    experts, hidden, features, tokens, k = 4, 64, 32, 9, 2
    w13 = torch.randn(experts, 2 * features, hidden, generator=g) * 0.1
    w2 = torch.randn(experts, hidden, features, generator=g) * 0.1
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g), dim=-1), k, dim=-1)
    e0, e1 = held
    got = grouped_mm_experts(x, w13[e0:e1], w2[e0:e1], weights, ids - e0)
    want = grouped_experts(x.double(), w13[e0:e1].double(), w2[e0:e1].double(), weights.double(), ids - e0)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5


def test_the_device_check_runs_every_kernel_config_and_rejects_one_wrong_at_any():
    """Before a GPU expert computation is used it must match float64 at a token count that picks each config of
    the fused kernel's table, with the layer's top k: a kernel wrong only at large batches is refused."""
    from shardserve.kernels.fused_moe_table import CONFIGS, pick_config
    from shardserve.layers.moe import _matches, reference_experts

    experts, hidden, features, top_k = 8, 32, 16, 2
    w13, w2 = torch.empty(experts, 2 * features, hidden), torch.empty(experts, hidden, features)
    calls = []

    def exact(x, w13, w2, weights, ids):
        calls.append(tuple(ids.shape))
        return reference_experts(x, w13, w2, weights, ids).to(x.dtype)

    def wrong_past_100_tokens(x, w13, w2, weights, ids):
        out = exact(x, w13, w2, weights, ids)
        return out * 1.01 if x.shape[0] > 100 else out

    assert _matches(exact, w13, w2, top_k)
    assert {k for _, k in calls} == {top_k}
    assert {pick_config(t, top_k, experts) for t, _ in calls} == {config for _, config in CONFIGS}
    assert not _matches(wrong_past_100_tokens, w13, w2, top_k)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["fp8-block", "gptq-sym-g32"])
def test_packed_experts_on_a_gpu(tiny_model_dir, tmp_path, scheme):
    """On CUDA a quantized Qwen3-MoE's experts stay packed by default and run the fused kernel on the packed bytes
    (checked against float64 first; graphs capture it): transformers' tokens on the encoded values, bf16 tolerance
    aside in float32."""
    from shardserve import LLM, SamplingParams
    from shardserve.layers.moe_packed import packed_compute, packed_fused
    from tests.helpers.quantized import expert_blocks, write_quantized

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    quant_dir, float_dir = write_quantized(tiny_model_dir("qwen3-moe-64"), scheme, tmp_path)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(quant_dir, device="cuda", dtype="float32", kv_cache_memory_gb=0.05) as llm:
        outputs = [tuple(o.token_ids) for o in llm.generate(prompts(), greedy)]
        blocks = expert_blocks(llm)
        assert blocks and all(m.packed is not None for m in blocks)
        assert packed_compute(blocks[0].packed.view(blocks[0]), 2, torch.float32) is packed_fused
    assert outputs == list(reference(float_dir))
