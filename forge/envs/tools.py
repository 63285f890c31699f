"""The tool-call convention: the policy writes a call, the environment runs it, the result is
appended to the trajectory as an observation, and the policy takes another turn.

A call is one line of the action's text::

    call <tool name> <argument text>

(lower case and spaces only, so that even a character-level tiny model can write it). The
environment answers with ``result <value>``, or ``error <message>`` when the tool is unknown
or raises; a failing tool is the policy's mistake, not the environment's, so the trajectory
goes on. Anything that is not a call is the policy's answer, which ``ToolEnvironment.answer``
scores.
"""

from __future__ import annotations

import abc
import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from forge.envs.base import Action, Environment, StepResult

__all__ = ["ToolCall", "ToolEnvironment", "parse_tool_call"]

CALL_PATTERN = re.compile(r"^\s*call\s+([a-z_][a-z0-9_]*)\s*(.*?)\s*$", re.DOTALL)

Tool = Callable[[str], str | Awaitable[str]]


@dataclass(frozen=True)
class ToolCall:
    name: str
    argument: str


def parse_tool_call(text: str) -> ToolCall | None:
    """The call written in ``text`` (``call <name> <argument>``), or None if it is not a call."""
    match = CALL_PATTERN.match(text)
    if match is None:
        return None
    return ToolCall(match.group(1), match.group(2))


class ToolEnvironment(Environment):
    """An environment whose actions are tool calls until the policy answers.

    Subclasses set ``tools`` (name -> ``fn(argument) -> str``, sync or async) and implement
    ``answer``. ``max_tool_calls`` bounds the calls of one episode: past it, a call is scored
    as the answer would be (which usually gives nothing).
    """

    tools: dict[str, Tool] = {}
    max_tool_calls: int = 4

    def __init__(self) -> None:
        self.tool_calls = 0

    async def step(self, action: Action) -> StepResult:
        call = parse_tool_call(action.text)
        if call is None or self.tool_calls >= self.max_tool_calls:
            return await self.answer(action)
        self.tool_calls += 1
        return StepResult(await self.run_tool(call), 0.0, False)

    async def run_tool(self, call: ToolCall) -> str:
        """The observation for ``call``: ``result <value>`` or ``error <why>``."""
        tool = self.tools.get(call.name)
        if tool is None:
            return f" error unknown tool {call.name}; tools: {' '.join(sorted(self.tools))} "
        try:
            value = tool(call.argument)
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:  # the policy's bad call: it sees the error and goes on
            return f" error {type(exc).__name__.lower()} "
        return f" result {value} "

    @abc.abstractmethod
    async def answer(self, action: Action) -> StepResult:
        """Score the policy's answer (an action that is not a tool call)."""
