"""shardserve: serve large language models sharded across ranks, behind an OpenAI-compatible API.

Offline use:

    from shardserve import LLM, SamplingParams
    llm = LLM("path/to/model")  # tensor_parallel_size=N: in a script, under `if __name__ == "__main__":`
    print(llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))[0].text)
"""

from shardserve.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Imported on first use, so `import shardserve` (the CLI's start) does not load torch.
    if name == "LLM":
        from shardserve.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from shardserve.requests.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'shardserve' has no attribute {name!r}")
