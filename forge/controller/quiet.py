"""Keep Monarch's own noise out of a user's terminal.

Monarch's Rust core prints ``Monarch internal logs are being written to ...`` on stderr the
first time a mesh starts, with no switch to turn it off. ``quiet_monarch()`` routes the
process's stderr (fd 2, which child processes inherit too) through a filter thread that drops
such lines and passes everything else through unchanged. Entry points (the GRPO app, demos,
benchmarks) call it first thing; tests need not, as pytest captures fd 2.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading

NOISE = re.compile(rb"Monarch internal logs are being written to|^\s*$")
_installed = False


def quiet_monarch(pattern: re.Pattern[bytes] = NOISE) -> None:
    """Filter lines matching ``pattern`` out of this process's (and its children's) stderr."""
    global _installed
    if _installed:
        return
    _installed = True
    sys.stderr.flush()
    original = os.dup(2)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)

    def pump() -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            pending = b""
            while chunk := pipe.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                out = b"".join(line + b"\n" for line in lines if not pattern.search(line))
                if out:
                    os.write(original, out)
            if pending and not pattern.search(pending):
                os.write(original, pending)

    thread = threading.Thread(target=pump, name="forge-stderr-filter", daemon=True)
    thread.start()

    def restore() -> None:
        sys.stderr.flush()
        os.dup2(original, 2)  # closes the pipe's last writer in this process
        thread.join(timeout=1.0)

    atexit.register(restore)
