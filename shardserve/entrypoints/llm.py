"""Offline use without HTTP: `LLM(model, tensor_parallel_size=N, pipeline_parallel_size=P).generate(prompts,
params)`."""

from __future__ import annotations

import itertools

from shardserve.config import EngineConfig
from shardserve.distributed.launcher import LocalRanks
from shardserve.engine.llm_engine import LLMEngine, run_worker
from shardserve.engine.pipeline_split import check_stages
from shardserve.model_files import check_model_path
from shardserve.requests.outputs import RequestOutput
from shardserve.requests.sampling_params import SamplingParams
from shardserve.tokenizer import Tokenizer


class LLM:
    def __init__(self, model: str, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 **engine_options) -> None:
        self.config = EngineConfig(model=model, tensor_parallel_size=tensor_parallel_size,
                                   pipeline_parallel_size=pipeline_parallel_size, **engine_options)
        check_model_path(model, self.config.load_format)
        check_stages(self.config)  # before any rank starts
        self.tokenizer = Tokenizer.from_model_path(model)
        self.ranks = LocalRanks(self.config, worker=run_worker)
        try:
            self.engine = LLMEngine(self.config, self.ranks.ctx, self.tokenizer)
        except BaseException:
            self._teardown()
            raise
        self._ids = itertools.count()

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; results in prompt order. `params`: one for all the
        prompts, or one per prompt."""
        if self.engine.is_sleeping and not self.engine.wake_on_request:
            raise RuntimeError("the engine is asleep: call wake_up() first (or create it with wake_on_request=True)")
        batch = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        per_prompt = params if isinstance(params, list) else [params] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(batch)} prompts: pass one, or one per prompt")
        # Check every prompt before queueing any, so a refused batch leaves nothing behind in the engine.
        for token_ids, p in zip(batch, per_prompt):
            self.engine.validate_prompt(token_ids, p)
        ids = []
        try:
            for token_ids, p in zip(batch, per_prompt):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, token_ids, p)  # a grammar that does not compile refuses here
                ids.append(request_id)
        except ValueError:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_work():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[i] for i in ids]

    def sleep(self, level: int = 1) -> None:
        """Free the device memory on every rank: level 1 keeps the weights in host memory, level 2 drops them."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back: tags None for all, or a subset of ["weights", "kv_cache"]."""
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags are 'weights' and 'kv_cache', got {sorted(unknown)}")
        self.engine.wake_up(weights=tags is None or "weights" in tags, kv_cache=tags is None or "kv_cache" in tags)

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def shutdown(self) -> None:
        self.engine.shutdown()
        self._teardown()

    def _teardown(self) -> None:
        self.ranks.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
