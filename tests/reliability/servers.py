"""The servers the reliability checks run against: real `shardserve serve` processes on 127.0.0.1.

- the load server: two ranks (so step plans cross the signed control plane), a context of 256 tokens
  and a KV cache of 96 blocks (1,536 tokens) per rank, small enough that a full batch preempts;
- the edge server: one rank, a context of 64 tokens (so over-long prompts are short to write), an API
  key and a 1 MiB body limit, bound to the default address.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from tests.serving import serve_cli
from tests.tiny_models import TINY_SPECS, make_tiny_model

MODEL_SPEC = "llama-tied"
LOAD_MAX_MODEL_LEN = 256
# 96 blocks of 16 tokens at TP=2 (llama-tied: 2 layers, 1 KV head of 16 dims per rank, float32: 4 KiB a block).
LOAD_KV_CACHE_GB = 96 * 4096 / 2**30
EDGE_MAX_MODEL_LEN = 64
EDGE_API_KEY = "sk-reliability"
EDGE_BODY_LIMIT_MB = 1


def make_model(directory: str) -> str:
    return make_tiny_model(TINY_SPECS[MODEL_SPEC], directory)


def load_server_args(model_dir: str) -> list[str]:
    return [model_dir, "-tp", "2", "--device", "cpu", "--served-model-name", "tiny", "--max-model-len",
            str(LOAD_MAX_MODEL_LEN), "--max-num-seqs", "64", "--kv-cache-memory", f"{LOAD_KV_CACHE_GB:.9f}"]


def edge_server_args(model_dir: str) -> list[str]:
    return [model_dir, "--device", "cpu", "--served-model-name", "tiny", "--max-model-len", str(EDGE_MAX_MODEL_LEN),
            "--kv-cache-memory", "0.05", "--api-key", EDGE_API_KEY, "--max-request-body-mb", str(EDGE_BODY_LIMIT_MB)]


@contextmanager
def running(args: list[str]) -> Iterator[str]:
    """`shardserve serve ARGS` with one CPU thread per rank; yields its URL once healthy.

    One thread: on a small machine the HTTP server, the clients and the ranks share the cores, and
    spinning OpenMP workers would only take turns away from them.
    """
    with ExitStack() as stack:
        previous = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # read by the server process at its start only
        try:
            url = stack.enter_context(serve_cli(args))
        finally:
            if previous is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = previous
        yield url
