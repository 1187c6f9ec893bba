"""Text <-> token ids for a served model, over a Hugging Face tokenizer.

A model path is either a Hugging Face directory (tokenizer.json, tokenizer_config.json, ...)
or a .gguf file. transformers converts a GGUF tokenizer slowly (about ten seconds for a
50k-token vocabulary), so the converted tokenizer is cached as a Hugging Face directory,
keyed by the GGUF header (which holds the whole tokenizer) and the transformers version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from shardserve.weights.gguf_loader import read_gguf_header

logger = logging.getLogger(__name__)

# GGUF metadata keys naming tokens that end generation: end of sequence, of turn, of message.
_GGUF_EOS_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)
# Files of a Hugging Face model directory that may name eos tokens (int or list of ints).
_HF_EOS_FILES = ("generation_config.json", "config.json")


class Tokenizer:
    """A model's tokenizer and the token ids that end generation."""

    def __init__(
        self, hf_tokenizer: PreTrainedTokenizerBase, eos_token_ids: Iterable[int], name: str
    ) -> None:
        self._tokenizer = hf_tokenizer
        # A fast tokenizer that does no clean-up after decoding decodes exactly as its Rust backend does.
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._backend = backend if backend is not None and not getattr(
            hf_tokenizer, "clean_up_tokenization_spaces", True) else None
        self.name = name
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)

    @classmethod
    def from_model_path(cls, path: str, *, cache_dir: str | os.PathLike[str] | None = None) -> Tokenizer:
        """Load from a Hugging Face directory or a .gguf file.

        `cache_dir` holds converted GGUF tokenizers; by default ~/.cache/shardserve/tokenizers.
        """
        model_path = Path(path)
        if model_path.is_dir():
            return cls._from_hf_directory(model_path)
        if model_path.is_file() and model_path.suffix == ".gguf":
            cache = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
            return cls._from_gguf(model_path, cache)
        raise FileNotFoundError(f"{path} is neither a model directory nor a .gguf file")

    @classmethod
    def _from_hf_directory(cls, directory: Path) -> Tokenizer:
        hf_tokenizer = _load_hf_tokenizer(directory)
        eos_ids = set(_ids(hf_tokenizer.eos_token_id))
        for filename in _HF_EOS_FILES:
            if (directory / filename).is_file():
                config = json.loads((directory / filename).read_text())
                eos_ids.update(_ids(config.get("eos_token_id")))
                # An image-text checkpoint's config.json names them for its text model (Qwen3.5).
                eos_ids.update(_ids((config.get("text_config") or {}).get("eos_token_id")))
        return cls(hf_tokenizer, eos_ids, str(directory))

    @classmethod
    def _from_gguf(cls, gguf_path: Path, cache_dir: Path) -> Tokenizer:
        header = read_gguf_header(str(gguf_path))
        cached = cache_dir / _gguf_tokenizer_key(gguf_path, header.data_offset)
        hf_tokenizer = _load_gguf_tokenizer(gguf_path, cached)
        eos_ids = set(_ids(hf_tokenizer.eos_token_id))
        eos_ids.update(header.metadata[key] for key in _GGUF_EOS_KEYS if key in header.metadata)
        return cls(hf_tokenizer, eos_ids, str(gguf_path))

    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer underneath (grammar engines read its vocabulary)."""
        return self._tokenizer

    @property
    def chat_template(self) -> str | None:
        template = self._tokenizer.chat_template
        return template if isinstance(template, str) or template is None else next(iter(template.values()), None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:  # the Rust tokenizer itself: what transformers would return, less its
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)  # per-call overhead
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The token ids of a conversation rendered with the model's chat template; `template_kwargs` are
        variables the template reads (e.g. enable_thinking); `tools` are OpenAI tool definitions, which the
        template lays out in its model's own format."""
        if not self._tokenizer.chat_template:
            raise ValueError(
                f"the tokenizer of {self.name} has no chat template; use a plain completion prompt"
            )
        return self._tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=True, return_dict=False, **(template_kwargs or {})
        )

    def chat_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """A conversation rendered with the chat template, as text, ready for the assistant's answer."""
        return self._tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                   tokenize=False)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included.

        A token that holds only part of a multi-byte character decodes to U+FFFD.
        """
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def _load_hf_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """AutoTokenizer, except where tokenizer_config.json asks for the generic fast tokenizer: then
    tokenizer.json is used as written, not rebuilt by the model type's own tokenizer class."""
    config_file = directory / "tokenizer_config.json"
    if config_file.is_file() and (directory / "tokenizer.json").is_file():
        if json.loads(config_file.read_text()).get("tokenizer_class") == "PreTrainedTokenizerFast":
            return PreTrainedTokenizerFast.from_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def _ids(value: int | list[int] | None) -> list[int]:
    """Token ids from a config value that may be absent, one id or a list of ids."""
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _load_gguf_tokenizer(gguf_path: Path, cached: Path) -> PreTrainedTokenizerBase:
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(cached)
    hf_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _save_to_cache(hf_tokenizer, cached)
    return hf_tokenizer


def _default_cache_dir() -> Path:
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "shardserve" / "tokenizers"


def _gguf_tokenizer_key(gguf_path: Path, header_size: int) -> str:
    """A name for the converted tokenizer: a hash of the GGUF header, the file size and the
    transformers version (whose converter produced it)."""
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as file:
        digest.update(file.read(header_size))
    digest.update(f"{gguf_path.stat().st_size}:{transformers.__version__}".encode())
    return digest.hexdigest()[:32]


def _save_to_cache(hf_tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Save atomically: write to a temporary sibling, then rename. Caching is best effort."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
    except OSError as error:
        logger.warning("not caching the converted tokenizer in %s: %s", target.parent, error)
        return
    try:
        hf_tokenizer.save_pretrained(staging)
        staging.rename(target)
    except OSError as error:  # also when another process cached the same tokenizer first
        logger.debug("tokenizer cache entry %s not written: %s", target, error)
        shutil.rmtree(staging, ignore_errors=True)
