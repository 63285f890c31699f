"""``forge.describe.describe``: one line for an error, whatever its shape (plain logic)."""

from forge.describe import describe


class FakeMeshFailure:
    """Shaped like Monarch's MeshFailure: ``report()`` opens with a heading, the cause follows."""

    def report(self) -> str:
        return (
            "The actor <root>.<W w-a0{'procs': 0/1}> and all its descendants have failed:\n"
            "  the process this actor was running on failed: Killed(sig=9)\n"
        )

    def __str__(self) -> str:
        return "MeshFailure(mesh_name=w-a0, ...)"


def test_a_mesh_failure_is_described_by_its_report_heading_and_cause():
    assert describe(FakeMeshFailure()) == (
        "The actor <root>.<W w-a0{'procs': 0/1}> and all its descendants have failed: "
        "the process this actor was running on failed: Killed(sig=9)"
    )


def test_only_the_first_line_of_a_multi_line_message_counts():
    error = RuntimeError("bad input x\n  full_key: a.b\n  object_type=Config")
    assert describe(error) == "bad input x"


def test_an_empty_message_gives_the_type_name_and_typed_prefixes_it():
    assert describe(ValueError()) == "ValueError"
    assert describe(KeyError("k"), typed=True) == "KeyError: 'k'"


def test_the_line_is_cut_at_the_limit():
    assert describe(RuntimeError("x" * 1000), limit=10) == "x" * 10
