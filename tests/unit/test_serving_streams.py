"""The pieces of a streamed answer (``forge.serving.streaming``, ``forge.actors.policy_streams``):
text decoded as tokens come, held back where a stop string may begin or a character is not
finished; a replica's progress messages; cancels that come before their request."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from forge.actors.policy_streams import EarlyCancels, StreamSender, aborted_samples
from forge.models.tiny import build_char_tokenizer
from forge.serving.streaming import TextSoFar
from forge.types import Prompt, SampledSoFar, SampleRequest


@pytest.fixture(scope="module")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE learnt on ASCII only: a character outside it is several byte tokens."""
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["the cat sat on the mat"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw)


def test_text_decoded_a_token_at_a_time_adds_up_and_never_shows_half_a_character(byte_tokenizer) -> None:
    text = "the caté sat ✓ on"
    ids = byte_tokenizer(text)["input_ids"]
    assert len(ids) > len(text.split()) + 4  # é and ✓ are several byte tokens each
    stream = TextSoFar(byte_tokenizer)
    pieces = [stream.add([i]) for i in ids]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert stream.rest(text) == ""


def test_text_held_back_by_the_longest_stop_string_less_one_is_sent_with_the_result() -> None:
    tokenizer = build_char_tokenizer()
    stream = TextSoFar(tokenizer, holdback=2)
    ids = tokenizer("12345", add_special_tokens=False)["input_ids"]
    sent = "".join(stream.add([i]) for i in ids)
    assert sent == "123"  # "45" might still begin a three-character stop string
    assert stream.rest("1234") == "4"  # the engine's text, cut where the stop string began
    assert stream.rest("9") == ""  # a result that does not continue what was sent adds nothing


class Port:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[SampledSoFar] = []
        self.fail = fail

    def send(self, message: SampledSoFar) -> None:
        if self.fail:
            raise RuntimeError("the receiver is gone")
        self.sent.append(message)


def test_a_replica_sends_each_samples_new_tokens_once_and_stops_quietly_when_the_port_is_gone() -> None:
    port = Port()
    sender = StreamSender(port, n=2)
    sender(0, [5, 6], [-0.1, -0.2])
    sender(1, [7], [-0.3])
    sender(0, [5, 6], [-0.1, -0.2])  # a step that sampled nothing new for it
    sender(0, [5, 6, 8], [-0.1, -0.2, -0.4])
    assert port.sent == [
        SampledSoFar(0, 0, (5, 6), (-0.1, -0.2)),
        SampledSoFar(1, 0, (7,), (-0.3,)),
        SampledSoFar(0, 2, (8,), (-0.4,)),
    ]
    broken = StreamSender(Port(fail=True), n=1)
    broken(0, [1], [-1.0])  # no error reaches the engine's step loop
    broken(0, [1, 2], [-1.0, -2.0])


def test_a_cancel_that_comes_first_is_kept_for_its_request_once_and_the_oldest_are_forgotten() -> None:
    early = EarlyCancels(capacity=2)
    for request_id in ("a", "b", "c"):
        early.add(request_id)
    assert not early.take("a") and not early.take(None)  # forgotten; None never matches
    assert early.take("b") and not early.take("b") and early.take("c")
    request = SampleRequest(Prompt("p", "1=", ""), n=3, prompt_ids=(4, 5))
    samples = aborted_samples(request, version=7)
    assert len(samples) == 3 and all(s.finish_reason == "abort" and s.token_ids.numel() == 0 for s in samples)
    assert samples[0].prompt_ids.tolist() == [4, 5] and samples[0].policy_version == 7
