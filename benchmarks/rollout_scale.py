"""The controller's cost per sequence: the GRPO app's own rollout path at 512 to 16k sequences a step.

    python benchmarks/rollout_scale.py [--out rollout_scale.json]
    python benchmarks/rollout_scale.py --sequences 512 4096 --replicas 2 --steps 3   # fewer cells
    python benchmarks/rollout_scale.py --sequences 4096 --replicas 2 --profile controller.prof

forge is single-controller: one Python process drives every rollout. This runs the app's own
path, ``apps.grpo.rollouts.Rollouts`` over ``apps.grpo.groups.SingleTurnGroups`` (policy
``generate.route`` per prompt, reward ``score`` and reference ``logprobs`` per completion,
``EpisodeBatch.pack``, the buffer writer's ``add_many``, ``take_batch``) with the real
``ReplayBuffer`` and ``Dataset`` in the controller's process, as ``apps.grpo.roles.start_local``
puts them, against stand-in roles whose work takes no time, so what is left is the controller's
own cost:

- the policy is ``Policy`` with an engine that returns ``group_size`` fixed-length completions
  at once (the real ``generate`` endpoint, batching and ``PackedGroups`` debatch);
- the reference is ``ReferenceModel`` with no model: zero logprobs of the responses' lengths
  (the real ``logprobs`` endpoint, its length buckets, token budget, enbatch and debatch);
- the reward is the real ``RewardActor`` with a reward function that spreads each group's
  rewards (``spread_reward``), so advantages are not all zero.

Each is a service of ``--replicas`` one-process replicas with the app's routers. Per cell
(sequences a step x replicas), one warm-up step, then ``--steps`` steps, each
``take_batch(prompts_per_step)`` and the training loop's controller-side books (concat, the
rollouts' step metrics, draining every process's metrics) with no trainer call.

Reported per cell: the controller's CPU time per sequence (``time.process_time`` deltas: every
thread of this process, Monarch's Rust runtime included, and the buffer and dataset actors,
which run in it; not the replicas' processes) and sequences per second end to end. Keys:
``controller_us_per_sequence_16k`` (goal <= 50), ``controller_cost_growth_16k_vs_512`` (goal
<= 1.3), ``sequences_per_s_16k`` (goal >= 20,000), and ``cells``, the whole table.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))  # this checkout's forge and apps, whatever the venv installed

import forge.controller  # noqa: E402,F401  (before monarch)
from apps.common.launch import Roles  # noqa: E402
from apps.common.roles import QUIET_ENV  # noqa: E402
from apps.grpo.groups import GroupSettings, SingleTurnGroups  # noqa: E402
from apps.grpo.rollout_workers import start_rollout_workers, stop_rollout_workers  # noqa: E402
from apps.grpo.rollouts import Rollouts  # noqa: E402
from forge.actors import (  # noqa: E402
    Dataset,
    DatasetConfig,
    Policy,
    PolicyConfig,
    ReferenceConfig,
    ReferenceModel,
    ReplayBuffer,
    RewardActor,
)
from forge.controller import endpoint  # noqa: E402
from forge.distributed import init_spmd  # noqa: E402
from forge.observability import drain_local_metrics  # noqa: E402
from forge.observability.metrics import MetricAggregator  # noqa: E402
from forge.types import Completion, EpisodeBatch, Prompt  # noqa: E402

GROUP_SIZE = 16
PROMPT_TOKENS = 16
RESPONSE_TOKENS = 32
STEP_TIMEOUT_S = 120.0
"""Longest one step may take before the cell fails (a stalled role, not a slow machine)."""
SPREAD = 4
"""Distinct rewards within a group (``spread_reward``)."""


# ----------------------------------------------------------------------------- stand-in roles
def spread_reward(prompt: Prompt, text: str) -> float:
    """A reward that spreads each group: the stand-in policy's completion ``j`` says ``j``, and
    scores ``j % SPREAD``, so every group has nonzero advantages (no group is uniform)."""
    del prompt
    return float(int(text) % SPREAD)


class InstantEngine:
    """What ``Policy`` needs of an engine (``generate``, ``version``), answering at once:
    ``n`` completions of ``response_tokens`` tokens per input, the ``j``-th saying ``j``."""

    version = 0

    def __init__(self, response_tokens: int) -> None:
        self.prompt_ids = torch.arange(PROMPT_TOKENS, dtype=torch.long)
        self.token_ids = torch.arange(response_tokens, dtype=torch.long)
        self.logprobs = torch.full((response_tokens,), -1.0)

    def generate(self, inputs: list[Any], n: int, **sampling: Any) -> list[list[Completion]]:
        del sampling
        return [
            [Completion(self.prompt_ids, self.token_ids, self.logprobs, str(j), self.version) for j in range(n)]
            for _ in inputs
        ]

    def shutdown(self) -> None:
        """Nothing to release (``Policy.__cleanup__`` calls it)."""


class StandInPolicy(Policy):
    """The real ``Policy`` (its ``generate`` endpoint, batching and packing) over ``InstantEngine``:
    ``config.group_size`` completions of ``config.max_tokens`` tokens per prompt."""

    @endpoint
    async def setup(self) -> None:
        self.engine = InstantEngine(self.config.max_tokens)


class StandInReference(ReferenceModel):
    """The real ``ReferenceModel`` (its ``logprobs`` endpoint, length buckets and packing) with no
    model: every response's logprobs are zeros of its length."""

    @endpoint
    async def setup(self) -> None:
        self.rank = await init_spmd(timeout_s=self.config.dist_timeout_s)

    def _score(self, prompts: list[torch.Tensor], responses: list[torch.Tensor]) -> list[torch.Tensor]:
        del prompts
        return [torch.zeros(r.numel()) for r in responses]


