"""The requests `shardserve bench` sends.

Random prompts: without a tokenizer they are sequences of common English words, about one token per
word in the usual BPE vocabularies, so --input-len is approximate (the server's `usage` says what was
sent); with --tokenizer they are random token ids decoded and re-encoded until the text is exactly
--input-len tokens (the server may add a BOS token). Dataset prompts come from a JSONL file, one
`{"prompt": ...}` or `{"messages": [...]}` per line, with an optional `"output_len"`.

No two requests of a run share a prefix, across levels too (a prefix cache would make a level look
cheaper than it is): random prompts differ from their first word, and each dataset prompt is preceded
by a line of random words of its own. With --shared-prefix N, every random prompt starts with the same
N words (tokens), like a common system prompt.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError, model_validator

if TYPE_CHECKING:
    from shardserve.tokenizer import Tokenizer

# Common English words: one token each, with their leading space, in the usual BPE vocabularies.
WORDS = tuple("""
time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point
home water room mother area money story fact month lot right study book eye job word business issue
side kind head house service friend father power hour game line end member law car city community name
president team minute idea body information back parent face others level office door health person
art war history party result change morning reason research girl guy moment air teacher force education
foot boy age policy process music market sense nation plan college interest death experience effect
class control care field development role effort rate heart drug show leader light voice wife police
mind price report decision son view relationship town road arm difference value building action model
season society tax director position player record paper space ground form event official matter center
""".split())
# Words before each dataset prompt, drawn per request: enough that no two requests share a first KV block.
DISTINCT_TAG_WORDS = 8
_EXACT_LENGTH_ROUNDS = 10


class WorkloadError(ValueError):
    """A dataset or workload setting that cannot be used; the message names the file, line or flag."""


class DatasetMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class DatasetEntry(BaseModel):
    """One line of a --dataset file."""

    model_config = ConfigDict(extra="forbid")
    prompt: str | None = None
    messages: list[DatasetMessage] | None = None
    output_len: PositiveInt | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> "DatasetEntry":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('give exactly one of "prompt" (completions) or "messages" (chat)')
        if self.messages is not None and not self.messages:
            raise ValueError('"messages" is empty')
        return self


@dataclass(frozen=True)
class BenchRequest:
    """One request: a completion prompt or a chat conversation, and how many tokens to generate."""

    output_len: int
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True)
class Workload:
    """What every level sends: `num_prompts` requests built by `requests(level)`."""

    num_prompts: int
    output_len: int
    input_len: int | None = None  # random prompts
    dataset: tuple[DatasetEntry, ...] | None = None
    shared_prefix: int = 0
    tokenizer: Tokenizer | None = None
    seed: int = 0

    def requests(self, level: int) -> list[BenchRequest]:
        """The requests of level `level` (0, 1, ...): the same for the same seed, distinct between levels."""
        rng = random.Random(self.seed * 1_000_003 + level + 1)
        if self.dataset is not None:
            return [self._from_dataset(self.dataset[i % len(self.dataset)], rng) for i in range(self.num_prompts)]
        shared = random.Random(self.seed)  # the shared prefix is the same at every level
        if self.tokenizer is None:
            prefix = _words(shared, self.shared_prefix)
            return [BenchRequest(self.output_len, prompt=" ".join(prefix + _words(rng, self.input_len - len(prefix))))
                    for _ in range(self.num_prompts)]
        prefix_ids = _token_ids(shared, self.tokenizer, self.shared_prefix)
        return [BenchRequest(self.output_len, prompt=_exact_length_text(
                    self.tokenizer, prefix_ids + _token_ids(rng, self.tokenizer, self.input_len - len(prefix_ids)),
                    self.input_len, rng))
                for _ in range(self.num_prompts)]

    def _from_dataset(self, entry: DatasetEntry, rng: random.Random) -> BenchRequest:
        tag = " ".join(_words(rng, DISTINCT_TAG_WORDS)) + "\n"
        output_len = entry.output_len or self.output_len
        if entry.prompt is not None:
            return BenchRequest(output_len, prompt=tag + entry.prompt)
        messages = [m.model_dump() for m in entry.messages]
        messages[0]["content"] = tag + messages[0]["content"]
        return BenchRequest(output_len, messages=messages)


def load_dataset(path: str) -> tuple[DatasetEntry, ...]:
    """The entries of a JSONL file; errors name the file and line."""
    entries = []
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    entries.append(DatasetEntry.model_validate(json.loads(line)))
                except (ValueError, ValidationError) as e:
                    raise WorkloadError(f"{path}:{number}: {_first_error(e)}") from None
    except OSError as e:
        raise WorkloadError(f"cannot read --dataset {path!r}: {e.strerror}") from None
    if not entries:
        raise WorkloadError(f"{path} has no requests (one JSON object per line)")
    return tuple(entries)


def _first_error(e: Exception) -> str:
    if isinstance(e, ValidationError):
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        return f"{where}: {message}" if where else message
    return f"not JSON: {e}"


def _words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def _token_ids(rng: random.Random, tokenizer: Tokenizer, n: int) -> list[int]:
    return [rng.randrange(tokenizer.vocab_size) for _ in range(n)]


def _exact_length_text(tokenizer: Tokenizer, ids: list[int], n: int, rng: random.Random) -> str:
    """Text that encodes to `n` tokens (special tokens aside), starting from the tokens `ids`.

    Decoding and re-encoding can merge or split tokens at their seams and drops special tokens, so the
    tail is trimmed or refilled until the count holds; the head (a shared prefix) is left as it is.
    In the rare case that this does not settle, the last text is used: `usage` reports its length.
    """
    text = tokenizer.decode(ids)
    for _ in range(_EXACT_LENGTH_ROUNDS):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == n:
            break
        ids = encoded[:n] if len(encoded) > n else encoded + _token_ids(rng, tokenizer, n - len(encoded))
        text = tokenizer.decode(ids)
    return text
