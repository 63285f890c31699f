"""Test-session setup shared by every test.

forge.controller is imported first so that Monarch reads forge's settings (1 s failure
detection, quiet log file) and forge's fault hook replaces Monarch's exit-on-fault hook.
``tests/skip_policy.py`` fails a run whose skips hid tests (a broken vLLM, not root);
``FORGE_ALLOW_SKIPS=1`` allows them on a machine without.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import forge.controller  # noqa: E402,F401  (before anything imports monarch)
from forge.controller.provisioner import install_fault_hook  # noqa: E402

install_fault_hook()

# A suite started in the background of a script (``bash scripts/test.sh &``) inherits SIGINT ignored, and so would
# every app it starts: the Ctrl-C test's app would then run to its end and exit 0. Ctrl-C reaches a foreground
# process whose SIGINT is not ignored; the apps the tests start get that disposition back.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Skips are not passes: a skip that hides a test the machine should run fails the run (tests/skip_policy.py).
pytest_plugins = ["tests.skip_policy"]


import time  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """After the whole session, no child process of the test run may still be alive."""
    yield
    deadline = time.monotonic() + 15
    while True:
        left = [c for c in psutil.Process().children(recursive=True) if _alive(c)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"processes left behind by the tests: {[(c.pid, _cmd(c)) for c in left]}"


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmd(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:120]
    except psutil.Error:
        return "?"
