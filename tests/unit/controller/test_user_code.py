"""Actors defined where users write code work as replicas, and nothing is left behind.

Each test runs a user's script in a fresh interpreter from another working directory, with no
PYTHONPATH set, as a user would.
"""

import os
import subprocess
import sys
import textwrap

HELPER_MODULE = """
from forge.controller import ForgeActor, endpoint, Batching

class Doubler(ForgeActor):
    @endpoint(batch=Batching(max_size=4, max_wait_s=0.01))
    async def double(self, xs: list[int]) -> list[int]:
        return [2 * x for x in xs]
"""

USER_SCRIPT = """
import asyncio, os
import psutil
import forge.controller
forge.controller.quiet_monarch()
from forge.controller import ForgeActor, endpoint
from helper_actors import Doubler          # a module beside the script: pickled by reference

class Local(ForgeActor):                    # defined in __main__: pickled by value
    @endpoint
    async def pid(self) -> int:
        return os.getpid()

async def main():
    a = await Local.options(num_replicas=2).as_service()
    b = await Doubler.as_service()
    pids = await a.pid.fanout()
    print("RESULT", await b.double.route_many([1, 2, 3]), len(set(pids)))
    await a.shutdown()
    await b.shutdown()
    for _ in range(50):
        left = [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
        if not left:
            break
        await asyncio.sleep(0.1)
    print("LEFT", len(left), "ALIVE", sum(psutil.pid_exists(p) for p in pids))

if __name__ == "__main__":
    asyncio.run(main())
"""


PLAIN_SCRIPT = """
import asyncio, sys
import forge.controller                     # no quiet_monarch(): a user's plain script
from forge.controller import ForgeActor, endpoint

class Talker(ForgeActor):
    @endpoint
    async def say(self) -> None:
        print("ACTOR LINE", file=sys.stderr, flush=True)

async def main():
    svc = await Talker.as_service()
    await svc.say.route()
    await svc.shutdown()
    print("USER LINE", file=sys.stderr, flush=True)

if __name__ == "__main__":
    asyncio.run(main())
"""


def run_user_script(tmp_path, script: str = USER_SCRIPT):
    project = tmp_path / "user_project"
    project.mkdir()
    (project / "helper_actors.py").write_text(textwrap.dedent(HELPER_MODULE))
    (project / "user_script.py").write_text(textwrap.dedent(script))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, str(project / "user_script.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_user_script_actors_work_without_pythonpath_and_leave_no_process(tmp_path):
    proc = run_user_script(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT [2, 4, 6] 2" in proc.stdout
    assert "LEFT 0 ALIVE 0" in proc.stdout
    assert "Monarch internal logs" not in proc.stderr  # Monarch's noise is filtered out


def test_plain_user_script_shows_its_output_but_not_monarchs_banner(tmp_path):
    """Without quiet_monarch(), a script's stderr keeps its own and its actors' lines, and
    Monarch's "internal logs are being written to" banner is gone."""
    proc = run_user_script(tmp_path, PLAIN_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ACTOR LINE" in proc.stderr and "USER LINE" in proc.stderr, proc.stderr[-3000:]
    assert "Monarch internal logs" not in proc.stderr
