"""Streamed answers (``stream: true``): the replica's tokens as server-sent events, as they come.

A streamed request carries a Monarch ``Port`` (``SampleRequest.stream_to``); its replica sends a
``SampledSoFar`` after each engine step that sampled tokens of it. ``stream_answer`` turns those
into OpenAI's chunks (``forge.serving.shapes``) and ends with what only the whole result holds:
any tokens not streamed yet, each choice's ``finish_reason`` and version, ``usage`` when
``stream_options.include_usage`` asks, and ``data: [DONE]``. The result is what the client's text
adds up to: the streamed text is held back where a stop string might still begin, and a piece the
result's text does not continue with is never sent.

Failures: one before the first token is answered as any request's (an HTTP status with
OpenAI's error body); one after it, such as the replica dying (a streamed request is never sent
again: its client has part of the answer already), ends the stream with an error event. A client
that goes away cancels its request on the replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from forge.serving.shapes import usage
from forge.types import PackedGroup, SampledSoFar

__all__ = ["DISCONNECTED", "TextSoFar", "sse", "stream_answer", "until_disconnected"]

DISCONNECTED = object()
"""What ``until_disconnected`` returns when the client left first."""


def sse(payload: Any) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class TextSoFar:
    """One choice's text, decoded as its tokens come (a window of ids at a time, as vLLM's own
    incremental detokeniser does), with the last ``holdback`` characters kept back: a stop string
    that ends there would cut the text before them."""

    def __init__(self, tokenizer: Any, holdback: int = 0) -> None:
        self._tokenizer = tokenizer
        self._holdback = holdback
        self.ids: list[int] = []
        self._prefix_at = 0  # ids[_prefix_at:_read_at] were decoded last time, as context
        self._read_at = 0
        self._pending = ""  # decoded, not sent yet
        self.sent = ""

    def add(self, token_ids: Any) -> str:
        """The text to send now for these new tokens (maybe none)."""
        self.ids.extend(token_ids)
        decode = self._tokenizer.decode
        context = decode(self.ids[self._prefix_at : self._read_at], skip_special_tokens=True)
        text = decode(self.ids[self._prefix_at :], skip_special_tokens=True)
        if len(text) > len(context) and not text.endswith("\ufffd"):  # a character not finished yet waits
            self._pending += text[len(context) :]
            self._prefix_at, self._read_at = self._read_at, len(self.ids)
        ready = len(self._pending) - self._holdback
        if ready <= 0:
            return ""
        out, self._pending = self._pending[:ready], self._pending[ready:]
        self.sent += out
        return out

    def rest(self, final_text: str) -> str:
        """What the result's text adds to what was sent (nothing if it does not continue it)."""
        return final_text[len(self.sent) :] if final_text.startswith(self.sent) else ""


@dataclass
class _Choice:
    text: TextSoFar
    tokens: int = 0
    """Tokens streamed so far."""


async def _recv(receiver: Any) -> SampledSoFar:
    return await receiver.recv()


async def next_or_end(receiver: Any, result: asyncio.Task) -> SampledSoFar | None:
    """The request's next progress message, or None once it has ended first (``result`` done)."""
    message = asyncio.ensure_future(_recv(receiver))
    try:
        await asyncio.wait({message, result}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not message.done():
            message.cancel()
    if message.done() and not message.cancelled() and message.exception() is None:
        return message.result()
    return None


async def first_event(receiver: Any, result: asyncio.Task) -> SampledSoFar | None:
    """Wait for the request's first tokens or its end; the message, or None when it ended first
    (its failure is then raised here: it is answered before the stream starts)."""
    message = await next_or_end(receiver, result)
    if message is None:
        result.result()  # raises the request's failure
    return message


async def stream_answer(
    front: Any,
    prepared: Any,
    shape: Any,
    receiver: Any,
    result: asyncio.Task,
    first: SampledSoFar | None,
) -> AsyncIterator[str]:
    """The events of one streamed answer (see the module's docstring); ``result``: the task
    routing the request; ``first``: its first message, already taken."""
    request = prepared.request
    holdback = max((len(s) for s in request.stop), default=1) - 1
    choices = [_Choice(TextSoFar(front.tokenizer, holdback)) for _ in range(request.n)]
    completed = False
    try:
        opening = shape.first_chunk(request.n, list(request.prompt_ids or ()))
        if opening is not None:
            yield sse(opening)
        message = first
        while True:
            event = None if message is None else _delta(shape, choices, message)
            if event is not None:
                yield sse(event)
            if result.done():
                break
            message = await next_or_end(receiver, result)
        try:
            group: PackedGroup = result.result()
        except Exception as exc:  # noqa: BLE001 - after the first token: an error event ends the stream
            error = front.as_openai_error(exc)
            front.counts.answered(error.status)
            yield sse(error.body())
            yield sse("[DONE]")
            completed = True
            return
        prompt_ids = front.finish(prepared, group)
        for event in _ending(shape, choices, group, prompt_ids):
            yield sse(event)
        yield sse("[DONE]")
        completed = True
    finally:
        if not completed and not result.done():  # the client went away: nothing waits for the answer
            result.cancel()
            with contextlib.suppress(BaseException):
                await result


def _delta(shape: Any, choices: list[_Choice], message: SampledSoFar) -> dict[str, Any] | None:
    """The chunk for one progress message (None: nothing new to send yet)."""
    choice = choices[message.index]
    skip = choice.tokens - message.start  # an overlap with what was streamed already
    if skip < 0 or skip >= len(message.token_ids):
        return None  # a gap (the result fills it in) or nothing new
    token_ids, logprobs = message.token_ids[skip:], message.logprobs[skip:]
    tops = None if message.top_logprobs is None else message.top_logprobs[skip:]
    offset = len(choice.text.sent)
    text = choice.text.add(token_ids)
    choice.tokens += len(token_ids)
    if not text and not shape.logprobs_asked:
        return None
    return shape.chunk([shape.delta_choice(message.index, text, token_ids, logprobs, offset, tops)])


def _ending(shape: Any, choices: list[_Choice], group: PackedGroup, prompt_ids: list[int]) -> list[dict[str, Any]]:
    """The last events: what the result adds to each choice, every choice's finish, the usage."""
    events = []
    for index, (choice, completion) in enumerate(zip(choices, group.completions)):
        token_ids = completion.token_ids.tolist()[choice.tokens :]
        logprobs = completion.logprobs.tolist()[choice.tokens :]
        tops = None if completion.top_logprobs is None else completion.top_logprobs[choice.tokens :]
        text = choice.text.rest(completion.text)
        if text or token_ids:
            offset = len(choice.text.sent)
            events.append(shape.chunk([shape.delta_choice(index, text, token_ids, logprobs, offset, tops)]))
    events.append(shape.chunk([shape.final_choice(i, c) for i, c in enumerate(group.completions)]))
    options = getattr(shape.body, "stream_options", None)
    if options is not None and getattr(options, "include_usage", False):
        events.append(shape.chunk([], usage=usage(group, len(prompt_ids))))
    return events


async def until_disconnected(work: Awaitable[Any], request: Any) -> Any:
    """``work``'s result; or, when the HTTP client of ``request`` (a Starlette request whose body
    was read) disconnects first, ``work`` cancelled and ``DISCONNECTED``."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():  # the client left: its request is cancelled (and on the replicas)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return DISCONNECTED
        return task.result()
    finally:
        watch.cancel()


async def _disconnect(request: Any) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
