"""Incremental detokenization with stop strings.

Each step decodes only a window of the newest ids: the ids since the last text that came out whole (the
prefix) and the new ones, and the text they add beyond the prefix's is the step's new text. Decoding
from a token boundary the tokenizer already produced text at gives the same characters as decoding
everything (byte-level merges and leading-space rules resolve inside the window), and each step costs
a few tokens instead of the whole output. New ids that end inside a multi-byte character add nothing
until it completes. Text that could still become a stop string is held back until it is known.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.requests.sampling_params import SamplingParams
    from shardserve.tokenizer import Tokenizer



class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], skip_special_tokens: bool = True,
                 include_stop: bool = False, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop  # the text keeps the stop string that ended it
        self.min_tokens = min_tokens  # stop strings match only in text that comes after this many tokens
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self._search_from = 0  # stop strings are looked for from here on (text before min_tokens is final)
        self.text = ""  # everything decoded so far, cut at a matched stop string
        self.emitted = 0  # characters of self.text already handed out
        self._decoded = ""  # the text of output_ids[:read_offset]
        self._prefix_offset = 0  # the window starts here: text came out whole up to this id...
        self._read_offset = 0  # ...and again up to this one

    def update(self, output_ids: list[int], finished: bool) -> tuple[str, bool]:
        """Decode after new tokens; returns (new text to hand out, whether a stop string matched)."""
        window = output_ids[self._prefix_offset:]
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(window[:self._read_offset - self._prefix_offset], skip_special_tokens=skip)
        current = self.tokenizer.decode(window, skip_special_tokens=skip)
        complete = len(current) > len(prefix) and not current.endswith("\ufffd")
        if complete or finished:  # a finished request's incomplete character is flushed as it is
            pending = current[len(prefix):]
        else:
            pending = ""
        if complete:
            self._decoded += pending
            self._prefix_offset, self._read_offset = self._read_offset, len(output_ids)
            pending = ""
        text = self._decoded + pending
        if len(output_ids) < self.min_tokens:
            self._search_from = len(text)
            matches = []
        else:
            matches = [(at, len(s)) for s in self.stop if (at := text.find(s, self._search_from)) != -1]
        stopped = bool(matches)
        if stopped:
            # The earliest stop string wins; it is part of the output only with include_stop.
            at, length = min(matches)
            text = text[:at + length] if self.include_stop else text[:at]
        self.text = text
        if stopped or finished or len(output_ids) < self.min_tokens:
            end = len(text)
        else:
            # A stop string may still begin in the holdback characters (an incomplete character is not
            # in `text` yet: it stays pending until its last byte comes).
            end = len(text) - self.holdback
        delta = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta, stopped


def text_update(detokenizer: IncrementalDetokenizer, output_ids: list[int],
                finish_reason: str | None) -> tuple[str, bool]:
    """The detokenizer's update after a step that left `output_ids` with `finish_reason` (None: still running).
    A request that stopped on a stop token (eos included) does not show that token in its text, unless it asked
    for its stop string in the output."""
    text_ids = output_ids[:-1] if finish_reason == "stop" and not detokenizer.include_stop else output_ids
    return detokenizer.update(text_ids, finished=finish_reason is not None)


def detokenizer_for(tokenizer: Tokenizer, params: SamplingParams) -> IncrementalDetokenizer:
    """The detokenizer of a request with these sampling parameters."""
    return IncrementalDetokenizer(tokenizer, params.stop, params.skip_special_tokens,
                                  params.include_stop_str_in_output, params.min_tokens)
