"""One format for prompts and SFT examples: the template, the chat template, the end token."""

import pytest

from forge.data import PromptFormat
from forge.models import make_tiny_model
from forge.models.tiny import IM_END, LAYOUTS, build_char_tokenizer


def test_without_a_chat_template_the_prompt_is_the_templated_question_and_the_answer_ends_with_eos():
    tok = build_char_tokenizer()
    fmt = PromptFormat(tok, template="q: {text} a:")
    assert fmt.prompt("1+2=") == "q: 1+2= a:"
    example = fmt.sft_example("1+2=", "3")
    assert tok.decode(example.prompt_ids) == "q: 1+2= a:"
    assert example.answer_ids.tolist() == [tok.convert_tokens_to_ids("3"), tok.eos_token_id]


def test_with_a_chat_template_the_answer_is_the_assistant_turn_ending_with_its_end_token(tmp_path):
    """The prompt is the user turn with the assistant's opened; the target is the answer and <|im_end|>."""
    from transformers import AutoTokenizer

    folder = make_tiny_model(tmp_path / "chat", num_layers=1, **LAYOUTS["chat"])
    tok = AutoTokenizer.from_pretrained(folder)
    fmt = PromptFormat.from_model(str(folder))
    assert fmt.chat and fmt.prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    example = fmt.sft_example("hi", "42")
    assert example.prompt_ids.tolist() == tok(fmt.prompt("hi"), add_special_tokens=True).input_ids  # as vLLM encodes it
    assert tok.decode(example.answer_ids) == "42" + IM_END
    assert not PromptFormat.from_model(str(folder), chat=False).chat  # chat_template: false turns it off


def test_a_template_without_the_question_is_refused():
    with pytest.raises(ValueError, match="must contain '{text}'"):
        PromptFormat(build_char_tokenizer(), template="no question here")


def test_a_checkpoint_with_another_tokenizer_than_the_config_expects_is_refused(tmp_path):
    """model.tokenizer names the tokenizer the run expects: the same one passes, another (here the
    chat layout's, two more tokens and a template) is an error naming both folders."""
    from apps.common.inputs import check_tokenizer

    plain = make_tiny_model(tmp_path / "plain", num_layers=1)
    same = make_tiny_model(tmp_path / "same", num_layers=1, seed=3)
    chat = make_tiny_model(tmp_path / "chat", num_layers=1, **LAYOUTS["chat"])
    check_tokenizer(plain, str(same))
    check_tokenizer(plain)
    with pytest.raises(ValueError, match=rf"{plain}.*another tokenizer than model.tokenizer '{chat}'.*tokens vs"):
        check_tokenizer(plain, str(chat))


def test_a_tokenizer_that_adds_a_bos_gets_it_on_the_prompt_as_vllm_encodes_it_never_in_the_answer():
    """A tokenizer whose encoding starts with <bos> (Llama's do; vLLM encodes a string prompt with
    it): the SFT prompt ids start with it, exactly as vLLM's, and the answer ids hold none."""
    from tokenizers.processors import TemplateProcessing

    tok = build_char_tokenizer()
    tok._tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    example = PromptFormat(tok).sft_example("1+2=", "3")
    assert example.prompt_ids.tolist() == tok("1+2=", add_special_tokens=True).input_ids
    assert example.prompt_ids[0] == tok.bos_token_id
    assert example.answer_ids.tolist() == [tok.convert_tokens_to_ids("3"), tok.eos_token_id]
