"""What a policy replica does for a request that streams or may be cancelled.

A ``SampleRequest`` with ``stream_to`` (a Monarch ``Port``) gets a ``SampledSoFar`` message after
every engine step that sampled tokens of it (``StreamSender``, the engine's watcher of it); one
with ``request_id`` can be cancelled by that id while it runs (its client went away). A cancel
may reach a replica before the request does (it was still queued, or its batch was on the way):
``EarlyCancels`` remembers the last ids cancelled that way, and such a request is answered at
once with empty samples (``aborted_samples``, ``finish_reason`` "abort") instead of running.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from forge.types import Completion, SampledSoFar, SampleRequest

__all__ = ["EarlyCancels", "StreamSender", "aborted_samples"]

logger = logging.getLogger("forge.policy")


class StreamSender:
    """Sends each sample's new tokens to the request's port; stops quietly if the port is gone
    (the caller stopped listening: nothing of the request's result depends on the stream)."""

    def __init__(self, port: Any, n: int) -> None:
        self._port = port
        self._sent = [0] * n
        self._broken = False

    def __call__(
        self, index: int, token_ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[Any] | None = None
    ) -> None:
        start = self._sent[index]
        if self._broken or len(logprobs) <= start:
            return
        end = len(logprobs)  # a token counts once its logprob is there
        top = None if tops is None else tuple(tops[start:end])
        try:
            self._port.send(SampledSoFar(index, start, tuple(token_ids[start:end]), tuple(logprobs[start:end]), top))
        except Exception as exc:  # noqa: BLE001 - the stream is best effort; the result carries every token
            self._broken = True
            logger.debug("a streamed request's port refused its tokens (%s); not streaming it further", exc)
            return
        self._sent[index] = end


class EarlyCancels:
    """The last ``capacity`` request ids cancelled before their request reached this replica."""

    def __init__(self, capacity: int = 4096) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self._capacity:
            self._ids.popitem(last=False)

    def take(self, request_id: str | None) -> bool:
        """Whether ``request_id`` was cancelled early (then it is forgotten: ids are unique)."""
        if request_id is None or request_id not in self._ids:
            return False
        del self._ids[request_id]
        return True


def aborted_samples(request: SampleRequest, version: int) -> list[Completion]:
    """The answer to a request cancelled before it ran: ``n`` samples without a token."""
    prompt_ids = torch.tensor(list(request.prompt_ids or ()), dtype=torch.long)
    empty = torch.zeros(0, dtype=torch.long)
    return [
        Completion(prompt_ids, empty, torch.zeros(0), "", version, "abort", torch.zeros(0, dtype=torch.long))
        for _ in range(request.n)
    ]
