"""A session's turns as ids (``forge.serving.sessions``) and the trajectories built from a recorded
session (``forge.serving.recording``), on the tiny model's real chat tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from forge.models.tiny import build_char_tokenizer
from forge.serving.recording import RecordedTurn, Recorder, trajectories
from forge.serving.sessions import SessionTurns


@dataclass
class Sampled:
    """What a ``Completion`` gives the session code: the ids, the text vLLM shows, logprobs, versions."""

    token_ids: torch.Tensor
    text: str
    logprobs: torch.Tensor | None = None
    policy_version: int = 0
    finish_reason: str = "stop"

    def versions(self) -> torch.Tensor:
        return torch.full(self.token_ids.shape, self.policy_version, dtype=torch.long)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(chat_template=True)


def _render(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_a_continued_turn_keeps_the_sampled_ids_a_round_trip_through_text_would_change(tokenizer) -> None:
    sessions = SessionTurns(tokenizer)
    messages = [{"role": "user", "content": "371="}]
    first = _render(tokenizer, messages)
    turn1 = sessions.prompt_ids("s", first)
    assert turn1.continued_from is None and turn1.prompt_ids == tokenizer(first)["input_ids"]
    eos, im_end = tokenizer.convert_tokens_to_ids(["<eos>", "<|im_end|>"])
    # The model wrote "1", an <eos> the text does not show, "7", then ended its turn with <|im_end|>.
    ids = [tokenizer.convert_tokens_to_ids("1"), eos, tokenizer.convert_tokens_to_ids("7"), im_end]
    sessions.remember("s", first, turn1.prompt_ids, Sampled(torch.tensor(ids), "17"))
    messages += [{"role": "assistant", "content": "17"}, {"role": "user", "content": "x="}]
    second = _render(tokenizer, messages)
    turn2 = sessions.prompt_ids("s", second)
    history = turn1.prompt_ids + ids
    assert turn2.continued_from == len(history) and turn2.prompt_ids[: len(history)] == history
    # The added text, tokenised once, without the <|im_end|> the model already wrote.
    added = second[len(first) + len("17") + len("<|im_end|>") :]
    assert turn2.prompt_ids[len(history) :] == tokenizer(added, add_special_tokens=False)["input_ids"]
    assert turn2.prompt_ids != tokenizer(second)["input_ids"]  # what tokenising the text whole would give


def test_a_rewritten_history_another_session_or_a_forgotten_one_is_tokenised_whole(tokenizer) -> None:
    sessions = SessionTurns(tokenizer, capacity=1)
    first = _render(tokenizer, [{"role": "user", "content": "12="}])
    turn = sessions.prompt_ids("a", first)
    sessions.remember("a", first, turn.prompt_ids, Sampled(torch.tensor(tokenizer("21")["input_ids"]), "21"))
    rewritten = _render(
        tokenizer,
        [{"role": "user", "content": "12="}, {"role": "assistant", "content": "99"}, {"role": "user", "content": "?"}],
    )
    assert sessions.prompt_ids("a", rewritten).continued_from is None
    continued = first + "21<|im_end|>\n"
    assert sessions.prompt_ids("other", continued).continued_from is None
    assert sessions.prompt_ids("a", continued).continued_from is not None
    sessions.remember("b", first, turn.prompt_ids, Sampled(torch.tensor([5]), "x"))  # capacity 1: "a" is forgotten
    assert len(sessions) == 1 and sessions.prompt_ids("a", continued).continued_from is None
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        SessionTurns(tokenizer, capacity=0)


def _turn(prompt: list[int], continued: int | None, ids: list[int], version: int = 0) -> RecordedTurn:
    logprobs = -torch.arange(1, len(ids) + 1, dtype=torch.float32) / 10
    return RecordedTurn(prompt, continued, Sampled(torch.tensor(ids), "", logprobs, version))


def test_a_recorded_session_becomes_trajectories_training_only_the_sampled_ids() -> None:
    recorder = Recorder(temperature=1.0)
    record = recorder.open("g/0")
    with pytest.raises(ValueError, match="already being recorded"):
        recorder.open("g/0")
    record.turns += [
        _turn([1, 2, 3], None, [4, 5]),  # the prompt, two sampled ids
        _turn([1, 2, 3, 4, 5, 6, 7], 5, [8], version=1),  # continues: 6, 7 were added by the agent
        _turn([9, 9], None, [10, 11, 12]),  # the agent rewrote its history: a second trajectory
    ]
    first, second = trajectories(recorder.close("g/0"), "g", reward=0.5)
    assert first.prompt_ids.tolist() == [1, 2, 3] and first.response_ids.tolist() == [4, 5, 6, 7, 8]
    assert first.loss_mask.tolist() == [True, True, False, False, True]
    assert first.behaviour_logprobs.tolist() == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.1])
    episode = first.to_episode("g", torch.zeros(5), 1.0)
    assert episode.token_versions.tolist() == [0, 0, -1, -1, 1] and episode.policy_version == 0
    assert second.prompt_ids.tolist() == [9, 9] and second.response_ids.tolist() == [10, 11, 12]
    assert first.reward == second.reward == 0.5 and first.done and second.done
    assert recorder.get("g/0") is None
