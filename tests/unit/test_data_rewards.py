"""Reward registry and the built-in rewards (exact match, GSM8K numeric answer)."""

import random

import pytest

from forge.data import (
    TOY_ALPHABET,
    UnknownRewardError,
    exact_match_reward,
    extract_final_number,
    get_reward,
    gsm8k_reward,
    list_rewards,
    register_reward,
    rewards,
)
from forge.types import Prompt


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry so test registrations do not leak."""
    monkeypatch.setattr(rewards, "_REGISTRY", dict(rewards._REGISTRY))


def test_builtin_rewards_are_registered():
    """toy, exact_match and gsm8k are available by name."""
    assert {"toy", "exact_match", "gsm8k"} <= set(list_rewards())
    assert get_reward("gsm8k") is gsm8k_reward


def test_register_reward_makes_a_function_available_by_name(registry):
    """The decorator registers and returns the function unchanged."""

    @register_reward("always_half")
    def half(prompt, text):
        return 0.5

    assert get_reward("always_half") is half
    assert half(Prompt("p", "q", "a"), "x") == 0.5


def test_registering_a_name_twice_raises(registry):
    """A duplicate name is a ValueError naming it, not a silent overwrite."""
    register_reward("dup")(lambda p, t: 0.0)
    with pytest.raises(ValueError, match="'dup' is already registered"):
        register_reward("dup")(lambda p, t: 1.0)
    assert get_reward("dup")(None, "") == 0.0


def test_unknown_reward_is_a_key_error_listing_known_names():
    """get_reward('nope') raises a KeyError whose message lists the registered names."""
    with pytest.raises(KeyError) as info:
        get_reward("nope")
    assert isinstance(info.value, UnknownRewardError)
    message = str(info.value)
    assert "'nope'" in message and "gsm8k" in message and "exact_match" in message


@pytest.mark.parametrize("name", ["", None])
def test_reward_name_must_be_a_non_empty_string(name):
    """Empty or non-string names are refused."""
    with pytest.raises(ValueError):
        register_reward(name)


def test_exact_match_ignores_surrounding_whitespace_only():
    """' 42\\n' matches '42'; '42.0' and 'the answer is 42' do not."""
    p = Prompt("p", "q", "42")
    assert exact_match_reward(p, " 42\n") == 1.0
    assert exact_match_reward(p, "42.0") == 0.0
    assert exact_match_reward(p, "the answer is 42") == 0.0


@pytest.mark.parametrize(
    "text, number",
    [
        ("She has 3 apples and buys 4.\n#### 7", "7"),
        ("#### 1,234", "1234"),
        ("#### $ 56", "56"),
        ("#### -3.5", "-3.5"),
        ("first #### 1 then #### 2", "2"),
        ("so the answer is $42.", "42"),
        ("3 + 4 = 7", "7"),
        ("no digits here", None),
    ],
)
def test_extract_final_number(text, number):
    """'#### n' wins (last marker), else the last number; commas and '$' are dropped."""
    assert extract_final_number(text) == number


def test_extract_final_number_keeps_a_minus_sign_before_the_dollar():
    """'#### -$3' is -3: the sign may come before the currency sign."""
    assert extract_final_number("The loss is $3.\n#### -$3") == "-3"


def test_extract_final_number_reads_a_bare_decimal():
    """'#### .5' is 0.5, not 5."""
    assert extract_final_number("#### .5") == "0.5"


def test_extract_final_number_reads_a_range_dash_as_no_sign():
    """'between 10-12' ends with 12, not -12: a dash after a digit is a range, not a minus."""
    assert extract_final_number("the answer is between 10-12") == "12"


def test_extract_final_number_takes_the_number_right_after_the_marker():
    """'#### **72** (48+24)' is 72: markdown emphasis is skipped and what follows is ignored."""
    assert extract_final_number("#### **72** (48+24)") == "72"


@pytest.mark.parametrize(
    "response, score",
    [
        ("#### 72", 1.0),
        ("She sold 48 + 24 = 72 clips.", 1.0),
        ("The answer is 72.0", 1.0),
        ("#### 71", 0.0),
        ("72 is wrong, #### 70", 0.0),
        ("I don't know", 0.0),
    ],
)
def test_gsm8k_reward_compares_final_numbers(response, score):
    """The reference's '#### 72' is compared numerically with the response's final number."""
    p = Prompt("gsm-1", "Natalia sold clips ...", "Natalia sold 48/2 = 24 clips in May.\n#### 72")
    assert gsm8k_reward(p, response) == score


def test_gsm8k_reward_accepts_a_bare_number_as_reference():
    """An answer field of just '1,000' works too."""
    assert gsm8k_reward(Prompt("p", "q", "1,000"), "#### 1000") == 1.0


def test_gsm8k_reward_raises_on_a_reference_without_a_number():
    """A data error names the prompt rather than scoring everything 0."""
    with pytest.raises(ValueError, match="gsm-9"):
        gsm8k_reward(Prompt("gsm-9", "q", "none"), "#### 1")


@pytest.mark.parametrize("name", ["toy", "exact_match", "gsm8k"])
def test_builtin_rewards_stay_in_unit_interval(name):
    """On random responses every built-in reward returns a float in [0, 1]."""
    rng = random.Random(0)
    fn = get_reward(name)
    p = Prompt("p", "371=", "173")
    for _ in range(300):
        text = "".join(rng.choice(TOY_ALPHABET + "#\n") for _ in range(rng.randint(0, 12)))
        score = fn(p, text)
        assert isinstance(score, float) and 0.0 <= score <= 1.0
