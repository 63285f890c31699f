"""Slurm hostlist expressions expand to node names in Slurm's order (forge.controller.slurm.hostlist)."""

import pytest

from forge.controller.slurm.hostlist import expand


@pytest.mark.parametrize(
    ("expression", "names"),
    [
        ("n[1-2]", ["n1", "n2"]),
        ("n[01-03,7]", ["n01", "n02", "n03", "n7"]),  # each bound has its own width, as scontrol's
        ("a,b", ["a", "b"]),
        ("n1", ["n1"]),
        ("", []),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("n[1-2],login", ["n1", "n2", "login"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ],
)
def test_expand_gives_each_node_in_order(expression: str, names: list[str]) -> None:
    """Ranges, lists, zero padding, plain names and several bracket groups expand as Slurm's do."""
    assert expand(expression) == names


@pytest.mark.parametrize(
    ("expression", "match"),
    [
        ("n[1-2", "never closed"),
        ("n1-2]", "without"),
        ("n[a-b]", "not a number"),
        ("n[3-1]", "backwards"),
        ("a,,b", "empty name"),
        ("n[[1]]", "nested"),
    ],
)
def test_a_bad_expression_is_an_error_naming_it(expression: str, match: str) -> None:
    """A malformed expression raises ValueError quoting the whole expression and the problem."""
    with pytest.raises(ValueError, match=match) as info:
        expand(expression)
    assert repr(expression) in str(info.value)


def test_a_non_string_is_refused() -> None:
    """Only strings are expressions."""
    with pytest.raises(ValueError, match="must be a string"):
        expand(["n1"])  # type: ignore[arg-type]
