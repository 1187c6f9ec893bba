"""Sleep/wake on GPUs keeps every address: the arena gives its memory back to the driver and takes it
again at the same place, the CUDA graphs captured at start-up keep serving the same tokens, and device
and pinned host memory stay flat over the cycles (runs on the GPU machine)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams
from shardserve.weights import stable_memory

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = ["w1 w2 w3", "w40 w41", "w7 w8 w9 w10 w11"]


@pytest.fixture
def cuda_arenas():
    if not torch.cuda.is_available() or not stable_memory.available(torch.device("cuda", 0)):
        pytest.skip("needs a CUDA GPU with the driver's virtual memory API")


def _device_used() -> int:
    free, total = torch.cuda.mem_get_info(0)
    return total - free


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_released_memory_goes_back_to_the_driver_and_returns_at_the_same_address(cuda_arenas):
    size = 256 * 2**20
    arena = stable_memory.StableArena(size, torch.device("cuda", 0))
    try:
        view = arena.carve([torch.empty(size // 4, dtype=torch.float32, device="meta")])[0]
        view.fill_(3.0)
        address, used_mapped = view.data_ptr(), _device_used()
        arena.release()
        assert used_mapped - _device_used() >= size - 2**20, "the physical memory was not given back"
        arena.map()
        assert view.data_ptr() == address
        view.fill_(5.0)
        assert float(view.sum()) == 5.0 * view.numel()
    finally:
        arena.close()


def test_weights_larger_than_half_the_gpu_move_into_an_arena(cuda_arenas):
    """The arena is backed as it fills while the old memory goes back, so weights of 60% of the free memory
    move (backing the whole arena first would need 120%), every value where it was."""
    from torch import nn

    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(0)
    gib = 2**30
    model = nn.ParameterList(nn.Parameter(torch.full((gib // 4,), float(i), device="cuda:0"), requires_grad=False)
                             for i in range(int(0.6 * free) // gib))
    arena = stable_memory.move_model_into_arena(model, torch.device("cuda", 0))
    try:
        assert all(arena.address <= p.data_ptr() < arena.address + arena.nbytes for p in model)
        assert [float(p.min()) for p in model] == [float(p.max()) for p in model] == [float(i) for i in
                                                                                        range(len(model))]
    finally:
        del model
        arena.close()


def _tokens(llm: LLM) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]


def test_alternating_cycles_keep_graphs_tokens_and_memory(cuda_arenas, tiny_model_dir):
    options = dict(device="cuda", dtype="float32", kv_cache_memory_gb=0.05, max_num_seqs=8)
    a = LLM(tiny_model_dir("llama-untied"), **options)
    b = LLM(tiny_model_dir("qwen3"), **options)
    try:
        graphs = {"a": a.engine.runner.graphs, "b": b.engine.runner.graphs}
        assert graphs["a"] is not None and a.engine.runner.weight_arena is not None
        expected = {"a": _tokens(a), "b": _tokens(b)}
        b.sleep(1)
        device, host = [], []
        for cycle in range(20):
            awake, asleep = (a, b) if cycle % 2 == 0 else (b, a)
            name = "a" if awake is a else "b"
            assert _tokens(awake) == expected[name], f"cycle {cycle}: model {name} changed"
            awake.sleep(1 + cycle % 4 // 3)  # mostly level 1, every fourth cycle level 2 (reload in place)
            asleep.wake_up()
            gc.collect()
            device.append(_device_used())
            host.append(_rss_bytes())
        assert a.engine.runner.graphs is graphs["a"] and b.engine.runner.graphs is graphs["b"], \
            "waking captured the CUDA graphs again"
        assert max(device[2:]) - min(device[2:]) < 64 * 2**20, [d >> 20 for d in device]
        assert max(host[2:]) - min(host[2:]) < 64 * 2**20, [h >> 20 for h in host]
        assert a.engine.canary_reloads == 0 and b.engine.canary_reloads == 0
    finally:
        a.shutdown()
        b.shutdown()


def test_a_corrupted_host_image_fails_the_canary_and_is_reloaded_in_place(cuda_arenas, tiny_model_dir):
    with LLM(tiny_model_dir("llama-tied"), device="cuda", dtype="float32", kv_cache_memory_gb=0.05,
             max_num_seqs=8) as llm:
        expected = _tokens(llm)
        llm.sleep(1)
        image = llm.engine.runner.host_image
        image[: image.numel() // 2].view(torch.float32).mul_(-3.0)  # bit rot in the pinned copy
        llm.wake_up()
        assert llm.engine.canary_reloads == 1
        assert _tokens(llm) == expected
