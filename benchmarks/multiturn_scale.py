"""The controller's cost per turn: the GRPO app's own multi-turn rollout path, 10 turns a trajectory.

    python benchmarks/multiturn_scale.py [--out multiturn_scale.json]
    python benchmarks/multiturn_scale.py --trajectories 256 --replicas 2 --steps 2   # one small cell

An agentic step is ``prompts x group_size`` trajectories of many turns, and every turn is two
requests from the controller: the policy's ``generate_turn`` and the environment's ``step``. This
runs ``apps.grpo.multiturn.MultiTurnGroups`` (session keys, the policy's ``SessionAffinity`` and
the env's ``EnvSessionRouter``, the reference per group, ``EpisodeBatch.pack``, the buffer) with
the real buffer and dataset in this process, against stand-in roles that answer at once:

- the policy is ``rollout_scale``'s ``StandInPolicy`` (the real ``Policy`` and its
  ``generate_turn`` batching over an engine that returns ``--turn-tokens`` fixed tokens);
- the environment is the real ``EnvActor`` hosting ``TenTurns``: token-id observations, an
  episode of exactly ``--turns`` turns, a final reward that spreads each group;
- the reference and reward are ``rollout_scale``'s stand-ins.

Reported per cell: the controller's CPU time per turn (``time.process_time``: every thread of
this process, Monarch's runtime included, and the buffer and dataset actors in it) and turns per
second. Key: ``controller_us_per_turn`` (goal <= 30) at the largest cell, and ``cells``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))  # rollout_scale's stand-ins and TenTurns import by these names

import forge.controller  # noqa: E402,F401  (before monarch)
from apps.common.roles import QUIET_ENV  # noqa: E402
from apps.grpo.groups import GroupSettings  # noqa: E402
from apps.grpo.multiturn import MultiTurnGroups  # noqa: E402
from apps.grpo.rollout_workers import start_rollout_workers, stop_rollout_workers  # noqa: E402
from apps.grpo.rollouts import Rollouts  # noqa: E402
from forge.envs import EnvActor, EnvConfig, EnvSessionRouter, SessionAffinity  # noqa: E402
from forge.envs.base import Action, Environment, StepResult  # noqa: E402
from forge.types import Prompt  # noqa: E402

GROUP_SIZE = 16
OBSERVATION_TOKENS = 4
_episodes = itertools.count()


class TenTurns(Environment):
    """An episode of exactly ``turns`` turns that answers at once: token-id observations, and a
    final reward of ``episode % 4`` so that no group is uniform."""

    def __init__(self, turns: int = 10) -> None:
        self.turns = turns
        self.reward = float(next(_episodes) % 4)

    async def reset(self, prompt: Prompt) -> list[int]:
        del prompt
        return list(range(16))

    async def step(self, action: Action) -> StepResult:
        done = action.turn + 1 >= self.turns
        return StepResult(list(range(OBSERVATION_TOKENS)), self.reward if done else 0.0, done=done)


async def start_roles(replicas: int, turns: int, turn_tokens: int) -> Any:
    """The stand-in policy, reference and reward (``rollout_scale``), and the env service, routed as
    ``apps.grpo.roles.role_specs`` routes the real ones."""
    import rollout_scale

    roles = await rollout_scale.start_stand_ins(replicas, group_size=1, response_tokens=turn_tokens)
    await roles.policy.shutdown()  # again, with the multi-turn router on generate_turn
    policy = rollout_scale.PolicyConfig(model_path="stand-in", group_size=1, max_tokens=turn_tokens)
    routers = {"generate": "key_affinity", "generate_turn": SessionAffinity}
    common = {"procs": 1, "num_replicas": replicas, "env": QUIET_ENV}
    roles.policy = await rollout_scale.StandInPolicy.options(
        name="policy", endpoint_routers=routers, **common
    ).as_service(policy)
    env = EnvConfig(f"{__name__}:TenTurns", {"turns": turns})
    roles.env = await EnvActor.options(name="env", router=EnvSessionRouter, **common).as_service(env)
    return roles


def limits(turns: int, turn_tokens: int) -> dict[str, int]:
    """``MultiTurnGroups``' limits for episodes of ``turns`` turns of ``turn_tokens`` tokens."""
    max_model_len = 16 + turns * (turn_tokens + OBSERVATION_TOKENS) + turn_tokens
    return {"max_turns": turns, "max_tokens": turn_tokens, "max_model_len": max_model_len}


