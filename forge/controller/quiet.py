"""Keep Monarch's own noise out of a user's terminal.

Monarch's Rust core prints ``Monarch internal logs are being written to ...`` on stderr when its
host agent process starts (the first ``this_host()`` of a process), with no switch to turn it
off. forge starts that agent through ``local_host()``, which hands the agent (and so every
process it spawns) a stderr that drops such lines and passes everything else through
unchanged; the caller's own stderr is left alone. A user's script or notebook thus shows no
banner without doing anything.

``quiet_monarch()`` filters the whole process's stderr (fd 2) instead, for entry points that
also want Monarch's noise out of their own output (the GRPO app, demos, benchmarks).

Both also turn off, in the controller, Monarch's ``[actor=<root>]`` prefix on Python log
records (see ``plain_controller_logs``).
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
from typing import Any

NOISE = re.compile(rb"Monarch internal logs are being written to|^\s*$")
_installed = False
_host_started = False
_host_lock = threading.Lock()


def _filter_into(
    target_fd: int, pattern: re.Pattern[bytes], close_target: bool = False
) -> tuple[int, threading.Thread]:
    """A pipe whose lines, less those matching ``pattern``, a thread copies to ``target_fd``.
    Returns the pipe's write end and the thread (it ends when every writer has closed)."""
    read_fd, write_fd = os.pipe()

    def pump() -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            pending = b""
            while chunk := pipe.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                out = b"".join(line + b"\n" for line in lines if not pattern.search(line))
                if out:
                    os.write(target_fd, out)
            if pending and not pattern.search(pending):
                os.write(target_fd, pending)
        if close_target:
            os.close(target_fd)

    thread = threading.Thread(target=pump, name="forge-stderr-filter", daemon=True)
    thread.start()
    return write_fd, thread


def quiet_monarch(pattern: re.Pattern[bytes] = NOISE) -> None:
    """Filter lines matching ``pattern`` out of this process's (and its children's) stderr."""
    global _installed
    if _installed:
        return
    _installed = True
    sys.stderr.flush()
    original = os.dup(2)
    write_fd, thread = _filter_into(original, pattern)
    os.dup2(write_fd, 2)
    os.close(write_fd)

    def restore() -> None:
        sys.stderr.flush()
        os.dup2(original, 2)  # closes the pipe's last writer in this process
        thread.join(timeout=1.0)

    atexit.register(restore)


def plain_controller_logs() -> None:
    """Stop Monarch prefixing this process's log records with ``[actor=<root>]``.

    Once a process has a Monarch context, Monarch adds a filter to every logging handler that
    rewrites ``record.msg`` in place, so a record that reaches three handlers reads
    ``[actor=<root>] [actor=<root>] [actor=<root>] ...``. In the controller the prefix names no
    actor; actor processes keep theirs (this setting is per process). The setting lives in a
    private Monarch module: if it moves, the prefix simply stays.
    """
    try:
        from monarch._src.actor import config as actor_config
    except ImportError:
        return
    actor_config.prefix_python_logs_with_actor = False


def local_host() -> Any:
    """``monarch.actor.this_host()``; the call that starts Monarch's host agent gives it a
    filtered stderr (see the module docstring). Later calls return the same host."""
    global _host_started
    from monarch.actor import this_host

    plain_controller_logs()
    with _host_lock:
        if _installed or _host_started:  # the whole process is filtered, or the agent runs
            return this_host()
        _host_started = True
        sys.stderr.flush()
        saved = os.dup(2)
        write_fd, _ = _filter_into(os.dup(2), NOISE, close_target=True)
        os.dup2(write_fd, 2)  # only while the agent starts: it inherits this fd 2
        os.close(write_fd)
        try:
            return this_host()
        finally:
            os.dup2(saved, 2)  # the caller's own stderr, as it was
            os.close(saved)
