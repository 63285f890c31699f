"""A session's turns as token ids: the model's own tokens are never tokenised again.

An OpenAI client sends a conversation's whole text every turn (the chat template's rendering
of all messages, or a completion prompt that grows). Tokenising that text afresh would re-encode
the tokens the model sampled on earlier turns, and a round trip through text can change token
boundaries (or drop a stop token the text never showed): the replica's prefix cache would miss,
and a trainer would score tokens the policy never sampled.

``SessionTurns`` keeps each session's last turn (its text, its prompt ids, the one completion
sampled for it). A new turn whose text starts with that turn's text followed by the completion's
text continues it: its ids are the last prompt's ids, the sampled ids exactly, then the text
added since (the chat template's end of the assistant's message, the next user message, the next
generation prompt), tokenised once. A turn that does not continue (the client rewrote the
history, or the session is new) is tokenised whole. The last sampled token, when it is a special
token (an end-of-turn the model wrote) that the added text starts with again, is not repeated.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SessionTurn", "SessionTurns", "TurnIds"]


@dataclass(frozen=True)
class TurnIds:
    """A turn's prompt as ids, and how much of it is new."""

    prompt_ids: list[int]
    continued_from: int | None
    """None: tokenised whole (the first turn, or one that does not continue the last); else how
    many leading ids are the last turn's prompt and completion, exactly as they were."""


@dataclass(frozen=True)
class SessionTurn:
    """One served turn of a session: the rendered text it was asked with, and what was sampled."""

    text: str
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_text: str


class SessionTurns:
    """The last turn of up to ``capacity`` sessions (least recently used ones are forgotten)."""

    def __init__(self, tokenizer: Any, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.tokenizer = tokenizer
        self.capacity = capacity
        self._last: OrderedDict[str, SessionTurn] = OrderedDict()
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ()) | {
            i for i, token in added.items() if getattr(token, "special", False)
        }

    def __len__(self) -> int:
        return len(self._last)

    def prompt_ids(self, session: str | None, text: str) -> TurnIds:
        """The ids to sample ``text`` from, continuing ``session``'s last turn where ``text`` does."""
        last = self._last.get(session) if session is not None else None
        if last is not None:
            head = last.text + last.completion_text
            if text.startswith(head):
                self._last.move_to_end(session)
                history = last.prompt_ids + last.completion_ids
                added = self._added_text(last.completion_ids, text[len(head) :])
                new_ids = self.tokenizer(added, add_special_tokens=False)["input_ids"] if added else []
                return TurnIds(history + list(new_ids), len(history))
        return TurnIds(list(self.tokenizer(text, add_special_tokens=True)["input_ids"]), None)

    def remember(self, session: str, text: str, prompt_ids: list[int], completion: Any) -> SessionTurn:
        """Keep the turn just served for ``session`` (its one completion), as the one to continue."""
        ids = completion.token_ids.tolist() if isinstance(completion.token_ids, torch.Tensor) else completion.token_ids
        turn = SessionTurn(text, list(prompt_ids), list(ids), completion.text)
        self._last[session] = turn
        self._last.move_to_end(session)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
        return turn

    def forget(self, session: str) -> None:
        self._last.pop(session, None)

    def _added_text(self, completion_ids: list[int], added: str) -> str:
        """The added text, less a special token the model already sampled at its end."""
        if completion_ids and completion_ids[-1] in self._special:
            token = self.tokenizer.convert_ids_to_tokens(completion_ids[-1])
            if isinstance(token, str) and added.startswith(token):
                return added[len(token) :]
        return added
