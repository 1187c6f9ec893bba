"""Which data-parallel replica takes a request (`shardserve serve --data-parallel-size D`).

Every replica is a whole engine with its own prefix cache, so where a request goes decides both the balance of
work and whether its prompt's prefix is already computed. A request's cost is its outstanding tokens (its prompt,
estimated from its characters, plus the completion it may still ask for), counted against its replica from when
it is sent until its response has ended. Policies:
- "affinity" (default): the replica that was sent the longest run of the same leading prompt chunks, unless it
  holds more than AFFINITY_SLACK_TOKENS outstanding tokens above the least loaded one; then the least loaded.
- "least-loaded": the replica with the fewest outstanding tokens.
- "round-robin": each live replica in turn.
Among equally loaded replicas (an idle server) the one sent the fewest requests so far is the least loaded, so new
prefixes spread over the replicas' caches; then the lowest index, so the choice is reproducible. Dead replicas are
never chosen.

Prefixes are compared on the request's text, not its tokens (the router does not tokenize): the prompt, or the
chat messages' roles and contents in order, cut into PREFIX_CHUNK_CHARS-character chunks whose hashes chain (a
chunk's hash covers everything before it), so two prompts share a chunk's hash only if they share the whole text
up to its end. Each replica remembers the last PREFIXES_REMEMBERED chunk hashes it was sent (least recently used
forgotten first), about what its own prefix cache can hold.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import OrderedDict
from typing import Any

POLICIES = ("affinity", "least-loaded", "round-robin")
PREFIX_CHUNK_CHARS = 256
MAX_PREFIX_CHUNKS = 64  # a prompt's first 16k characters decide its affinity
PREFIXES_REMEMBERED = 1 << 16
# A replica with a prompt's prefix is skipped once it holds this many outstanding tokens more than the least loaded:
# about two prefill chunks of the default --max-num-batched-tokens, the work that recomputing a long shared prefix
# elsewhere would cost.
AFFINITY_SLACK_TOKENS = 4096
CHARS_PER_TOKEN = 4  # the estimate of a prompt's tokens from its characters
DEFAULT_COMPLETION_TOKENS = 256  # a request that sets no max_tokens is counted as asking for this many


def prompt_text(body: dict[str, Any]) -> str:
    """The text a request's prompt is made of: `prompt` (a string, or token ids written out) or the chat
    `messages`' roles and contents in order (text parts of a multi-part content joined)."""
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for m in body["messages"]:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '')}\x00{content if isinstance(content, str) else json.dumps(content)}\x00")
        return "".join(parts)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def prefix_hashes(text: str) -> list[bytes]:
    """The chained hashes of text's whole leading chunks (a last, partial chunk counts only as the end of text)."""
    hashes, previous = [], b""
    for start in range(0, min(len(text), MAX_PREFIX_CHUNKS * PREFIX_CHUNK_CHARS), PREFIX_CHUNK_CHARS):
        chunk = text[start:start + PREFIX_CHUNK_CHARS]
        previous = hashlib.blake2b(previous + chunk.encode(), digest_size=16).digest()
        hashes.append(previous)
    return hashes


def request_cost(body: dict[str, Any], text: str) -> int:
    """Outstanding tokens a request adds to its replica: its prompt's (estimated) and its completion's limit, per
    choice (`n`)."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_COMPLETION_TOKENS
    n = body.get("n") or 1
    try:
        return len(text) // CHARS_PER_TOKEN + int(limit) * int(n)
    except (TypeError, ValueError):
        return len(text) // CHARS_PER_TOKEN + DEFAULT_COMPLETION_TOKENS


class ReplicaRouter:
    """The outstanding tokens and remembered prefixes of `count` replicas, and the choice among them."""

    def __init__(self, count: int, policy: str = "affinity", slack_tokens: int = AFFINITY_SLACK_TOKENS) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}: use one of {', '.join(POLICIES)}")
        self.policy = policy
        self.slack_tokens = slack_tokens
        self.outstanding = [0] * count
        self.routed = [0] * count  # requests sent, for /health and the log
        self._prefixes: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(count)]
        self._turns = itertools.cycle(range(count))

    def matched_chunks(self, replica: int, hashes: list[bytes]) -> int:
        """How many of a prompt's leading chunks were sent to `replica`."""
        known = self._prefixes[replica]
        return next((i for i, h in enumerate(hashes) if h not in known), len(hashes))

    def choose(self, hashes: list[bytes], live: list[int]) -> int:
        """The replica (one of `live`, non-empty) for a prompt whose chunks hash to `hashes`."""
        if not live:
            raise ValueError("no live replica to choose from")
        if self.policy == "round-robin":
            return next(i for i in self._turns if i in live)
        least = min(live, key=lambda i: (self.outstanding[i], self.routed[i], i))
        if self.policy == "least-loaded" or not hashes:
            return least
        best = max(live, key=lambda i: (self.matched_chunks(i, hashes), -self.outstanding[i], -i))
        if self.matched_chunks(best, hashes) and self.outstanding[best] <= self.outstanding[least] + self.slack_tokens:
            return best
        return least

    def sent(self, replica: int, hashes: list[bytes], cost: int) -> None:
        """Count a request sent to `replica`: its cost until `finished`, its prefix remembered there."""
        self.outstanding[replica] += cost
        self.routed[replica] += 1
        known = self._prefixes[replica]
        for h in hashes:
            known[h] = None
            known.move_to_end(h)
        while len(known) > PREFIXES_REMEMBERED:
            known.popitem(last=False)

    def finished(self, replica: int, cost: int) -> None:
        self.outstanding[replica] -= cost

    def forget(self, replica: int) -> None:
        """A replica that died (or restarted) holds no prefix any more."""
        self._prefixes[replica].clear()
