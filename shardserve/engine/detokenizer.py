"""Incremental detokenization with stop strings.

Text is re-decoded from the generated ids each step (exact for any tokenizer, including byte-level
merges across tokens). Text that could still become a stop string, or that ends in an incomplete
UTF-8 character, is held back until it is known.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.tokenizer import Tokenizer



class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far, cut at a matched stop string
        self.emitted = 0  # characters of self.text already handed out

    def update(self, output_ids: list[int], finished: bool) -> tuple[str, bool]:
        """Decode after new tokens; returns (new text to hand out, whether a stop string matched)."""
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        matches = [at for at in (text.find(s) for s in self.stop) if at != -1]
        stopped = bool(matches)
        if stopped:
            text = text[:min(matches)]  # the earliest stop string wins; it is never part of the output
        self.text = text
        if stopped or finished:
            end = len(text)
        else:
            # An incomplete character is not text yet; a stop string may still begin in the
            # holdback characters before it.
            end = len(text) - (1 if text.endswith("\ufffd") else 0) - self.holdback
        delta = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta, stopped
