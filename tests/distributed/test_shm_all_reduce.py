"""The shared-memory all-reduce of CPU ranks on one host: the same sums as gloo, the same bits on every
rank, call after call; a rank that dies fails its peers at once; start-up times it against gloo and takes the faster at each size."""

from __future__ import annotations

import os
import time

import pytest

from shardserve.distributed import shm_all_reduce
from tests.ranks import run_ranks

pytestmark = pytest.mark.skipif(not shm_all_reduce.supported(), reason="needs Linux on x86-64 with /dev/shm")


def _sums(rank: int, port: int, world: int, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        method = shm_all_reduce.ShmAllReduce(None, rank, world)
        g = torch.Generator().manual_seed(rank)
        digest = []
        for call in range(300):  # both halves of the buffer, many times over
            dtype = (torch.float32, torch.bfloat16)[call % 2]
            x = torch.randn(1 + 97 * (call % 7), generator=g).to(dtype)
            expected = x.double().clone()
            dist.all_reduce(expected)  # the reference: gloo, in float64
            got = method(x.clone())
            tolerance = 1e-6 if dtype == torch.float32 else 1e-2
            assert got.dtype == dtype
            assert torch.allclose(got.double(), expected, rtol=tolerance, atol=tolerance), f"call {call}"
            digest.append(got.double().sum().item())
        mine = torch.tensor(digest, dtype=torch.float64)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        same = all(torch.equal(everyone[0], other) for other in everyone)
        results.put((rank, "ok" if same else "ranks hold different results"))
    except Exception as e:  # noqa: BLE001 - the test inspects it
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_sums_match_gloo_and_every_rank_holds_the_same_bits(world):
    assert run_ranks(_sums, world, world) == {r: "ok" for r in range(world)}


def _one_rank_dies(rank: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    method = shm_all_reduce.ShmAllReduce(None, rank, 2)
    method(torch.ones(8))
    if rank == 1:
        results.put((rank, "leaving"))
        results.close()
        results.join_thread()  # the message is out before the process ends
        os._exit(0)  # dies without a word, between two collectives (a zombie until its parent reaps it)
    started = time.monotonic()
    try:
        method(torch.ones(8))
        results.put((rank, "the sum returned without rank 1"))
    except RuntimeError as e:
        results.put((rank, f"{time.monotonic() - started < 30}: {e}"))


def test_a_rank_that_exits_fails_its_peer_at_once_naming_it():
    outcome = run_ranks(_one_rank_dies, 2, timeout=60)
    assert outcome[1] == "leaving"
    assert outcome[0].startswith("True: shared-memory all-reduce 2: rank 1 (process "), outcome[0]
    assert outcome[0].endswith("has exited")


def _generate_at_tp2(model_dir: str, prompt: list[int]):
    from shardserve.entrypoints.llm import LLM
    from shardserve.requests.sampling_params import SamplingParams

    with LLM(model_dir, tensor_parallel_size=2, dtype="float32", kv_cache_memory_gb=0.05) as llm:
        choice = llm.engine.runner.all_reduce_choice
        out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return choice, out[0].token_ids


def test_start_up_times_both_and_takes_the_faster_at_each_size(tiny_model_dir, caplog):
    """Two CPU ranks of one engine: gloo and shm are timed at every message size, the size table holds the
    faster of the two at each (whichever that is on a loaded machine), and the log gives the timings."""
    import logging

    import torch

    with caplog.at_level(logging.INFO, logger="shardserve.engine.model_runner"):
        choice, tokens = _generate_at_tp2(tiny_model_dir("llama-untied"), [5, 6, 7])
    assert len(tokens) == 6
    gloo_us, shm_us = choice.timings_us["gloo/eager"], choice.timings_us["shm/eager"]
    assert gloo_us and set(gloo_us) == set(shm_us)
    for nbytes in gloo_us:
        faster = "shm" if shm_us[nbytes] < gloo_us[nbytes] else "gloo"
        assert choice.eager.pick(torch.empty(nbytes // 4)).name == faster, (nbytes, gloo_us, shm_us)
    logged = [r.getMessage() for r in caplog.records if "all-reduce over 2 ranks" in r.getMessage()]
    assert logged and "gloo/eager" in logged[0] and "shm/eager" in logged[0], logged


def test_decode_through_shared_memory_gives_gloos_tokens(tiny_model_dir, set_env):
    """SHARDSERVE_ALL_REDUCE forces one method at every size: shm's decode steps give gloo's tokens."""
    tokens = {}
    for method in ("gloo", "shm"):
        set_env(SHARDSERVE_ALL_REDUCE=method)
        choice, tokens[method] = _generate_at_tp2(tiny_model_dir("llama-untied"), [5, 6, 7, 8])
        assert [m.name for _, m in choice.eager.entries][0] == method
    assert tokens["shm"] == tokens["gloo"]


def _one_rank_elsewhere(rank: int, port: int, paths_file: str, results) -> None:
    import torch
    import torch.distributed as dist

    from shardserve.distributed import all_reduce

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:  # as on another host: the first rank's file is not there
        real_exists = os.path.exists
        shm_all_reduce.os.path.exists = lambda p: False if "shardserve-all-reduce" in str(p) else real_exists(p)
    else:  # the paths this group agrees on, for the test to find them gone (other tests' files may exist meanwhile)
        agree = shm_all_reduce._agree_on_path

        def recorded(group, r):
            path, magic = agree(group, r)
            with open(paths_file, "a") as f:
                f.write(path + "\n")
            return path, magic

        shm_all_reduce._agree_on_path = recorded
    try:
        choice = all_reduce.calibrate_cpu(None, rank, 2, torch.float32, [4096, 65536])
        x = torch.full((1024,), float(rank + 1))
        total = choice.eager.pick(x)(x)
        results.put((rank, f"{[m.name for _, m in choice.eager.entries]} {total[0].item()}"))
    except Exception as e:  # noqa: BLE001 - the test inspects it
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def test_ranks_that_cannot_share_memory_all_fall_back_to_gloo(tmp_path):
    paths_file = tmp_path / "paths"
    assert run_ranks(_one_rank_elsewhere, 2, str(paths_file), timeout=60) == {0: "['gloo'] 3.0", 1: "['gloo'] 3.0"}
    paths = paths_file.read_text().split()
    assert paths and all(p.startswith("/dev/shm/shardserve-all-reduce") for p in paths)
    assert not [p for p in paths if os.path.exists(p)], "a file was left"
