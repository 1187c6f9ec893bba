"""Streaming text from the real IncrementalDetokenizer over SmolLM2's byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

from shardserve.requests.detokenizer import IncrementalDetokenizer
from shardserve.tokenizer import Tokenizer

MULTIBYTE = "Café au lait 🎉 naïve 日本語, 🤖🎉 ok"
ENGLISH = "Hello world, this is great"


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_model_path(smollm2_gguf)


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    return ids


def _stream(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...] = ()
            ) -> tuple[list[str], IncrementalDetokenizer, int | None]:
    """Feed ids one token at a time as the engine does; returns the deltas, the detokenizer and the
    number of tokens after which a stop string matched (None if none did)."""
    detok = IncrementalDetokenizer(tokenizer, stop)
    deltas = []
    for k in range(1, len(ids) + 1):
        delta, stopped = detok.update(ids[:k], finished=k == len(ids))
        deltas.append(delta)
        if stopped:
            return deltas, detok, k
    return deltas, detok, None


@pytest.mark.parametrize("text", [ENGLISH, MULTIBYTE])
@pytest.mark.parametrize("stop", [(), ("never appears",), ("x", "zz")])
def test_deltas_concatenate_to_final_text(tokenizer, text, stop):
    ids = _ids(tokenizer, text)
    deltas, detok, stopped_at = _stream(tokenizer, ids, stop)
    assert stopped_at is None
    assert "".join(deltas) == detok.text == text


def test_text_is_streamed_as_it_arrives_without_stop_strings(tokenizer):
    # Nothing is held back needlessly: with no stop strings, each ASCII word is out the step it arrives.
    ids = _ids(tokenizer, ENGLISH)
    detok = IncrementalDetokenizer(tokenizer, ())
    for k in range(1, len(ids) + 1):
        detok.update(ids[:k], finished=False)
        assert detok.emitted == len(tokenizer.decode(ids[:k]))


@pytest.mark.parametrize("stop", ["o wor", "world, th", ", this is g"])
def test_stop_string_split_across_tokens_never_emitted(tokenizer, stop):
    ids = _ids(tokenizer, ENGLISH)
    # The stop string really starts in one token and ends in a later one.
    starts_in = next(k for k in range(1, len(ids) + 1) if len(tokenizer.decode(ids[:k])) > ENGLISH.index(stop))
    ends_in = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    assert ends_in > starts_in

    expected = ENGLISH[:ENGLISH.index(stop)]
    deltas, detok, stopped_at = _stream(tokenizer, ids, (stop,))
    assert stopped_at == ends_in, "the match is reported at the token that completes the stop string"
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert expected.startswith(emitted), f"emitted {emitted!r}: part of the stop string {stop!r} got out"
    assert emitted == detok.text == expected


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = _ids(tokenizer, ENGLISH)
    deltas, detok, stopped_at = _stream(tokenizer, ids, ("great", "is", "world"))
    assert "".join(deltas) == detok.text == "Hello "
    assert stopped_at == 2


def test_multibyte_characters_never_stream_replacement_chars(tokenizer):
    ids = _ids(tokenizer, MULTIBYTE)
    # The case under test: some tokens carry only part of a character.
    assert any("\ufffd" in tokenizer.decode(ids[:k]) for k in range(1, len(ids)))
    for stop in [(), ("zz",), ("longer stop string",)]:
        deltas, detok, _ = _stream(tokenizer, ids, stop)
        for delta in deltas:
            assert "\ufffd" not in delta, f"stop={stop}: a partial character was streamed as U+FFFD"
        assert "".join(deltas) == MULTIBYTE


def test_multibyte_stop_string(tokenizer):
    ids = _ids(tokenizer, MULTIBYTE)
    # "本語": "本" is a whole token, and "語" then arrives one byte per token. While its bytes are
    # incomplete, "本" could still be the start of the stop string and must stay held back.
    for stop, expected in [("🎉", "Café au lait "), ("本語", "Café au lait 🎉 naïve 日"),
                           ("🤖", "Café au lait 🎉 naïve 日本語, ")]:
        deltas, detok, stopped_at = _stream(tokenizer, ids, (stop,))
        assert stopped_at is not None
        assert "".join(deltas) == detok.text == expected
        assert all("\ufffd" not in d for d in deltas)


def test_finish_mid_character_flushes_everything(tokenizer):
    # Cut inside the emoji: the text is final, so what was held back must come out.
    ids = _ids(tokenizer, MULTIBYTE)
    k = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, ("zz",))
    out = "".join(detok.update(ids[:j], finished=j == k)[0] for j in range(1, k + 1))
    assert out == detok.text == tokenizer.decode(ids[:k])


def test_each_step_decodes_a_few_ids_not_the_whole_output(tokenizer):
    """A long output streams with the same text as one decode of all of it, while each step decodes only the
    window since the last whole character: the work grows linearly with the output, not quadratically."""
    text = " ".join([MULTIBYTE, ENGLISH] * 40)
    ids = _ids(tokenizer, text)
    decoded: list[int] = []
    real = tokenizer.decode

    class Counting:
        def decode(self, window, skip_special_tokens=True):
            decoded.append(len(window))
            return real(window, skip_special_tokens=skip_special_tokens)

    detok = IncrementalDetokenizer(tokenizer, ())
    detok.tokenizer = Counting()
    out = "".join(detok.update(ids[:k], finished=k == len(ids))[0] for k in range(1, len(ids) + 1))
    assert out == tokenizer.decode(ids) == text
    assert len(ids) > 500 and max(decoded) <= 8, "a window spans the last few tokens only"
    assert sum(decoded) < 8 * len(ids)


def test_the_fast_decode_equals_transformers_decode(tokenizer):
    ids = _ids(tokenizer, MULTIBYTE + " " + ENGLISH) + [0, 1, 2]  # special tokens too
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == \
            tokenizer._tokenizer.decode(ids, skip_special_tokens=skip)


def _run(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[str, int | None]:
    out = []
    for k in range(1, len(ids) + 1):
        delta, stopped = detok.update(ids[:k], finished=k == len(ids))
        out.append(delta)
        if stopped:
            return "".join(out), k
    return "".join(out), None


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    ids = _ids(tokenizer, "The cat sat on the mat. Then it slept.")
    without, k1 = _run(IncrementalDetokenizer(tokenizer, ("mat",)), ids)
    with_stop, k2 = _run(IncrementalDetokenizer(tokenizer, ("mat",), include_stop=True), ids)
    assert without == "The cat sat on the " and with_stop == "The cat sat on the mat" and k1 == k2


def test_stop_strings_only_match_after_min_tokens(tokenizer):
    ids = _ids(tokenizer, "one two one two three")
    first_one = _run(IncrementalDetokenizer(tokenizer, ("one",)), ids)
    assert first_one == ("", 1)
    # Before min_tokens no stop string matches, and text from then on is final: the second "one" stops it.
    text, k = _run(IncrementalDetokenizer(tokenizer, (" one",), min_tokens=3), ids)
    assert text == "one two" and k is not None and k >= 3


def test_special_tokens_are_kept_when_asked(tokenizer):
    eos = min(tokenizer.eos_token_ids)
    ids = _ids(tokenizer, "Hello there") + [eos] + _ids(tokenizer, " again")
    skipped, _ = _run(IncrementalDetokenizer(tokenizer, ()), ids)
    kept, _ = _run(IncrementalDetokenizer(tokenizer, (), skip_special_tokens=False), ids)
    special = tokenizer.decode([eos], skip_special_tokens=False)
    assert special and special not in skipped and kept == "Hello there" + special + " again"
