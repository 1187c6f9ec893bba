"""The CUDA fast path keeps the tokens: graph replay equals eager execution, TP=2 equals TP=1, and every
all-reduce method gives the same tokens, all in float32 (runs on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from shardserve.distributed.all_reduce import FORCE_ENV, METHOD_NAMES
from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams
from tests.helpers.reference import random_prompts

pytestmark = pytest.mark.gpu

NEW_TOKENS = 64
# Mixed lengths: the decode batches shrink and grow across graph buckets, with padding rows.
PROMPT_LENGTHS = (3, 17, 33, 1, 50, 8, 120)


def _needs_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPU(s), found {torch.cuda.device_count()}")


def _prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, seed=77)


_ONE_GPU_TOKENS: dict[str, list[list[int]]] = {}


def _one_gpu_reference(model_dir: str) -> list[list[int]]:
    """TP=1 graph-replayed tokens of a model, computed once per session (several tests compare against them)."""
    if model_dir not in _ONE_GPU_TOKENS:
        _ONE_GPU_TOKENS[model_dir] = _greedy(model_dir)
    return _ONE_GPU_TOKENS[model_dir]


def _greedy(model_dir: str, tp: int = 1, check=None, **options) -> list[list[int]]:
    """The greedy tokens of _prompts(); `check(llm)` runs on the started engine (rank 0's, in this process)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(model_dir, tensor_parallel_size=tp, device="cuda", dtype="float32", kv_cache_memory_gb=0.05,
             **options) as llm:
        if not options.get("enforce_eager"):
            assert llm.engine.runner.graphs is not None, "CUDA graphs were not captured"
        if check is not None:
            check(llm)
        return [out.token_ids for out in llm.generate(_prompts(), params)]


@pytest.mark.parametrize("name", ["llama-untied", "qwen3", "qwen3-next", "nemotron-h", "nemotron-h-moe", "deepseek-v3"])
def test_graph_replay_gives_the_same_tokens_as_eager(tiny_model_dir, name):
    """qwen3-next, nemotron-h: the Gated DeltaNet or Mamba-2 layers' states stepped in their pool slots inside the
    graphs, padding rows stepping none; nemotron-h-moe: its non-gated experts on the fused kernel; deepseek-v3: the
    latent cache's entries stored and read from static metadata, padding rows storing none."""
    _needs_gpus(1)
    model_dir = tiny_model_dir(name)
    assert _one_gpu_reference(model_dir) == _greedy(model_dir, enforce_eager=True)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_several_ranks_give_the_same_tokens_as_one(tiny_model_dir, tp):
    _needs_gpus(tp)
    model_dir = tiny_model_dir("llama-untied")
    assert _greedy(model_dir, tp=tp) == _one_gpu_reference(model_dir)


def test_a_hybrid_model_after_sleep_and_wake_replays_its_graphs_with_fresh_states(tiny_model_dir):
    """The state pools sit in the KV cache's stable arena: after a sleep and a wake the same graphs replay (no
    recapture) over the same addresses, and every sequence starts from a zeroed slot."""
    _needs_gpus(1)
    model_dir = tiny_model_dir("qwen3-next")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(model_dir, device="cuda", dtype="float32", kv_cache_memory_gb=0.05) as llm:
        graphs = llm.engine.runner.graphs
        assert graphs is not None, "CUDA graphs were not captured"
        before = [out.token_ids for out in llm.generate(_prompts(), params)]
        llm.sleep(1)
        llm.wake_up()
        assert llm.engine.runner.graphs is graphs
        after = [out.token_ids for out in llm.generate(_prompts(), params)]
    assert after == before == _one_gpu_reference(model_dir)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_steps_that_verify_proposals_replay_graphs_and_keep_the_tokens(tiny_model_dir, method):
    """Verifying k proposals (and the draft's catch-up of two tokens a sequence) replays the graphs whose rows share
    sequences, whose rows store their keys before any attends: the tokens stay those without speculation."""
    _needs_gpus(1)
    model_dir = tiny_model_dir("llama-untied")
    spec = {"method": method, "num_speculative_tokens": 3}
    spec.update({"prompt_lookup_max": 3} if method == "ngram" else {"model": model_dir})
    replays = {"target": 0, "draft": 0}

    def count_shared_replays(llm) -> None:
        runners = {"target": llm.engine.runner}
        if method == "draft_model":
            runners["draft"] = llm.engine.proposer.runner
        for name, runner in runners.items():
            assert runner.graphs.shared_buckets, f"the {name} captured no graphs of rows that share sequences"
            run = runner.graphs.run

            def counted(batch, device_tokens=None, run=run, name=name):
                replays[name] += batch.rows_share_sequences
                return run(batch, device_tokens)
            runner.graphs.run = counted

    tokens = _greedy(model_dir, speculative_config=spec, check=count_shared_replays)
    assert tokens == _one_gpu_reference(model_dir)
    assert replays["target"] > 0
    assert (replays["draft"] > 0) == (method == "draft_model")


