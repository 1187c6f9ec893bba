"""Start-up self-checks: every kernel a rank is about to use is run on this model's shapes against float64;
one that fails is dropped on every rank (with a warning naming it, the rank and the error), and start-up
stops when nothing is left."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn.functional as F

from shardserve.attention.sdpa import SdpaBackend
from shardserve.distributed.handshake import StartupMismatch
from shardserve.engine import kernel_setup
from shardserve.entrypoints.llm import LLM
from shardserve.kernels.plan import KernelPlanError
from shardserve.kernels.self_check import check_linear
from shardserve.layers.attention import PagedAttention
from shardserve.layers.linear_kernels import LinearKernel, OneDNNPackedKernel, build_linear_kernel
from shardserve.layers.rotary import RotaryEmbedding
from shardserve.requests.sampling_params import SamplingParams
from tests.ranks import run_ranks


class TileLimitedKernel(LinearKernel):
    """F.linear that, like a kernel past its tile limit, leaves outputs beyond the first 64 features at zero."""

    name = "tile-limited"

    def __call__(self, x, weight, bias):
        out = F.linear(x, weight, bias)
        out[..., 64:] = 0
        return out


def _shapes():
    # qkv / o / gate-up / down / head of a small model, a ragged shard width (75) and a narrow head shard.
    return [(480, 96), (96, 288), (300, 96), (96, 150), (75, 96), (1000, 96), (8, 96)]


@pytest.mark.parametrize("name, dtype", [("torch", torch.float32), ("onednn-packed", torch.float32),
                                         ("bf16-decode", torch.float32), ("torch", torch.bfloat16),
                                         ("onednn-packed", torch.bfloat16)])
def test_every_cpu_kernel_passes_on_real_and_ragged_shapes(name, dtype):
    kernel, why = build_linear_kernel(name)
    if kernel is None:
        pytest.skip(why)
    for n, k in _shapes():
        weight = torch.randn(n, k).to(torch.bfloat16).to(dtype)  # values a bfloat16 checkpoint holds
        result = check_linear(kernel, weight, torch.randn(n).to(dtype), dtype, f"{name} {n}x{k}")
        assert result.passed, result.describe()


def test_a_tile_limit_and_silently_narrowed_weights_fail_the_check():
    weight = torch.randn(300, 96)
    tiled = check_linear(TileLimitedKernel(), weight, None, torch.float32, "tile-limited 300x96")
    assert not tiled.passed and tiled.error > 0.5
    kernel, why = build_linear_kernel("bf16-decode")
    if kernel is None:
        pytest.skip(why)
    # float16 checkpoint values rounded to bfloat16 for single-token steps: about 2^-9, far above float32's 1e-5.
    narrowed = check_linear(kernel, torch.randn(300, 96).half().float(), None, torch.float32, "bf16-decode 300x96")
    assert not narrowed.passed and 1e-4 < narrowed.error < 1e-2
    assert "error" in narrowed.describe() and "tolerance 0.0001" in narrowed.describe()


def test_a_kernel_that_fails_on_this_model_is_dropped_with_a_warning_and_the_next_one_serves(
        tiny_model_dir, monkeypatch, set_env, caplog):
    """onednn-packed made to break on this model's widest layers: the engine falls back to torch and the
    tokens are those of a clean run."""
    model = tiny_model_dir("llama-untied")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 13, 21], [40, 41, 42]]
    set_env(SHARDSERVE_LINEAR_KERNEL="torch")
    with LLM(model, kv_cache_memory_gb=0.05) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    set_env(SHARDSERVE_LINEAR_KERNEL=None)

    def broken(self, x, weight, bias):
        out = original(self, x, weight, bias)
        if out.shape[-1] > 256:
            out[..., 256:] = 0
        return out

    original = OneDNNPackedKernel.__call__
    monkeypatch.setattr(OneDNNPackedKernel, "__call__", broken)
    with caplog.at_level(logging.WARNING), LLM(model, kv_cache_memory_gb=0.05) as llm:
        assert llm.engine.runner.plan.linear == "torch"
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    warning = next(r.getMessage() for r in caplog.records if "failed its start-up check" in r.getMessage())
    assert "linear kernel onednn-packed" in warning and "using torch instead" in warning
    assert "rank 0" in warning and "error" in warning


def test_start_up_builds_the_cpu_kernels_then_says_the_checks_begin(tiny_model_dir, monkeypatch, caplog):
    """A first start's quiet minute is a CPU kernel's build and the checks: the build comes first (announced by
    cpu_extensions, tests/kernels/test_cpu_extensions.py), then a line says the checks begin, before the plan."""
    from shardserve.kernels import cpu_extensions

    builds = []  # (the kernels built for, how many records were logged by then)
    monkeypatch.setattr(cpu_extensions, "build_for", lambda kernels: builds.append((kernels, len(caplog.records))))
    with caplog.at_level(logging.INFO), LLM(tiny_model_dir("llama-untied"), kv_cache_memory_gb=0.05) as llm:
        candidates = llm.engine.runner.plan.linear_candidates
    messages = [r.getMessage() for r in caplog.records]
    checking = messages.index("checking each kernel against float64 on this model's shapes before serving")
    plan = next(i for i, m in enumerate(messages) if m.startswith("kernel plan:"))
    [(built_for, logged_before_build)] = builds
    assert built_for == candidates
    assert logged_before_build <= checking < plan


def test_start_up_stops_when_no_linear_kernel_passes(tiny_model_dir, monkeypatch, set_env):
    set_env(SHARDSERVE_LINEAR_KERNEL="torch")
    monkeypatch.setattr(kernel_setup, "build_linear_kernel", lambda name: (TileLimitedKernel(), ""))
    with pytest.raises(KernelPlanError) as e:
        LLM(tiny_model_dir("llama-untied"), kv_cache_memory_gb=0.05)
    message = str(e.value)
    assert "no linear kernel passed its start-up check" in message
    assert "rank 0" in message and "tile-limited" not in message.split("\n")[0]
    assert re.search(r"rank 0 \(.*\): torch \d+x128: error 0\.\d+ \(tolerance 0\.0001\)", message), message


@pytest.mark.parametrize("heads, kv_heads, kv_index", [(6, 2, (0, 0, 0, 1, 1, 1)), (4, 4, (0, 1, 2, 3)),
                                                        (2, 2, (0, 1)),  # a rank's heads straddling two groups
                                                        (3, 1, (0, 0, 0))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_attention_check_passes_sdpa_on_every_head_layout(heads, kv_heads, kv_index, dtype):
    attn = PagedAttention(heads, kv_heads, 32, kv_index)
    rotary = RotaryEmbedding(32, 128, 10000.0, None, dtype)
    result = kernel_setup.check_attention(SdpaBackend(torch.device("cpu"), 16), attn, rotary, dtype,
                                          torch.device("cpu"), 16)
    assert result.passed, result.describe()


class NoMaskBackend(SdpaBackend):
    """Prompts attend to every position of their chunk, later ones included: a causal mask lost."""

    def forward(self, layer, qk, v, rotary, cache, meta):
        for chunk in meta.prefills:
            chunk.first_position = 0
        out = super().forward(layer, qk, v, rotary, cache, meta)
        return out if not meta.prefills else out.roll(1, dims=0)


def test_the_attention_check_catches_a_broken_backend():
    attn = PagedAttention(4, 2, 32, (0, 0, 1, 1))
    rotary = RotaryEmbedding(32, 128, 10000.0, None, torch.float32)
    result = kernel_setup.check_attention(NoMaskBackend(torch.device("cpu"), 16), attn, rotary, torch.float32,
                                          torch.device("cpu"), 16)
    assert not result.passed and "torch-sdpa attention (4 heads, 2 KV heads, dim 32)" in result.describe()


def _with_head_norm(attn: PagedAttention, dtype: torch.dtype) -> PagedAttention:
    """Qwen3's per-head norms on attn, with weights far from 1 so that skipping them shows."""
    from shardserve.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(3)
    norms = (RMSNorm(attn.head_dim, 1e-6, dtype), RMSNorm(attn.head_dim, 1e-6, dtype))
    for norm in norms:
        norm.weight.data = (0.5 + torch.rand(attn.head_dim, generator=g)).to(dtype)
    attn.head_norm = norms
    return attn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_attention_check_passes_sdpa_with_qwen3_head_norms(dtype):
    attn = _with_head_norm(PagedAttention(4, 2, 32, (0, 0, 1, 1)), dtype)
    rotary = RotaryEmbedding(32, 128, 10000.0, None, dtype)
    result = kernel_setup.check_attention(SdpaBackend(torch.device("cpu"), 16), attn, rotary, dtype,
                                          torch.device("cpu"), 16)
    assert result.passed, result.describe()


