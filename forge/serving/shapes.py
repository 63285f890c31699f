"""The two response shapes of the front door: ``/v1/completions`` and ``/v1/chat/completions``.

Each builds a whole response from a sampled group (checked by vLLM's protocol class) and the
chunks of a streamed one (OpenAI's ``text_completion`` and ``chat.completion.chunk`` objects).
Both carry forge's extensions as vLLM names them: ``return_token_ids`` adds ``prompt_token_ids``
and each choice's ``token_ids``; every choice has ``policy_version``, the weights version that
sampled its oldest token.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from forge.types import Completion, PackedGroup

__all__ = ["ChatShape", "CompletionShape", "ResponseShape", "usage"]


def usage(group: PackedGroup, prompt_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` of one answered request (its completions' tokens are ``group``'s flat ids)."""
    completion_tokens = int(group.token_ids.numel())
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseShape:
    """What both routes share: the response's id, the extensions, the token strings."""

    prefix = ""
    chunk_object = ""

    def __init__(self, body: Any, tokenizer: Any, model_name: str) -> None:
        self.body = body
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.token_ids_asked = bool(getattr(body, "return_token_ids", None))

    # ------------------------------------------------------------ whole responses
    def response(self, group: PackedGroup, prompt_ids: list[int]) -> dict[str, Any]:
        """The whole response to ``group``, checked by vLLM's protocol class."""
        choices = [self._extended(self.choice(i, c), c) for i, c in enumerate(group.completions)]
        response = self.protocol_class()(
            id=self.id,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=usage(group, len(prompt_ids)),
        ).model_dump(exclude_none=True)
        if self.token_ids_asked:
            response["prompt_token_ids"] = prompt_ids
        response["choices"] = choices  # forge's extensions, which the protocol class drops
        return response

    def protocol_class(self) -> Any:
        raise NotImplementedError

    def choice(self, index: int, completion: Completion) -> dict[str, Any]:
        raise NotImplementedError

    def _extended(self, choice: dict[str, Any], completion: Completion) -> dict[str, Any]:
        choice["policy_version"] = int(completion.policy_version)
        if self.token_ids_asked:
            choice["token_ids"] = completion.token_ids.tolist()
        return choice

    # ------------------------------------------------------------ streamed responses
    @property
    def logprobs_asked(self) -> bool:
        raise NotImplementedError

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """One event of a streamed response."""
        return {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
            **extra,
        }

    def first_chunk(self, n: int, prompt_ids: list[int]) -> dict[str, Any] | None:
        """The event before any token (chat: each choice's role; ``prompt_token_ids`` when asked), or None."""
        return self.chunk([], prompt_token_ids=prompt_ids) if self.token_ids_asked else None

    def delta_choice(
        self,
        index: int,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        offset: int,
        tops: Sequence[Any] | None = None,
    ) -> dict[str, Any]:
        """A choice's next piece of text, and the tokens it came from (``offset``: how much text came before)."""
        raise NotImplementedError

    def final_choice(self, index: int, completion: Completion) -> dict[str, Any]:
        """A choice's last event: why it finished, its version (and all its ids, when asked)."""
        choice = {"index": index, "finish_reason": completion.finish_reason, **self.empty_delta()}
        return self._extended(choice, completion)

    def empty_delta(self) -> dict[str, Any]:
        raise NotImplementedError

    def tokens(self, token_ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in token_ids]


class CompletionShape(ResponseShape):
    prefix = "cmpl"
    chunk_object = "text_completion"

    def protocol_class(self) -> Any:
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse

        return CompletionResponse

    @property
    def logprobs_asked(self) -> bool:
        return self.body.logprobs is not None

    def choice(self, index: int, completion: Completion) -> dict[str, Any]:
        choice = {"index": index, "text": completion.text, "finish_reason": completion.finish_reason}
        if self.logprobs_asked:
            choice["logprobs"] = self._logprobs(
                completion.token_ids.tolist(), completion.logprobs.tolist(), 0, completion.top_logprobs
            )
        return choice

    def delta_choice(
        self,
        index: int,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        offset: int,
        tops: Sequence[Any] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": None}
        if self.logprobs_asked:
            choice["logprobs"] = self._logprobs(token_ids, logprobs, offset, tops)
        return choice

    def empty_delta(self) -> dict[str, Any]:
        return {"text": ""}

    def _logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[float], offset: int, tops: Sequence[Any] | None
    ) -> dict[str, Any]:
        tokens = self.tokens(token_ids)
        values = [float(x) for x in logprobs]
        offsets, at = [], offset
        for token in tokens:
            offsets.append(at)
            at += len(token)
        top = None
        if self.body.logprobs:  # logprobs=k: the k most likely tokens at each position
            per_position = tops if tops is not None else [[] for _ in tokens]
            top = [{self.tokenizer.decode([t]): float(lp) for t, lp in position} for position in per_position]
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}


class ChatShape(ResponseShape):
    prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def protocol_class(self) -> Any:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

        return ChatCompletionResponse

    @property
    def logprobs_asked(self) -> bool:
        return bool(self.body.logprobs)

    def choice(self, index: int, completion: Completion) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "message": {"role": "assistant", "content": completion.text},
            "finish_reason": completion.finish_reason,
        }
        if self.logprobs_asked:
            choice["logprobs"] = {
                "content": self._logprobs(
                    completion.token_ids.tolist(), completion.logprobs.tolist(), completion.top_logprobs
                )
            }
        return choice

    def first_chunk(self, n: int, prompt_ids: list[int]) -> dict[str, Any] | None:
        choices = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(n)
        ]
        extra = {"prompt_token_ids": prompt_ids} if self.token_ids_asked else {}
        return self.chunk(choices, **extra)

    def delta_choice(
        self,
        index: int,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        offset: int,
        tops: Sequence[Any] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "delta": {"content": text}, "finish_reason": None}
        if self.logprobs_asked:
            choice["logprobs"] = {"content": self._logprobs(token_ids, logprobs, tops)}
        return choice

    def empty_delta(self) -> dict[str, Any]:
        return {"delta": {}}

    def _logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[Any] | None
    ) -> list[dict[str, Any]]:
        per_position = tops if tops is not None else [[] for _ in token_ids]
        return [
            {"token": t, "logprob": float(lp), "bytes": list(t.encode()), "top_logprobs": self._top(top)}
            for t, lp, top in zip(self.tokens(token_ids), logprobs, per_position)
        ]

    def _top(self, position: Sequence[tuple[int, float]]) -> list[dict[str, Any]]:
        out = []
        for token_id, logprob in position:
            token = self.tokenizer.decode([token_id])
            out.append({"token": token, "logprob": float(logprob), "bytes": list(token.encode())})
        return out
