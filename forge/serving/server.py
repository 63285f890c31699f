"""Running the front door's app on a socket, in the caller's event loop.

``start_server`` starts uvicorn on ``host:port`` (0: a free port), waits until it listens and
returns it running (``RunningServer``: its port, its base URL, ``stop()``). With
``own_signals=False`` uvicorn leaves SIGINT and SIGTERM to the process that embeds it (the GRPO
controller, whose Ctrl-C stops every role); ``apps.serve`` lets uvicorn take them, and a signal
then ends the server's task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["RunningServer", "start_server"]


@dataclass
class RunningServer:
    server: Any
    """The ``uvicorn.Server``."""
    task: asyncio.Task
    """Serving; done when the server stopped (a signal, ``stop()``, or its failure)."""
    host: str
    port: int

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop taking connections and end the server's task; never raises."""
        self.server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self.task, timeout_s)


async def start_server(app: Any, host: str = "127.0.0.1", port: int = 0, *, own_signals: bool) -> RunningServer:
    """``app`` served on ``host:port`` once it listens; the bind's error if it cannot."""
    import uvicorn

    class Server(uvicorn.Server):
        def capture_signals(self) -> Iterator[None]:
            return super().capture_signals() if own_signals else contextlib.nullcontext()

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(), name=f"http-server-{host}:{port}")
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if task.done():
        task.result()  # the bind failed: its error
        raise RuntimeError(f"the server did not start on {host}:{port}")
    bound = server.servers[0].sockets[0].getsockname()[1]
    return RunningServer(server, task, host, bound)
