"""Skips are not passes: a pytest plugin (loaded by ``tests/conftest.py``) that fails a run whose
skips hide tests the machine should have run, and prints the skip count at the end of every run.

Why: every end-to-end module starts with ``pytest.importorskip("vllm")`` and the root-only tests
skip themselves when not root, so a broken vLLM install or a run as the wrong user turned whole
suites into skips while the run still succeeded.

What counts (a skip the run does not allow):

- any skip under ``tests/integration``: a module skipped at collection or a test skipped, for any
  reason (a missing or broken vLLM, a skip mark): the end-to-end tests are the proof that the apps
  work, and a machine that installed the project runs all of them;
- anywhere else, a skip decided while the tests run: ``pytest.importorskip`` of a module the
  project installs, or ``pytest.skip()`` in a test or fixture that probed the machine (not root,
  mounting not allowed).

What does not count (deliberate): a skip given by the test's own ``skip``/``skipif`` mark outside
``tests/integration``, whose reason is written beside the test and is not about the installation
(``tests/unit/test_gpu_check.py``: "a CUDA machine runs the checks instead"); tests deselected by
``-m`` (``gpu``, ``slow``, ``slurm``), which are not skips at all; expected failures (xfail).

On a machine that cannot run everything (no vLLM, not root) set ``FORGE_ALLOW_SKIPS=1``: the skips
are then listed and the run passes (also when every test it chose was skipped).
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator

import pytest

ALLOW_ENV = "FORGE_ALLOW_SKIPS"


def _reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The skip's reason, import failures said as "<module> import failed: <error>"."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    text = text.removeprefix("Skipped: ")
    found = re.match(r"could not import '([^']+)': (.*)", text, re.S)
    return f"{found[1]} import failed: {found[2]}" if found else text


def _in_integration(item: pytest.Item) -> bool:
    return item.path.resolve().is_relative_to(item.config.rootpath / "tests" / "integration")


def _marked_reasons(item: pytest.Item) -> set[str]:
    """The reasons the test's own skip/skipif marks give (a skip with one of them is declared)."""
    reasons = set()
    for mark in [*item.iter_markers("skip"), *item.iter_markers("skipif")]:
        reason = mark.kwargs.get("reason")
        if reason is None and mark.name == "skip" and mark.args:
            reason = mark.args[0]
        if reason is not None:
            reasons.add(str(reason))
    return reasons


def _allow_all() -> bool:
    return os.environ.get(ALLOW_ENV, "") not in ("", "0")


class SkipPolicy:
    """Skips seen in this run: those the run allows and those it refuses, each as (what, why)."""

    def __init__(self) -> None:
        self.allowed: list[tuple[str, str]] = []
        self.refused: list[tuple[str, str]] = []

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """A module skipped at collection (``importorskip`` at its top) is never deliberate."""
        if report.skipped:
            self.refused.append((report.nodeid, _reason(report)))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
        report = yield
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = _reason(report)
            declared = not _in_integration(item) and reason in _marked_reasons(item)
            (self.allowed if declared else self.refused).append((item.nodeid, reason))
        return report

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """A passing run with refused skips fails (unless skips are allowed); with skips allowed, a
        run whose every chosen test was skipped passes."""
        if not self.refused:
            return
        if not _allow_all() and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        elif _allow_all() and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
            session.exitstatus = pytest.ExitCode.OK

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> Generator[None]:
        """The skip count, always; the skips that fail the run, each with its reason (after pytest's
        own summary, so that they are the last lines before the totals)."""
        yield
        tr = terminalreporter
        count = len(self.allowed) + len(self.refused)
        tr.write_line(f"[forge] skipped: {count} ({len(self.allowed)} deliberate, by the test's skip mark)")
        if not self.refused:
            return
        if _allow_all():
            tr.write_line(f"[forge] {len(self.refused)} skipped that a full machine runs, allowed by {ALLOW_ENV}:")
        else:
            tr.write_line(
                f"[forge] FAILED: {len(self.refused)} skipped that a machine which installed the project must run "
                f"(where vLLM or root is missing on purpose, set {ALLOW_ENV}=1):",
                red=True,
                bold=True,
            )
        for what, reason in self.refused:
            tr.write_line(f"  {what}: {reason}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipPolicy(), "forge-skip-policy")
