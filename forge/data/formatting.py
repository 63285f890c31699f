"""How a question becomes the policy's prompt, and a (question, answer) pair an SFT example.

Both must agree, or SFT teaches the model to answer prompts that RL and evaluation never show
it. So one ``PromptFormat`` does both, from the model's own tokenizer:

- the question goes through ``template`` (``{text}`` is the question), then, where the tokenizer
  has a chat template and ``chat`` is on, into a user turn with the assistant's turn opened
  (``add_generation_prompt``), as a chat model is prompted;
- an SFT answer is what the chat template writes after that prompt for the assistant's turn
  (its end-of-turn token included), or, without a chat template, the answer followed by the
  tokenizer's EOS: the token that ends a completion in vLLM.

The prompt is tokenised as vLLM tokenises a string prompt (``add_special_tokens=True``), so the
trained prompt ids are the ids the policy sees.
"""

from __future__ import annotations

from typing import Any

import torch

from forge.types import PreferenceExample, SFTExample

__all__ = ["PromptFormat"]


class PromptFormat:
    """Prompt text and SFT token ids from one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any, template: str = "{text}", chat: bool = True) -> None:
        if "{text}" not in template:
            raise ValueError(f"prompt_template must contain '{{text}}' (the question), got {template!r}")
        self.tokenizer = tokenizer
        self.template = template
        self.chat = bool(chat and getattr(tokenizer, "chat_template", None))
        if not self.chat and tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has neither a chat template nor an EOS token: nothing ends an answer")

    @classmethod
    def from_model(cls, model_path: str, template: str = "{text}", chat: bool = True) -> PromptFormat:
        """The format of the checkpoint folder ``model_path``'s own tokenizer."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_path), template, chat)

    def prompt(self, question: str) -> str:
        """The text the policy is prompted with."""
        text = self.template.format(text=question)
        if not self.chat:
            return text
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )

    def sft_example(self, question: str, answer: str) -> SFTExample:
        """The prompt's and the answer's token ids; only the answer's are trained."""
        prompt = self.prompt(question)
        if self.chat:
            text = self.template.format(text=question)
            turns = [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
            full = self.tokenizer.apply_chat_template(turns, tokenize=False)
            if not full.startswith(prompt):
                raise ValueError(
                    "the tokenizer's chat template writes the user turn differently when an assistant turn "
                    "follows, so the prompt is not a prefix of the training text; set chat_template: false"
                )
            # The end-of-turn token is the answer's last token; what the template adds after it
            # (a newline before the next turn) is never sampled.
            answer_ids = self._ids(full[len(prompt) :].rstrip("\n"), special=False)
        else:
            answer_ids = self._ids(answer, special=False) + [self.tokenizer.eos_token_id]
        return SFTExample(torch.tensor(self._ids(prompt, special=True)), torch.tensor(answer_ids))

    def preference_example(self, question: str, chosen: str, rejected: str) -> PreferenceExample:
        """A preference pair's ids: the prompt once, each response written as an SFT answer is."""
        good, bad = self.sft_example(question, chosen), self.sft_example(question, rejected)
        return PreferenceExample(good.prompt_ids, good.answer_ids, bad.answer_ids)

    def _ids(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special).input_ids)
