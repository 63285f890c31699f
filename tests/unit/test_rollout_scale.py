"""benchmarks/rollout_scale.py: its smallest cell runs end to end, its keys are the table's, and a
stand-in role that answers a group with the wrong count stops the rollouts naming the role."""

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import rollout_scale  # noqa: E402

from apps.common.roles import RoleFailed  # noqa: E402
from apps.grpo.groups import SingleTurnGroups  # noqa: E402
from forge.actors.reward import MAX_BATCH_PAIRS, RewardActor, group_pairs  # noqa: E402
from forge.controller import Batching, endpoint  # noqa: E402
from forge.types import Prompt  # noqa: E402


class ShortReward(RewardActor):
    """The real reward, less each group's last reward: a role that answers with the wrong count."""

    @endpoint(batch=Batching(max_size=MAX_BATCH_PAIRS, max_wait_s=0.002, size_fn=group_pairs))
    async def score_groups(self, groups: list[tuple[Prompt, list[str]]]) -> list[list[float | Exception]]:
        return [[self.reward.score_one(prompt, text) for text in texts[:-1]] for prompt, texts in groups]


def test_the_smallest_cell_runs_the_app_path_and_writes_its_table(tmp_path):
    """Four groups a step through real stand-in services, the real buffer and dataset: every
    trained sequence is counted, none lost, and the JSON holds the cell."""
    out = tmp_path / "rollout_scale.json"
    argv = ["--sequences", "64", "--replicas", "1", "--workers", "0", "--steps", "2", "--out", str(out)]
    results = rollout_scale.main(argv)
    (cell,) = json.loads(out.read_text())["cells"]
    assert cell == results["cells"][0]
    assert (cell["sequences_per_step"], cell["prompts_per_step"], cell["replicas"], cell["workers"]) == (64, 4, 1, 0)
    assert cell["sequences_trained"] == 128
    assert cell["sequences_produced"] > 0 and cell["controller_cpu_s"] > 0


def test_the_keys_compare_16k_with_512_at_the_most_replicas_and_the_most_workers():
    """The 16k keys come from the largest replica count of the most workers swept; the growth is
    its 16k cost over its 512 cost; every worker count has its own keys under ``by_workers``."""
    cells = [
        {"sequences_per_step": s, "replicas": r, "workers": w, "controller_us_per_sequence": us, "sequences_per_s": sps}
        for s, r, w, us, sps in [
            (512, 2, 0, 10.0, 1.0),
            (16384, 2, 0, 30.0, 2.0),
            (512, 8, 0, 20.0, 3.0),
            (16384, 8, 0, 25.0, 4.0),
            (512, 8, 2, 8.0, 5.0),
            (16384, 8, 2, 6.0, 6.0),
        ]
    ]
    results = rollout_scale.summary(cells)
    assert results["workers_16k"] == 2 and results["replicas_16k"] == 8
    assert results["controller_us_per_sequence_16k"] == 6.0
    assert results["sequences_per_s_16k"] == 6.0
    assert results["controller_cost_growth_16k_vs_512"] == pytest.approx(0.75)
    assert results["by_workers"]["0"]["controller_us_per_sequence_16k"] == 25.0
    assert results["by_workers"]["0"]["controller_cost_growth_16k_vs_512"] == pytest.approx(1.25)


def test_a_cell_with_workers_runs_end_to_end():
    """One cell with one rollout worker: the groups come from the worker, none lost."""
    results = rollout_scale.main(["--sequences", "64", "--replicas", "1", "--workers", "1", "--steps", "1"])
    (cell,) = results["cells"]
    assert cell["workers"] == 1 and cell["sequences_trained"] == 64 and cell["sequences_produced"] > 0


async def _one_group_failure(**stand_ins: Any) -> RoleFailed:
    """The error of one group of 16 over one replica of each stand-in role (``stand_ins`` change
    one of them), through the app's own ``SingleTurnGroups``."""
    roles = await rollout_scale.start_stand_ins(replicas=1, **stand_ins)
    try:
        with pytest.raises(RoleFailed) as caught:
            await SingleTurnGroups(roles, 16).make(Prompt("p0", "1 + 1", "2"), "p0#0")
    finally:
        await roles.stop(timeout_s=60)
    return caught.value


async def test_a_policy_that_returns_too_few_completions_fails_the_group_naming_the_role():
    """A group of 15 completions where the run asked 16 is the policy's error, not a short group;
    generating it again would repeat it, so it is not recoverable."""
    error = await _one_group_failure(group_size=15)
    assert error.role == "policy" and not error.recoverable
    assert "returned 15 completions for a group that needs 16" in str(error)


async def test_a_reward_that_returns_too_few_rewards_fails_the_group_naming_the_role():
    """15 rewards for a group of 16 completions would score the wrong completions if zipped:
    the group fails, naming the reward and both counts, and is not generated again."""
    error = await _one_group_failure(reward_cls=ShortReward)
    assert error.role == "reward" and not error.recoverable
    assert "returned 15 rewards for a group that needs 16" in str(error)
