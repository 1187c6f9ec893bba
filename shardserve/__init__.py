"""shardserve: serve large language models sharded across ranks, behind an OpenAI-compatible API."""

__version__ = "0.1.0"