class SkipsTheHeadNormBackend(SdpaBackend):
    """Claims to apply the head norms itself (as the Triton kernel does) and never does."""
    fuses_head_norm = True


def test_the_attention_check_catches_a_backend_that_skips_the_head_norms():
    attn = _with_head_norm(PagedAttention(4, 2, 32, (0, 0, 1, 1)), torch.float32)
    rotary = RotaryEmbedding(32, 128, 10000.0, None, torch.float32)
    result = kernel_setup.check_attention(SkipsTheHeadNormBackend(torch.device("cpu"), 16), attn, rotary,
                                          torch.float32, torch.device("cpu"), 16)
    assert not result.passed, result.describe()


def _two_rank_checks(rank: int, port: int, results) -> None:
    """Rank 1's oneDNN kernel is broken: both ranks must drop it. Then the all-reduce check, and the plans
    compared with one rank's plan different."""
    from torch import nn

    from shardserve.distributed.process_group import destroy_rank_context, init_rank_context
    from shardserve.kernels.plan import KernelPlan
    from shardserve.layers.linear import ColumnParallelLinear

    torch.set_num_threads(1)
    ctx = init_rank_context(rank, 2, "cpu", f"tcp://127.0.0.1:{port}", control_token="t" * 64)
    try:
        if rank == 1:
            OneDNNPackedKernel.__call__ = lambda self, x, w, b: torch.zeros(x.shape[0], 300)
        model = nn.Sequential(ColumnParallelLinear(96, {None: (0, 300)}, True, torch.float32))
        for p in model.parameters():
            p.data.normal_()
        plan = KernelPlan("cpu", torch.float32, ("onednn-packed", "torch"))
        chosen = kernel_setup.choose_linear_kernel(model, plan, ctx)
        reduced_ok = not kernel_setup.verify_all_reduce(ctx.comm, torch.float32, torch.device("cpu"),
                                                        [4, 4096, 1 << 20], ctx)
        try:
            kernel_setup.agree_on_plan(plan.with_results(linear="torch" if rank == 0 else "onednn-packed"), ctx)
            agreed = "agreed"
        except StartupMismatch as e:
            agreed = str(e)
        results.put((rank, (chosen.name, reduced_ok, agreed)))
    except Exception as e:  # noqa: BLE001
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        destroy_rank_context(ctx)