def test_nemotron_h_with_bfloat16_ssm_states_captures_graphs_and_equals_eager(tiny_model_dir):
    model_dir = tiny_model_dir("nemotron-h")
    _needs_gpus(1)
    options = dict(mamba_ssm_cache_dtype="bfloat16")
    assert _greedy(model_dir, **options) == _greedy(model_dir, enforce_eager=True, **options)


def test_nemotron_h_with_host_grouped_experts_decodes_eagerly_saying_why(tiny_model_dir, caplog, set_env):
    """Without the fused kernel (SHARDSERVE_DEVICE_EXPERTS=0) the non-gated experts read their token counts on the
    host: no graphs, and the log line says so."""
    _needs_gpus(1)
    set_env(SHARDSERVE_DEVICE_EXPERTS="0")
    model_dir = tiny_model_dir("nemotron-h-moe")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with caplog.at_level("WARNING"), LLM(model_dir, device="cuda", dtype="float32", kv_cache_memory_gb=0.05) as llm:
        assert llm.engine.runner.graphs is None
        llm.generate(_prompts()[:2], params)
    assert "non-gated experts without their fused kernel read their token counts on the host" in caplog.text


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_every_all_reduce_method_gives_the_same_tokens(tiny_model_dir, set_env, method):
    _needs_gpus(2)
    model_dir = tiny_model_dir("llama-tied")
    expected = _one_gpu_reference(model_dir)
    set_env({FORCE_ENV: method})  # inherited by the spawned rank
    assert _greedy(model_dir, tp=2) == expected


@pytest.mark.parametrize("mode", ["fused", "separate"])
def test_the_all_reduce_inside_the_row_parallel_gemvs_keeps_the_tokens(tiny_model_dir, monkeypatch, set_env, mode):
    """At TP=2 the row-parallel batch-1 GEMVs (o_proj, down_proj) sum over the ranks, add the residual and apply
    the next norm in their own launch in the decode graphs (SHARDSERVE_GEMV_ALL_REDUCE=fused), or leave it to the
    all-reduce kernel after them (separate, the default): the tokens of one GPU either way, and the fused form is
    really taken where asked for."""
    from shardserve.distributed.all_reduce import GEMV_ALL_REDUCE_ENV
    from shardserve.layers import cuda_gemv

    _needs_gpus(2)
    set_env({GEMV_ALL_REDUCE_ENV: mode})  # inherited by the spawned rank
    # Rank 0's GEMV choice is every rank's: the Triton GEMVs on this tiny float32 model's shapes, whatever
    # cuBLAS's time.
    monkeypatch.setattr(cuda_gemv, "GEMV_DTYPES", (torch.float32,))
    monkeypatch.setattr(cuda_gemv, "TIE", 100.0)
    model_dir = tiny_model_dir("llama-untied")
    expected = _one_gpu_reference(model_dir)

    def fused_calls(llm) -> None:
        methods = llm.engine.runner.ctx.comm.choice.graph.entries
        calls = sum(getattr(method, "gemv_calls", 0) for _, method in methods)
        # Two a layer in the batch-1 graph: o_proj and down_proj.
        assert (calls >= 2 * 2) if mode == "fused" else calls == 0, f"{calls} fused calls captured"

    assert _greedy(model_dir, tp=2, check=fused_calls) == expected
