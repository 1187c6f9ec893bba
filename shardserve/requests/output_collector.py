"""One request's outputs on their way to its consumer (an HTTP handler), on the consumer's event loop.

Outputs that arrive while the consumer is still busy with an earlier one are merged into one (tokens, text
and logprobs in order; the later output's totals and finish), so a consumer that falls behind catches up with
one stream chunk instead of working through a backlog of one-token chunks. Under load this is what keeps a
front end from spending its time on per-token events the client would receive late anyway.
"""

from __future__ import annotations

import asyncio

from shardserve.requests.outputs import RequestOutput


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """`earlier` followed by `later` as one output of the same request."""
    if earlier.new_logprobs is None and later.new_logprobs is None:
        logprobs = None
    else:
        logprobs = (earlier.new_logprobs or []) + (later.new_logprobs or [])
    return RequestOutput(later.request_id, later.prompt_token_ids, later.token_ids, later.text,
                         earlier.new_token_ids + later.new_token_ids, earlier.delta_text + later.delta_text,
                         logprobs, later.finished, later.finish_reason, later.error)


class OutputCollector:
    """Holds at most one item: an output (merged from every output not yet taken) or an error, which ends the
    request and replaces whatever output was waiting. `put` and `get` run on the same event loop."""

    __slots__ = ("_item", "_ready")

    def __init__(self) -> None:
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        waiting = self._item
        if isinstance(waiting, BaseException):
            return  # the request has already failed
        if waiting is not None and isinstance(item, RequestOutput):
            item = merge_outputs(waiting, item)
        self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while self._item is None:
            self._ready.clear()
            await self._ready.wait()
        item, self._item = self._item, None
        return item
