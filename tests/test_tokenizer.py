"""Tokenizer: the real SmolLM2 GGUF tokenizer against transformers, and a tiny HF directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

from shardserve.tokenizer import Tokenizer

QUESTION = "What is the capital of France?"
CHAT = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_gguf: str, tokenizer_cache: Path) -> Tokenizer:
    """Loaded with an empty cache: converted by transformers, then cached."""
    return Tokenizer.from_model_path(smollm2_gguf, cache_dir=tokenizer_cache)


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_gguf: str):
    from transformers import AutoTokenizer

    path = Path(smollm2_gguf)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_gguf_encode_decode_round_trip(gguf_tokenizer: Tokenizer, reference_tokenizer) -> None:
    ids = gguf_tokenizer.encode(QUESTION)

    assert ids == reference_tokenizer.encode(QUESTION)
    assert gguf_tokenizer.decode(ids) == QUESTION
    assert gguf_tokenizer.vocab_size == 49152


def test_gguf_chat_template_matches_transformers(gguf_tokenizer: Tokenizer, reference_tokenizer) -> None:
    ids = gguf_tokenizer.apply_chat_template(CHAT)

    expected = reference_tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == expected
    text = gguf_tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user\n" + QUESTION + "<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")

    without_prompt = gguf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=False)
    assert ids[: len(without_prompt)] == without_prompt
    generation_prompt = gguf_tokenizer.decode(ids[len(without_prompt) :], skip_special_tokens=False)
    assert generation_prompt == "<|im_start|>assistant\n"


def test_gguf_special_tokens(gguf_tokenizer: Tokenizer, reference_tokenizer) -> None:
    im_end = reference_tokenizer.convert_tokens_to_ids("<|im_end|>")

    assert im_end == 2  # also the file's tokenizer.ggml.eos_token_id
    assert gguf_tokenizer.eos_token_ids == {im_end}
    assert gguf_tokenizer.bos_token_id == reference_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert gguf_tokenizer.token_text(im_end) == "<|im_end|>"
    assert gguf_tokenizer.token_text(gguf_tokenizer.encode(" capital")[0]) == " capital"


def test_gguf_tokenizer_reloads_from_cache(
    smollm2_gguf: str, gguf_tokenizer: Tokenizer, tokenizer_cache: Path
) -> None:
    (entry,) = tokenizer_cache.iterdir()  # written by the first load
    assert (entry / "tokenizer.json").is_file()

    cached = Tokenizer.from_model_path(smollm2_gguf, cache_dir=tokenizer_cache)

    assert cached.apply_chat_template(CHAT) == gguf_tokenizer.apply_chat_template(CHAT)
    assert cached.encode(QUESTION) == gguf_tokenizer.encode(QUESTION)
    assert (cached.eos_token_ids, cached.bos_token_id, cached.vocab_size) == (
        gguf_tokenizer.eos_token_ids,
        gguf_tokenizer.bos_token_id,
        gguf_tokenizer.vocab_size,
    )


# --- a tiny Hugging Face directory built with the tokenizers library ---

WORDS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "hello", "world", "user", "assistant"]
ID = {word: index for index, word in enumerate(WORDS)}
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def _save_tiny_tokenizer(directory: Path, chat_template: str | None) -> Path:
    raw = RawTokenizer(models.WordLevel(vocab=ID, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.add_special_tokens(WORDS[:5])
    raw.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def test_hf_directory_tokenizer(tmp_path: Path) -> None:
    model_dir = _save_tiny_tokenizer(tmp_path, TINY_CHAT_TEMPLATE)
    generation_config = {"eos_token_id": [ID["</s>"], ID["<|im_end|>"]]}
    (model_dir / "generation_config.json").write_text(json.dumps(generation_config))

    tokenizer = Tokenizer.from_model_path(str(model_dir))

    rendered = "<|im_start|> user hello world <|im_end|> <|im_start|> assistant"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}]) == [
        ID[word] for word in rendered.split()
    ]
    assert tokenizer.eos_token_ids == {ID["</s>"], ID["<|im_end|>"]}
    assert tokenizer.bos_token_id == ID["<s>"]
    assert tokenizer.vocab_size == len(WORDS)
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"


def test_hf_directory_without_chat_template(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_model_path(str(_save_tiny_tokenizer(tmp_path, chat_template=None)))

    assert tokenizer.eos_token_ids == {ID["</s>"]}
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])


def test_missing_model_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_model_path(str(tmp_path / "absent.gguf"))
