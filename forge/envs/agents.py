"""Agents to train through forge's OpenAI front door (``rollout.agent: forge.envs.agents:<fn>``).

An agent is ``async def fn(client, prompt) -> float``: ``client`` is an ``openai.AsyncOpenAI``
bound to one session of the policy service, ``prompt`` the task's ``Prompt``; it talks to the
model as it would to any OpenAI server and returns the episode's reward. Nothing in an agent is
forge's: the same function runs against ``vllm serve`` or ``apps.serve.main``. forge records the
completions it was served and trains on their tokens (``apps.grpo.agents``).

- ``reversal_game``: the multi-turn game of ``configs/multiturn_tiny.yaml``
  (``forge.envs.toy.ReverseWithFeedback``) written as an agent over ``/v1/completions``: the same
  tokens reach the model, so the two runs learn alike.
- ``tool_reversal_agent``: a chat agent with a tool. The model may write ``call reverse <digits>``
  (the convention of ``forge.envs.tools``); the agent runs the tool, answers with a user message
  ``result <value>`` and asks again; the first reply that is not a call is the answer.
"""

from __future__ import annotations

from typing import Any

from forge.data.rewards import toy_partial_reward
from forge.envs.tools import parse_tool_call
from forge.envs.toy import feedback_marks
from forge.types import Prompt

__all__ = ["reversal_game", "tool_reversal_agent"]

MODEL = "policy"
"""The model name forge's front door serves a training run's policy under."""


async def reversal_game(client: Any, prompt: Prompt, max_guesses: int = 3) -> float:
    """Up to ``max_guesses`` guesses of the reversed digits, each after the marks of the last
    (right digits kept, wrong ones ``x``); the final guess's partial credit is the reward."""
    text = prompt.text
    for guess_number in range(1, max_guesses + 1):
        reply = await client.completions.create(model=MODEL, prompt=text)
        sampled = reply.choices[0].text
        words = sampled.split()
        guess = words[0] if words else ""
        if guess == prompt.answer or guess_number == max_guesses:
            return toy_partial_reward(prompt, sampled)
        text += f"{sampled} {feedback_marks(guess, prompt.answer)}="
    raise AssertionError("unreachable")


TOOLS = {"reverse": lambda argument: argument.strip()[::-1]}


async def tool_reversal_agent(client: Any, prompt: Prompt, max_tool_calls: int = 2, max_tokens: int = 16) -> float:
    """The reversal task as a chat with one tool, ``reverse``: a reply ``call reverse 371`` is
    answered ``result 173``; the first reply that is not a call is scored as the answer (a call
    past ``max_tool_calls`` is scored as one, and scores nothing)."""
    messages = [{"role": "user", "content": prompt.text}]
    for calls in range(max_tool_calls + 1):
        reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens)
        content = reply.choices[0].message.content or ""
        call = parse_tool_call(content)
        if call is None or calls == max_tool_calls:
            return toy_partial_reward(prompt, content)
        tool = TOOLS.get(call.name)
        result = f"result {tool(call.argument)}" if tool is not None else f"error unknown tool {call.name}"
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": result}]
    raise AssertionError("unreachable")