async def start_stand_ins(
    replicas: int,
    group_size: int = GROUP_SIZE,
    response_tokens: int = RESPONSE_TOKENS,
    reward_cls: type[RewardActor] = RewardActor,
    policy_cls: type[Policy] | None = None,
) -> Roles:
    """The stand-in policy, reference and reward services, routed as ``apps.grpo.roles.role_specs``
    routes the real ones; ``group_size``: completions the policy returns per prompt. The replicas
    import this module by name (forge passes them this process's ``sys.path``)."""
    policy = PolicyConfig(model_path="stand-in", group_size=group_size, max_tokens=response_tokens)
    common = {"procs": 1, "num_replicas": replicas, "env": QUIET_ENV}
    starts = await asyncio.gather(
        (policy_cls or StandInPolicy)
        .options(name="policy", endpoint_routers={"generate": "key_affinity"}, **common)
        .as_service(policy),
        StandInReference.options(name="reference", router="least_loaded", **common).as_service(
            ReferenceConfig(model_path="stand-in")
        ),
        reward_cls.options(name="reward", router="least_loaded", **common).as_service(
            {f"{__name__}:spread_reward": 1.0}
        ),
        return_exceptions=True,
    )
    started = [s for s in starts if not isinstance(s, BaseException)]
    failed = [s for s in starts if isinstance(s, BaseException)]
    if failed:
        await asyncio.gather(*(s.shutdown() for s in started), return_exceptions=True)
        raise failed[0]
    return Roles(policy=starts[0], reference=starts[1], reward=starts[2])


async def start_local(roles: Roles, prompts_per_step: int, cell: str) -> None:
    """The real buffer and dataset in this process, sized as ``apps.grpo.roles.start_local``
    sizes them for ``max_policy_age`` 1."""
    from monarch.actor import this_proc

    roles.buffer = this_proc().spawn(f"buffer-{cell}", ReplayBuffer, 1, 4 * prompts_per_step)
    roles.dataset = this_proc().spawn(f"dataset-{cell}", Dataset, DatasetConfig(source="toy", seed=0))
    roles.local = [roles.buffer, roles.dataset]
    await asyncio.wait_for(asyncio.gather(roles.buffer.setup.call_one(), roles.dataset.setup.call_one()), 60)


