"""Evaluations beside training (``apps.common.evaluation.EvalRuns``), driven by a scripted plan:
one at a time, each finished one logged once, the final one superseding, the cost warning."""

from __future__ import annotations

import asyncio
import logging

from apps.common.evaluation import EvalRuns


class ScriptedPlan:
    """An evaluation that takes as long as its gate stays closed and reports its step and time."""

    prompts = [None] * 10

    def __init__(self, eval_s: float = 0.1) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.eval_s = eval_s
        self.runs: list[int] = []

    async def run(self, policy, step: int) -> dict[str, float]:
        self.runs.append(step)
        await self.gate.wait()
        return {"eval/step": float(step), "eval/accuracy": step / 100, "eval/s": self.eval_s}


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_one_evaluation_at_a_time_each_finished_one_logged_once():
    """A due evaluation while one runs is skipped and counted; a finished one reaches the next row
    once; the background one waits for its weights' push."""
    plan = ScriptedPlan()
    runs = EvalRuns(plan, policy=None, every=2)
    assert [runs.due(s) for s in (1, 2, 3, 4)] == [False, True, False, True]
    plan.gate.clear()
    push = asyncio.get_running_loop().create_future()
    runs.start(2, asyncio.ensure_future(push))
    await _settle()
    assert plan.runs == []  # the weights of step 2 are not on the policy yet
    push.set_result(None)
    await _settle()
    assert plan.runs == [2]
    runs.start(4)  # step 2's still runs
    assert runs.collect() == {}
    plan.gate.set()
    await _settle()
    row = runs.collect(step_s=1.0)
    assert row["eval/step"] == 2 and row["eval/skipped"] == 1
    assert runs.collect() == {}


async def test_the_final_evaluation_supersedes_one_still_running():
    plan = ScriptedPlan()
    runs = EvalRuns(plan, policy=None, every=2)
    plan.gate.clear()
    runs.start(2)
    await _settle()
    plan.gate.set()
    task = asyncio.ensure_future(runs.now(3))
    await asyncio.wait_for(task, 5)
    row = runs.collect()
    assert row["eval/step"] == 3 and row["eval/skipped"] == 1
    await runs.close()


async def test_an_evaluation_longer_than_a_step_warns_once_with_its_share_of_the_run(caplog):
    plan = ScriptedPlan(eval_s=3.0)
    runs = EvalRuns(plan, policy=None, every=10)
    with caplog.at_level(logging.WARNING, logger="forge.eval"):
        await runs.now(0)
        runs.collect(step_s=1.0)
        await runs.now(10)
        runs.collect(step_s=1.0)
    warnings = [r.getMessage() for r in caplog.records if "held-out evaluation" in r.getMessage()]
    assert len(warnings) == 1
    assert "3.0s, longer than a training step (1.0s)" in warnings[0] and "about 23% of the run" in warnings[0]
