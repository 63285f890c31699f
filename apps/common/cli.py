"""An app's command line: ``python -m apps.<name>.main --config FILE [--resume] [key=value ...]``.

Every app parses, checks its config and exits the same way, so that a script (or a scheduler)
can tell what happened from the exit code alone: 0 done, 1 failed (the message names the role
or the file), 2 a bad config or command line (nothing was started), 130 interrupted (Ctrl-C),
143 terminated (SIGTERM). On 1, 130 and 143 every role was stopped first.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

Run = Callable[[Any, Any, Any], Awaitable[str]]
"""``run(cfg, terminal, resume_from)``: ``resume_from`` is ``resume_point``'s answer."""


class Terminated(Exception):
    """SIGTERM arrived; the run was stopped cleanly."""


def parse_args(prog: str, description: str, argv: list[str] | None, resume: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/grpo_tiny.yaml")
    if resume:
        parser.add_argument(
            "--resume",
            action="store_true",
            help="continue the run in logging.output_dir from its newest checkpoint (<output_dir>/checkpoints, "
            "written every trainer.checkpoint_every steps): same step numbers, metrics.jsonl appended",
        )
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.lr=3e-4")
    return parser.parse_intermixed_args(argv)


def record_config(cfg: Any, terminal: Any, app: str) -> Path:
    """Write the resolved config to ``<output_dir>/config.yaml`` and print what differs from the
    defaults, so that a run's record says exactly what it ran with."""
    import yaml

    from forge.config import config_changes, config_to_yaml

    out = Path(cfg.logging.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(config_to_yaml(cfg))
    changes = yaml.safe_dump(config_changes(cfg), sort_keys=False, default_flow_style=None).rstrip()
    changes = changes.replace("\n", "\n  ")
    print(f"{app}: config (full: {path}); changed from the defaults:\n  {changes}", file=terminal)
    return path


def checkpoint_to_resume(checkpoint_dir: str | Path, resume: bool) -> Path | None:
    """The newest complete checkpoint under ``checkpoint_dir`` when ``resume``; None for a fresh run.

    ``--resume`` without a checkpoint is an error naming the folder searched. So is a fresh run
    in an ``output_dir`` that holds checkpoints: it would truncate that run's metrics and a
    later ``--resume`` could pick up the earlier run's newer checkpoints.
    """
    from forge.checkpoint import latest_checkpoint

    root = Path(checkpoint_dir)
    found = latest_checkpoint(root)
    if resume and found is None:
        raise FileNotFoundError(
            f"--resume found no complete checkpoint under {root}; a run writes them there "
            "when trainer.checkpoint_every > 0"
        )
    if not resume and found is not None:
        raise FileExistsError(
            f"{root} holds checkpoints of an earlier run (newest {found.name}); add --resume to "
            "continue it, or set another logging.output_dir"
        )
    return found


def resume_point(cfg: Any, resume: bool) -> Any:
    """What the run continues from: ``checkpoint_to_resume`` of its ``checkpoint_dir``, or what
    a config of several runs says for each (its ``resume_points``)."""
    if hasattr(cfg, "resume_points"):
        return cfg.resume_points(resume)
    return checkpoint_to_resume(cfg.checkpoint_dir, resume)


async def _run_until_signalled(run: Run, cfg: Any, terminal: Any, resume_from: Path | None) -> str:
    """``run``, with SIGTERM handled like Ctrl-C: cancel, stop every role, then exit."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    terminated = False

    def on_sigterm() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await run(cfg, terminal, resume_from)
    except asyncio.CancelledError:
        if terminated:
            raise Terminated() from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def entry(
    app: str,
    schema: str,
    run: Run,
    doc: str | None,
    *,
    resumable: bool = True,
    failures: tuple[type[BaseException], ...] = (),
) -> Callable[[list[str] | None], int]:
    """An app's ``main(argv=None) -> exit code``: ``main`` with the app's settings, so that each
    app's module says only what is its own (its name, config class, run, failures). ``doc``: the
    app module's docstring, whose first paragraph is ``--help``'s description."""
    description = " ".join((doc or app).split("\n\n")[0].split())

    def app_main(argv: list[str] | None = None) -> int:
        return main(app, schema, run, argv, description=description, resumable=resumable, failures=failures)

    app_main.__doc__ = f"``python -m apps.{app}.main``: returns the process exit code (``apps.common.cli``)."
    return app_main


def main(
    app: str,
    schema: str,
    run: Run,
    argv: list[str] | None,
    *,
    description: str,
    resumable: bool = True,
    failures: tuple[type[BaseException], ...] = (),
) -> int:
    """Parse ``argv``, load the config (``schema`` names its class as ``module:Class``, imported
    late so that Monarch is configured first), run ``run(cfg, terminal, resume_from)`` and return the exit
    code; ``failures`` are the exception types that mean "the run failed" (besides forge's own).
    ``resume_from`` is ``resume_point(cfg, --resume)``; None when the app is not ``resumable``."""
    from forge.controller import ForgeError, quiet_monarch

    quiet_monarch()
    import monarch.config

    # Role processes linger after their actors stop (library threads); give them 1 s, not 10.
    monarch.config.configure(process_exit_timeout="1s")
    terminal = os.fdopen(os.dup(2), "w", buffering=1)  # the progress bar bypasses the log filter
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(f"python -m apps.{app}.main", description, argv, resume=resumable)
    from forge.config import ConfigError, load_config
    from forge.plugins import import_object

    try:
        cfg = load_config(import_object(schema, f"the {app} app's config"), args.config, args.overrides)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"{app}: bad config: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        resume_from = resume_point(cfg, args.resume) if resumable else None
    except (FileNotFoundError, FileExistsError) as exc:
        print(f"{app}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        summary = asyncio.run(_run_until_signalled(run, cfg, terminal, resume_from))
    except KeyboardInterrupt:
        print(f"{app}: interrupted; every role was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print(f"{app}: terminated (SIGTERM); every role was stopped", file=sys.stderr)
        return EXIT_TERMINATED
    except (*failures, ForgeError, RuntimeError, OSError, ValueError) as exc:  # OSError: a full disk, a missing file
        print(f"{app}: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(summary, flush=True)
    return 0