# ----------------------------------------------------------------------------- one cell
async def take_step(rollouts: Rollouts, workers: list[asyncio.Task], prompts: int) -> list[EpisodeBatch]:
    """One step's groups; a worker that failed (e.g. a role's wrong count) fails the step with
    its own error, and a step that stalls fails after ``STEP_TIMEOUT_S``."""
    take = asyncio.ensure_future(rollouts.take_batch(prompts, 0))
    done, _ = await asyncio.wait([take, *workers], timeout=STEP_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
    if take in done:
        return take.result()
    take.cancel()
    await asyncio.gather(take, return_exceptions=True)
    for task in done:
        task.result()  # raises the worker's error
    raise TimeoutError(f"no step of {prompts} groups within {STEP_TIMEOUT_S:.0f}s")


async def step_books(roles: Roles, rollouts: Rollouts, groups: list[EpisodeBatch], metrics: MetricAggregator) -> None:
    """The training loop's controller-side work per step, less the trainer: the batch, the
    rollouts' step metrics, every process's metric records (as ``RunLog.step`` drains them)."""
    batch = EpisodeBatch.concat(groups)
    row = {"reward_mean": float(batch.rewards.mean()), **rollouts.end_step(groups), **rollouts.group_counts()}
    drained = await asyncio.wait_for(
        asyncio.gather(*(svc.drain_metrics.fanout() for svc in roles.services().values())), 30
    )
    for per_replica in drained:
        for records in per_replica:
            metrics.extend(records)
    metrics.extend(drain_local_metrics())
    row.update(metrics.flush(0))


async def timed_steps(
    roles: Roles,
    rollouts: Rollouts,
    workers: list[asyncio.Task],
    prompts: int,
    steps: int,
    profile: cProfile.Profile | None = None,
) -> tuple[int, float, float, float]:
    """One warm-up step, then ``steps`` measured ones: groups stored, controller CPU seconds (all
    threads), wall seconds and the event loop thread's CPU seconds, over the measured steps."""
    metrics = MetricAggregator()
    await step_books(roles, rollouts, await take_step(rollouts, workers, prompts), metrics)  # warm-up
    stored0, cpu0, wall0 = rollouts.counts.stored, time.process_time(), time.perf_counter()
    main0 = time.thread_time()  # the event loop's thread: Python; the rest is Monarch's runtime
    if profile is not None:
        profile.enable()
    for _ in range(steps):
        await step_books(roles, rollouts, await take_step(rollouts, workers, prompts), metrics)
    if profile is not None:
        profile.disable()
    cpu, wall, main = time.process_time() - cpu0, time.perf_counter() - wall0, time.thread_time() - main0
    return rollouts.counts.stored - stored0, cpu, wall, main


async def stop_cell(roles: Roles, rollouts: Rollouts, workers: list[asyncio.Task]) -> None:
    """Stop a cell's rollout workers, its rollouts and its buffer and dataset actors."""
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    await rollouts.close()
    await asyncio.wait_for(asyncio.gather(*(a.stop() for a in roles.local), return_exceptions=True), 30)
    roles.local = []


async def run_cell(
    roles: Roles, sequences: int, steps: int, profile: cProfile.Profile | None = None, workers: int = 0
) -> dict[str, Any]:
    """``steps`` measured steps (after one warm-up step) of ``sequences`` sequences each; with
    ``workers`` (``roles.rollout`` started), the groups are made by the rollout workers."""
    prompts = sequences // GROUP_SIZE
    cell = f"{sequences}x{len(roles.policy.service.replicas)}w{workers}"
    await start_local(roles, prompts, cell)
    # The app's defaults: rollout.concurrency = prompts_per_step, max_buffered = prompts_per_step.
    maker = None if workers else SingleTurnGroups(roles, GROUP_SIZE)
    rollouts = Rollouts(roles, maker, prompts, prompts, workers=roles.rollout if workers else None)
    tasks = rollouts.start()
    try:
        stored, cpu, wall, main = await timed_steps(roles, rollouts, tasks, prompts, steps, profile)
        produced = stored * GROUP_SIZE
        if rollouts.counts.lost:
            raise AssertionError(f"{rollouts.counts.lost} groups lost in cell {cell}: {rollouts.group_counts()}")
    finally:
        await stop_cell(roles, rollouts, tasks)
    trained = steps * sequences
    return {
        "sequences_per_step": sequences,
        "prompts_per_step": prompts,
        "replicas": len(roles.policy.service.replicas),
        "workers": workers,
        "steps": steps,
        # Per sequence produced (scored and stored) in the window: the work the CPU paid for.
        "controller_us_per_sequence": cpu / max(produced, 1) * 1e6,
        "sequences_per_s": trained / wall,
        "controller_cpu_s": cpu,
        "wall_s": wall,
        "controller_cpu_share": cpu / wall,
        # Of the controller's CPU, the share on the event loop's thread (Python: forge, asyncio,
        # pickling); the rest ran on Monarch's runtime threads (message transport) and the
        # buffer's and dataset's actors.
        "controller_main_thread_share": main / cpu if cpu else 0.0,
        "sequences_produced": produced,
        "sequences_trained": trained,
    }


# ----------------------------------------------------------------------------- sweep
async def sweep(
    sequences: list[int], replicas: list[int], workers: list[int], steps: int, profile: str | None
) -> list[dict[str, Any]]:
    cells = []
    for n in replicas:
        roles = await start_stand_ins(n)
        try:
            for w in workers:
                publisher = None
                if w:
                    roles.rollout, publisher = await start_rollout_workers(roles, w, GroupSettings(GROUP_SIZE))
                try:
                    for s in sequences:
                        prof = cProfile.Profile(time.thread_time) if profile else None  # CPU, not idle waits
                        cells.append(await run_cell(roles, s, steps, prof, w))
                        print_row(cells[-1])
                        if prof is not None:
                            single = len(sequences) * len(replicas) * len(workers) == 1
                            prof.dump_stats(profile if single else f"{profile}.{s}x{n}w{w}")
                finally:
                    await stop_rollout_workers(roles, publisher)
        finally:
            await roles.stop(timeout_s=60)
    return cells


def keys(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The three keys, at the largest replica count that has the sizes."""
    out: dict[str, Any] = {}
    at = {(c["sequences_per_step"], c["replicas"]): c for c in cells}
    for n in sorted({c["replicas"] for c in cells}, reverse=True):
        big, small = at.get((16384, n)), at.get((512, n))
        if big is not None:
            out.setdefault("controller_us_per_sequence_16k", big["controller_us_per_sequence"])
            out.setdefault("sequences_per_s_16k", big["sequences_per_s"])
            out.setdefault("replicas_16k", n)
        if big is not None and small is not None:
            growth = big["controller_us_per_sequence"] / small["controller_us_per_sequence"]
            out.setdefault("controller_cost_growth_16k_vs_512", growth)
    return out


def summary(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The keys with the most workers swept (``workers_16k``), the same keys for every worker
    count under ``by_workers`` (0: the controller makes the groups itself), then the table."""
    counts = sorted({c["workers"] for c in cells})
    by_workers = {w: keys([c for c in cells if c["workers"] == w]) for w in counts}
    out: dict[str, Any] = {**by_workers[counts[-1]], "workers_16k": counts[-1]}
    out["by_workers"] = {str(w): k for w, k in by_workers.items()}
    out["cells"] = cells
    return out


GOALS = {
    "controller_us_per_sequence_16k": ("<=", 50.0),
    "controller_cost_growth_16k_vs_512": ("<=", 1.3),
    "sequences_per_s_16k": (">=", 20000.0),
}


def print_row(c: dict[str, Any]) -> None:
    print(
        f"{c['sequences_per_step']:>9d} {c['replicas']:>8d} {c['workers']:>7d} "
        f"{c['controller_us_per_sequence']:>12.1f} {c['sequences_per_s']:>10.0f} "
        f"{c['controller_cpu_share']:>9.2f} {c['controller_main_thread_share']:>9.2f}",
        flush=True,
    )


def print_goals(results: dict[str, Any]) -> None:
    for key, (op, goal) in GOALS.items():
        if key in results:
            value = results[key]
            ok = value <= goal if op == "<=" else value >= goal
            print(f"{key:38s} {value:12.2f}  goal {op} {goal:g}  {'met' if ok else 'MISSED'}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, nargs="+", default=[512, 4096, 16384], help="sequences a step")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 8], help="replicas of each stand-in role")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[0, 2], help="rollout workers (0: the controller makes the groups)"
    )
    parser.add_argument("--steps", type=int, default=4, help="measured steps per cell (after one warm-up step)")
    parser.add_argument("--profile", help="cProfile the controller's measured steps into this file")
    parser.add_argument("--out", help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    if any(s % GROUP_SIZE or s < GROUP_SIZE for s in args.sequences):
        parser.error(f"--sequences must be multiples of the group size {GROUP_SIZE}")
    if any(w < 0 for w in args.workers):
        parser.error(f"--workers must be 0 (none) or more, got {args.workers}")
    header = f"{'seq/step':>9s} {'replicas':>8s} {'workers':>7s} {'ctrl us/seq':>12s} {'seq/s':>10s}"
    print(f"{header} {'ctrl CPU':>9s} {'main thr':>9s}")
    results = summary(asyncio.run(sweep(args.sequences, args.replicas, args.workers, args.steps, args.profile)))
    print_goals(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    forge.controller.quiet_monarch()
    sys.path.insert(0, str(HERE))
    import rollout_scale  # the stand-ins must pickle by reference, under the name the replicas import

    rollout_scale.main()