async def run_cell(
    roles: Any, trajectories: int, steps: int, turns: int, turn_tokens: int, workers: int = 0
) -> dict[str, Any]:
    """``steps`` measured steps (after a warm-up step) of ``trajectories`` trajectories each; with
    ``workers`` (``roles.rollout`` started), the trajectories are played by the rollout workers."""
    import rollout_scale

    prompts = trajectories // GROUP_SIZE
    cell = f"mt{trajectories}x{len(roles.policy.service.replicas)}w{workers}"
    await rollout_scale.start_local(roles, prompts, cell)
    maker = None if workers else MultiTurnGroups(roles, GROUP_SIZE, **limits(turns, turn_tokens))
    rollouts = Rollouts(roles, maker, prompts, prompts, workers=roles.rollout if workers else None)
    tasks = rollouts.start()
    try:
        stored, cpu, wall, main = await rollout_scale.timed_steps(roles, rollouts, tasks, prompts, steps)
        played = stored * GROUP_SIZE * turns
        failed = maker.failed_trajectories if maker is not None else 0  # the workers log their own
        if rollouts.counts.lost or failed:
            raise AssertionError(f"cell {cell}: {rollouts.group_counts()}, {failed} failed")
    finally:
        await rollout_scale.stop_cell(roles, rollouts, tasks)
    return {
        "trajectories_per_step": trajectories,
        "turns_per_trajectory": turns,
        "replicas": len(roles.policy.service.replicas),
        "workers": workers,
        "steps": steps,
        "controller_us_per_turn": cpu / max(played, 1) * 1e6,
        "turns_per_s": steps * trajectories * turns / wall,
        "controller_cpu_s": cpu,
        "wall_s": wall,
        "controller_main_thread_share": main / cpu if cpu else 0.0,
        "turns_played": played,
    }


async def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    cells = []
    for n in args.replicas:
        roles = await start_roles(n, args.turns, args.turn_tokens)
        try:
            for w in args.workers:
                views = None
                if w:
                    settings = GroupSettings(GROUP_SIZE, multiturn=limits(args.turns, args.turn_tokens))
                    roles.rollout, views = await start_rollout_workers(roles, w, settings)
                try:
                    for t in args.trajectories:
                        cells.append(await run_cell(roles, t, args.steps, args.turns, args.turn_tokens, w))
                        print_row(cells[-1])
                finally:
                    await stop_rollout_workers(roles, views)
        finally:
            await roles.stop(timeout_s=60)
    return cells


def print_row(c: dict[str, Any]) -> None:
    print(
        f"{c['trajectories_per_step']:>12d} {c['replicas']:>8d} {c['workers']:>7d} "
        f"{c['controller_us_per_turn']:>12.1f} {c['turns_per_s']:>10.0f} {c['controller_main_thread_share']:>9.2f}",
        flush=True,
    )


def summary(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """``controller_us_per_turn`` at the largest cell of the most workers swept; the same per
    worker count under ``by_workers``; then the table."""

    def largest(of: list[dict[str, Any]]) -> dict[str, Any]:
        return max(of, key=lambda c: (c["trajectories_per_step"], c["replicas"]))

    counts = sorted({c["workers"] for c in cells})
    by_workers = {str(w): largest([c for c in cells if c["workers"] == w])["controller_us_per_turn"] for w in counts}
    return {
        "controller_us_per_turn": by_workers[str(counts[-1])],
        "workers": counts[-1],
        "by_workers": by_workers,
        "cells": cells,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, nargs="+", default=[256, 1024], help="trajectories a step")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2], help="replicas of each stand-in role")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[0, 2], help="rollout workers (0: the controller plays them)"
    )
    parser.add_argument("--turns", type=int, default=10, help="turns of every trajectory")
    parser.add_argument("--turn-tokens", type=int, default=8, help="tokens the policy samples a turn")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per cell (after one warm-up step)")
    parser.add_argument("--out", help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    if any(t % GROUP_SIZE or t < GROUP_SIZE for t in args.trajectories):
        parser.error(f"--trajectories must be multiples of the group size {GROUP_SIZE}, got {args.trajectories}")
    if any(w < 0 for w in args.workers):
        parser.error(f"--workers must be 0 (none) or more, got {args.workers}")
    if args.turns < 1 or args.turn_tokens < 1:
        parser.error(f"--turns and --turn-tokens must be >= 1, got {args.turns} and {args.turn_tokens}")
    header = f"{'traj/step':>12s} {'replicas':>8s} {'workers':>7s} {'ctrl us/turn':>12s} {'turns/s':>10s}"
    print(f"{header} {'main thr':>9s}")
    results = summary(asyncio.run(sweep(args)))
    ok = results["controller_us_per_turn"] <= 30
    print(f"controller_us_per_turn {results['controller_us_per_turn']:.1f}  goal <= 30  {'met' if ok else 'MISSED'}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    forge.controller.quiet_monarch()
    import multiturn_scale  # TenTurns must be importable under this name in the env replicas

    multiturn_scale.main()