def test_ranks_drop_a_kernel_that_fails_on_one_of_them_and_refuse_different_plans():
    outcome = run_ranks(_two_rank_checks, 2)
    for rank in (0, 1):
        assert not isinstance(outcome[rank], str), outcome[rank]
        name, reduced_ok, agreed = outcome[rank]
        assert name == "torch", f"rank {rank} kept a kernel that failed on rank 1"
        assert reduced_ok
        assert "did not arrive at the same kernel plan" in agreed
        assert "rank 1 (" in agreed and "linear onednn-packed" in agreed


class BrokenPagedBackend:
    """A device backend (not torch SDPA) whose decode output is off: the engine must not serve with it."""

    name = "broken-paged"
    fuses_head_norm = False

    def __init__(self) -> None:
        self.inner = SdpaBackend(torch.device("cpu"), 16)

    def build_metadata(self, batch):
        meta = self.inner.build_metadata(batch)
        meta.backend = self  # the layers call the backend their metadata names
        return meta

    def forward(self, layer, qk, v, rotary, cache, meta):
        return self.inner.forward(layer, qk, v, rotary, cache, meta) * 1.01


def test_a_backend_that_fails_its_check_gives_way_to_sdpa_with_a_warning(caplog):
    from types import SimpleNamespace

    attn = PagedAttention(4, 2, 32, (0, 0, 1, 1))
    rotary = RotaryEmbedding(32, 128, 10000.0, None, torch.float32)
    single = SimpleNamespace(rank=0, world_size=1, is_driver=True)
    with caplog.at_level(logging.WARNING):
        chosen = kernel_setup.checked_attention(BrokenPagedBackend(), attn, rotary, torch.float32,
                                                torch.device("cpu"), 16, single)
    assert isinstance(chosen, SdpaBackend)
    assert "attention backend broken-paged failed its start-up check, using torch-sdpa instead" in caplog.text
    assert "error 0.01" in caplog.text


def test_a_head_too_wide_to_check_whole_is_sampled_edges_included():
    """Past CHECKED_OUTPUTS rows only a sample is compared with float64, but the rows where tiles end are in it."""
    class LastRowsLost(LinearKernel):
        name = "last-rows-lost"

        def __call__(self, x, weight, bias):
            out = F.linear(x, weight, bias)
            out[..., -100:] = 0
            return out

    result = check_linear(LastRowsLost(), torch.randn(20000, 64), None, torch.float32, "last-rows-lost 20000x64")
    assert not result.passed


def _extension_missing_on_rank_1(rank: int, port: int, results) -> None:
    from torch import nn

    from shardserve.distributed.process_group import destroy_rank_context, init_rank_context
    from shardserve.kernels.plan import KernelPlan
    from shardserve.layers.linear import ColumnParallelLinear

    torch.set_num_threads(1)
    ctx = init_rank_context(rank, 2, "cpu", f"tcp://127.0.0.1:{port}", control_token="t" * 64)
    try:
        if rank == 1:
            built = kernel_setup.build_linear_kernel
            kernel_setup.build_linear_kernel = lambda name: ((None, "no C++ compiler on this node")
                                                             if name == "bf16-decode" else built(name))
        model = nn.Sequential(ColumnParallelLinear(96, {None: (0, 64)}, False, torch.float32))
        kernel_setup.choose_linear_kernel(model, KernelPlan("cpu", torch.float32, ("bf16-decode", "torch")), ctx)
        results.put((rank, "started"))
    except Exception as e:  # noqa: BLE001
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        destroy_rank_context(ctx)


def test_a_kernel_that_runs_on_some_ranks_only_stops_start_up_naming_them():
    if build_linear_kernel("bf16-decode")[0] is None:
        pytest.skip(build_linear_kernel("bf16-decode")[1])
    outcome = run_ranks(_extension_missing_on_rank_1, 2)
    for rank in (0, 1):
        assert outcome[rank].startswith("StartupMismatch: linear kernel bf16-decode runs on some ranks but not"), \
            outcome[rank]
        assert "rank 1 (" in outcome[rank] and "no C++ compiler on this node" in outcome[rank]
        assert "rank 0 (" not in outcome[rank]
