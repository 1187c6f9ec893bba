"""Pipeline parallelism: a tiny dense (Llama) and mixture-of-experts (Qwen3-MoE) model split into 2 stages, alone
(2 ranks) and with tensor parallelism inside each stage (2 x 2 ranks), give transformers' float32 greedy tokens,
each prompt alone and 16 at once, through chunked prefill, preemption and abort; the stages' layers and KV
caches are their own; killing a stage's rank fails the server within 10 s naming the rank and its stage.

One engine per model and layout, shared by the module's tests (a small KV cache and a small token budget, so the
16 prompts are prefilled in chunks and preempt each other)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import httpx
import pytest
import torch

from shardserve import envs
from shardserve.config import EngineConfig, ModelConfig, split_layers
from shardserve.distributed.process_group import find_free_port
from shardserve.entrypoints.llm import LLM
from shardserve.layers.sharding import attention_shard
from shardserve.requests.sampling_params import SamplingParams
from tests.helpers.reference import random_prompts, transformers_greedy
from tests.serving import stop_processes, wait_until_healthy

NEW_TOKENS = 24
MAX_MODEL_LEN = 96
BLOCKS = 20  # KV blocks of 16 tokens: 16 prompts of up to 40 tokens plus 24 new ones need more, so some wait
PROMPTS = random_prompts([1 + (13 * i) % 40 for i in range(16)], seed=77)

# (model, tensor-parallel size, overlapped steps): an untied head on the last stage alone, a tied one (the last stage
# keeps the embedding too) at 2 x 2; two layouts with overlapped steps forced on (on GPUs they are on with CUDA
# graphs): rank 0 queues a step with its tokens still on the device before the step before it is resolved.
# The Gated DeltaNet hybrids (each stage keeps the state pools of its own linear-attention layers): Qwen3-Next at
# 2 x 2, Qwen3.5's mixture of experts with overlapped steps, and a Qwen3-Next whose second stage holds attention
# layers only (it takes part in the Gated DeltaNet kernels' start-up checks without layers of its own).
# NemotronH (Mamba-2 states, the second stage without Mamba-2 layers) at 2 and 2 x 2.
LAYOUTS = [("llama-untied", 1, False), ("llama-tied", 2, True), ("qwen3-moe", 1, True), ("qwen3-moe", 2, False),
           ("qwen3-next", 2, False), ("qwen3.5-moe", 1, True), ("qwen3-next-attention-last", 1, False),
           ("nemotron-h-stages", 1, True), ("nemotron-h-stages", 2, False)]


def _kv_cache_gb(model_dir: str, tp: int) -> float:
    """--kv-cache-memory (a rank) that leaves BLOCKS blocks on the stage that holds the fewest (every rank agrees on
    the fewest): a stage's blocks are what its 16 sequences' recurrent states (a hybrid's linear-attention layers)
    leave of the budget, over its attention layers' bytes a block. Stages split as the engine splits them."""
    from shardserve.engine.pipeline_split import layer_bytes
    from shardserve.planner import load_hf_config, state_bytes_per_seq

    cfg = ModelConfig.from_model_path(model_dir)
    blocks = split_layers(layer_bytes(EngineConfig(model=model_dir, tensor_parallel_size=tp), cfg, tp)[0], 2)
    kv_heads = attention_shard(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 0, tp).num_kv
    linear = cfg.linear_attention_layers
    state_a_layer = state_bytes_per_seq(load_hf_config(model_dir), tp, 4) // len(linear) if linear else 0
    budgets = [BLOCKS * sum(i in r for i in cfg.kv_layers) * 2 * 16 * kv_heads * cfg.head_dim * 4
               + 16 * state_a_layer * sum(i in r for i in linear) for r in blocks]
    return max(budgets) / 2**30


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}-tp{p[1]}-pp2" + "-overlapped" * p[2])
def engine(request, tiny_model_dir):
    name, tp, overlap = request.param
    model_dir = tiny_model_dir(name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(envs.OVERLAP_STEPS.name, "1" if overlap else "0")
        llm = LLM(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=2, device="cpu", dtype="float32",
                  kv_cache_memory_gb=_kv_cache_gb(model_dir, tp), max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
                  max_num_batched_tokens=16)
    with llm:
        assert llm.engine.overlap_steps == overlap
        yield llm, model_dir, tp


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def _reference(model_dir: str) -> tuple[tuple[int, ...], ...]:
    return transformers_greedy(model_dir, tuple(map(tuple, PROMPTS)), NEW_TOKENS)


def _all_blocks_free(llm: LLM) -> bool:
    blocks = llm.engine.block_manager
    return blocks.num_free_blocks == blocks.num_blocks


def test_each_stage_holds_its_layers_and_a_kv_cache_for_them_only(engine):
    llm, model_dir, tp = engine
    runner = llm.engine.runner
    cfg = ModelConfig.from_model_path(model_dir)
    stage = runner.stage  # split by bytes: the stage's layers as the engine splits them
    assert (stage.index, stage.count, stage.first_layer) == (0, 2, 0) and 0 < stage.end_layer < cfg.num_layers
    held = [i for i, layer in enumerate(runner.model.model.layers) if any(True for _ in layer.parameters())]
    assert held == list(runner.stage.layers)
    final_norm = getattr(runner.model.model, "norm", None) or getattr(runner.model.model, "norm_f", None)
    assert runner.model.lm_head is None and final_norm is None  # on the last stage only
    assert len(runner.kv_caches) == len([i for i in held if i in cfg.kv_layers])
    assert sorted(runner.state_pools) == [i for i in held if i in cfg.linear_attention_layers]
    assert llm.engine.block_manager.num_blocks == BLOCKS
    # `shardserve plan -pp 2` says what this stage's rank holds: its KV bytes a token and states a sequence
    from shardserve.planner import PlanRequest, load_hf_config, plan

    staged = plan(load_hf_config(model_dir), PlanRequest(tp, MAX_MODEL_LEN, device="cpu", kv_cache_memory_gb=0.01,
                                                         host_memory_gb=64, pipeline_parallel_size=2))
    first = staged.stages[0]
    assert first["layers"] == [stage.first_layer, stage.end_layer - 1]
    assert first["kv_bytes_per_token"] == runner._kv_bytes_per_block() // runner.block_size
    assert first["state_bytes_per_seq"] * llm.engine.config.max_num_seqs == runner._state_bytes()


def test_each_prompt_alone_gives_transformers_tokens(engine):
    llm, model_dir, _ = engine
    expected = _reference(model_dir)
    for i in (0, 3, 15):  # 1, 40 (prefilled in 3 chunks of 16) and 36 tokens
        out = llm.generate([PROMPTS[i]], _greedy())[0]
        assert tuple(out.token_ids) == expected[i], f"prompt of {len(PROMPTS[i])} tokens"
    assert _all_blocks_free(llm)


def test_sixteen_at_once_with_chunked_prefill_and_preemption_give_transformers_tokens(engine):
    llm, model_dir, _ = engine
    preempted = llm.engine.scheduler.num_preemptions
    overlapped = llm.engine.steps_overlapped
    outputs = llm.generate(PROMPTS, _greedy())
    assert [tuple(o.token_ids) for o in outputs] == list(_reference(model_dir))
    assert llm.engine.scheduler.num_preemptions > preempted, "the small KV cache must have preempted some"
    assert (llm.engine.steps_overlapped > overlapped) == llm.engine.overlap_steps
    assert _all_blocks_free(llm)


def test_an_aborted_request_gives_its_blocks_back_and_the_others_are_unchanged(engine):
    llm, model_dir, _ = engine
    core = llm.engine
    core.add_request("doomed", PROMPTS[3], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    core.add_request("kept", PROMPTS[5], _greedy())
    for _ in range(6):
        core.step()
    core.abort("doomed")
    tokens = []
    while core.has_work():
        tokens += [o for o in core.step() if o.request_id == "kept"]
    assert tuple(tokens[-1].token_ids) == _reference(model_dir)[5]
    assert _all_blocks_free(llm)


def test_a_corrupted_layer_of_the_first_stage_fails_the_reference_comparison(engine):
    """The hybrids' split (each stage its own layers and state pools): rank 0's copy of a Gated DeltaNet or Mamba-2
    layer its stage holds, its norm's weights scaled, takes the tokens off transformers'; put back, they return.
    (Their prefix caching is off, so nothing the corrupted layer computed is kept.)"""
    llm, model_dir, _ = engine
    cfg = ModelConfig.from_model_path(model_dir)
    runner = llm.engine.runner
    held = [i for i in runner.stage.layers if i in cfg.linear_attention_layers]
    if not held:
        pytest.skip("no Gated DeltaNet or Mamba-2 layer on the first stage")
    layer = runner.model.model.layers[held[0]]
    norm = getattr(layer, "input_layernorm", None) or layer.norm
    kept = norm.weight.detach().clone()
    expected = list(_reference(model_dir)[:4])
    try:
        norm.weight.data.mul_(-3.0).add_(1.0)
        assert [tuple(o.token_ids) for o in llm.generate(PROMPTS[:4], _greedy())] != expected
    finally:
        norm.weight.data.copy_(kept)
    assert [tuple(o.token_ids) for o in llm.generate(PROMPTS[:4], _greedy())] == expected


def test_pipeline_sizes_are_checked_and_other_architectures_refused_by_name(tiny_model_dir):
    from shardserve.config import refuse_stages_without_attention
    from shardserve.engine.pipeline_split import refuse_unsupported
    from shardserve.models.nemotron_h import NemotronHForCausalLM

    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match=r"pipeline_parallel_size \(-pp\) must be a whole number"):
            EngineConfig(model="m", pipeline_parallel_size=bad)
    assert EngineConfig(model="m", tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6
    with pytest.raises(ValueError, match="at least one decoder layer per stage, but the model has 2"):
        split_layers([1, 1], 3)
    assert split_layers([4, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 5)]  # by bytes, not by count
    nemotron = ModelConfig.from_model_path(tiny_model_dir("nemotron-h"))
    for served in ("qwen3-next", "nemotron-h"):  # each stage keeps its own layers' states
        refuse_unsupported(ModelConfig.from_model_path(tiny_model_dir(served)), 2)
    with pytest.MonkeyPatch.context() as patch:  # a family not built in stages is refused, not half-served
        patch.setattr(NemotronHForCausalLM, "builds_in_stages", False)
        with pytest.raises(ValueError, match="NemotronHForCausalLM cannot be served in pipeline stages.*not built"):
            refuse_unsupported(nemotron, 2)
    odd = ModelConfig.from_model_path(tiny_model_dir("qwen3-next-odd"))  # layers 0 and 1 linear, 2 attention
    with pytest.raises(ValueError, match=r"stage 0 \(layers 0-1\) would hold no attention layer.*use fewer stages"):
        refuse_stages_without_attention([range(0, 2), range(2, 3)], odd.kv_layers, odd.architecture)
    # refused before any rank starts: by the offline engine, and by `serve` in one line
    with pytest.raises(ValueError, match="stage 0 .* would hold no attention layer"):
        LLM(tiny_model_dir("qwen3-next-odd"), pipeline_parallel_size=2, device="cpu")
    served = subprocess.run([sys.executable, "-m", "shardserve", "serve", tiny_model_dir("qwen3-next-odd"), "-pp", "2",
                             "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert served.returncode == 1 and "Traceback" not in served.stderr
    assert served.stderr.strip().splitlines()[-1].startswith("shardserve serve: --pipeline-parallel-size 2: stage 0")


def test_killing_a_stage_rank_fails_the_server_naming_rank_and_stage(tiny_model_dir):
    """`serve -pp 2 --max-restarts 0`: the second stage's rank killed in the middle of a stream; within 10 s the
    server stops answering /health with 200 and it exits with status 1, its log naming the rank and its stage."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("needs /proc to find the rank process")
    port = find_free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardserve", "serve", tiny_model_dir("llama-untied"), "-pp", "2", "--device", "cpu",
         "--served-model-name", "tiny", "--kv-cache-memory", "0.05", "--max-restarts", "0", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output: deque[str] = deque(maxlen=4000)
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, [proc], 180, lambda: "".join(output))
        stream = threading.Thread(target=_long_stream, args=(url,), daemon=True)
        stream.start()
        time.sleep(1.0)
        os.kill(_rank_process(proc.pid, 1), signal.SIGKILL)
        killed = time.monotonic()
        while _healthy(url) and proc.poll() is None:
            assert time.monotonic() - killed < 10, "the server still answers 200 10 s after a stage's rank died"
            time.sleep(0.1)
        assert proc.wait(timeout=60) == 1
        reader.join(timeout=10)
        log = "".join(output)
        assert "rank1 (pipeline stage 1 of 2)" in log and "--max-restarts 0 used up" in log, log[-3000:]
    finally:
        stop_processes([proc], signal.SIGINT, 30)


def _long_stream(url: str) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "w3 w1 w4", "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}) as response:
            for _ in response.iter_lines():
                pass
    except httpx.HTTPError:
        pass


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _rank_process(server_pid: int, rank: int) -> int:
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if Path(f"/proc/{child}/comm").read_text().strip() == f"shardserve-r{rank}":
                return int(child)
    raise AssertionError(f"no process of rank {rank} found")


@pytest.mark.gpu
@pytest.mark.parametrize("name, tp", [("qwen3-moe", 1), ("qwen3-next", 1), ("nemotron-h-stages", 1),
                                      ("llama-tied", 2)], ids=["pp2", "hybrid-pp2", "mamba2-pp2", "tp2-pp2"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_stages_on_gpus_give_transformers_tokens(tiny_model_dir, name, tp, eager):
    """The NCCL path: sends between GPUs, each stage replaying its own decode graphs (the sends between them eager)
    with overlapped steps, or each stage eager without; rank 0's decode steps replay its graphs where they are on."""
    if torch.cuda.device_count() < 2 * tp:
        pytest.skip(f"needs {2 * tp} CUDA GPUs, found {torch.cuda.device_count()}")
    model_dir = tiny_model_dir(name)
    with LLM(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=2, device="cuda", dtype="float32",
             max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=0.3, enforce_eager=eager) as llm:
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        replays = []
        if graphs is not None:
            run = graphs.run
            graphs.run = lambda *a, **k: replays.append(1) or run(*a, **k)
        outputs = llm.generate(PROMPTS, _greedy())
        overlapped = llm.engine.steps_overlapped
    assert [tuple(o.token_ids) for o in outputs] == list(_reference(model_dir))
    assert bool(replays) != eager and bool(overlapped) != eager  # overlapped steps are on with the graphs


def test_the_planner_gives_each_stage_its_layers_weights_and_kv_cache(tiny_model_dir):
    from shardserve.planner import PlanRequest, describe, load_hf_config, plan

    cfg = load_hf_config(tiny_model_dir("qwen3-moe"))  # 3 layers: 2 + 1
    request = PlanRequest(1, 4096, device="cpu", kv_cache_memory_gb=0.001, host_memory_gb=64)
    whole, staged = plan(cfg, request), plan(cfg, PlanRequest(**{**vars(request), "pipeline_parallel_size": 2}))
    assert [s["layers"] for s in staged.stages] == [[0, 1], [2, 2]]
    assert staged.kv_bytes_per_token == whole.kv_bytes_per_token * 2 // 3  # the first stage limits the others
    assert staged.max_tokens_in_cache > whole.max_tokens_in_cache
    assert "pipeline stage 1: layers 2-2" in describe(staged, 1)
    # what a token reads (its chosen experts) is each stage's own share of the whole model's
    gpu = PlanRequest(1, 4096, gpu_memory_gb=80)
    reads = [plan(cfg, PlanRequest(**{**vars(gpu), "pipeline_parallel_size": 2, "pipeline_stage": s}))
             .active_weight_bytes for s in (0, 1)]
    assert 0 < reads[1] < reads[0] and abs(sum(reads) - plan(cfg, gpu).active_weight_bytes) <= 2
