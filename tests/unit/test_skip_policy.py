"""Skips are not passes (tests/skip_policy.py): a skip that hides a test the machine should run fails
the run, a skip the test's own mark declares does not, and ``FORGE_ALLOW_SKIPS=1`` allows them all."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

# fnmatch patterns below write "[forge]" as "[[]forge]" (brackets are a character class there).
_POLICY = ("-p", "tests.skip_policy", "-p", "no:cacheprovider")


@pytest.fixture(autouse=True)
def _skips_not_allowed(monkeypatch: pytest.MonkeyPatch, pytester: pytest.Pytester) -> None:
    monkeypatch.delenv("FORGE_ALLOW_SKIPS", raising=False)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")


def test_an_end_to_end_module_skipped_by_a_failed_import_fails_the_run_naming_it(pytester: pytest.Pytester) -> None:
    """A tests/integration module whose importorskip fails makes the run fail, naming the module and the import."""
    pytester.makepyfile(
        **{
            "tests/integration/test_e2e": "import pytest\npytest.importorskip('no_such_engine')\ndef test_a(): pass\n",
            "tests/unit/test_fine": "def test_b(): pass\n",
        }
    )
    result = pytester.runpytest(*_POLICY)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "[[]forge] skipped: 1 (0 deliberate*",
            "[[]forge] FAILED: 1 skipped *FORGE_ALLOW_SKIPS=1*",
            "  tests/integration/test_e2e.py: no_such_engine import failed: No module named 'no_such_engine'",
        ]
    )
    result.assert_outcomes(passed=1, skipped=1)


def test_a_skip_decided_while_running_fails_the_run_but_a_declared_skip_mark_does_not(
    pytester: pytest.Pytester,
) -> None:
    """pytest.skip() from a probe (not root) fails the run; a unit test's skipif mark with its reason is deliberate."""
    pytester.makepyfile(
        **{
            "tests/unit/test_marked": "import pytest\n"
            "@pytest.mark.skipif(True, reason='a CUDA machine runs the checks instead')\ndef test_a(): pass\n",
        }
    )
    marked = pytester.runpytest(*_POLICY)
    assert marked.ret == pytest.ExitCode.OK
    marked.stdout.fnmatch_lines(["[[]forge] skipped: 1 (1 deliberate*"])

    pytester.makepyfile(**{"tests/unit/test_probe": "import pytest\ndef test_b(): pytest.skip('needs root')\n"})
    probed = pytester.runpytest(*_POLICY)
    assert probed.ret == pytest.ExitCode.TESTS_FAILED
    probed.stdout.fnmatch_lines(
        ["[[]forge] skipped: 2 (1 deliberate*", "  tests/unit/test_probe.py::test_b: needs root"]
    )


def test_a_skip_mark_in_an_end_to_end_module_fails_the_run(pytester: pytest.Pytester) -> None:
    """Under tests/integration even a skipif mark is refused: the end-to-end tests always run."""
    pytester.makepyfile(
        **{
            "tests/integration/test_e2e": "import pytest\n"
            "@pytest.mark.skipif(True, reason='no vLLM')\ndef test_a(): pass\n"
        }
    )
    result = pytester.runpytest(*_POLICY)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["  tests/integration/test_e2e.py::test_a: no vLLM"])


def test_allowing_skips_passes_the_run_and_still_lists_them(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With FORGE_ALLOW_SKIPS=1 the same skips pass, even when every chosen test was skipped, and are listed."""
    pytester.makepyfile(**{"tests/integration/test_e2e": "import pytest\npytest.importorskip('no_such_engine')\n"})
    monkeypatch.setenv("FORGE_ALLOW_SKIPS", "1")
    result = pytester.runpytest(*_POLICY)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["[[]forge] skipped: 1 *", "*allowed by FORGE_ALLOW_SKIPS*", "  tests/integration/*"])


def test_a_run_without_skips_passes_and_says_none_were_skipped(pytester: pytest.Pytester) -> None:
    """A run with no skip passes and still prints the skip count (0)."""
    pytester.makepyfile(**{"tests/unit/test_fine": "def test_b(): pass\n"})
    result = pytester.runpytest(*_POLICY)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["[[]forge] skipped: 0 (0 deliberate*"])
