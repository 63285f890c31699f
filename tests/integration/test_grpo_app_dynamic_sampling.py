"""Dynamic sampling end to end: the tiny app with ``rollout.dynamic_sampling=true`` trains only
on groups with a reward spread, logs ``zero_std_fraction`` every step and loses no group.

The reward makes every even-numbered prompt's group uniform (each of its completions scores
0.5) and scores the others with the toy task's partial credit, so about half the groups are
uniform whatever the tiny policy samples. The reward process imports this module for that
function, so its top level imports nothing heavy (no vLLM, no test helpers).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the app's policy needs vLLM"),
]


def half_uniform(prompt, response_text):  # noqa: ANN001  (a reward function)
    """0.5 for every completion of an even-numbered prompt (``toy-<seed>-<index>``); else the toy reward."""
    from forge.data.rewards import toy_partial_reward

    if int(prompt.prompt_id.rsplit("-", 1)[1]) % 2 == 0:
        return 0.5
    return toy_partial_reward(prompt, response_text)


@pytest.mark.slow  # ~60-90 s; tests/unit/test_grpo_dynamic_sampling.py drives the real rollout loop by default
def test_dynamic_sampling_trains_only_on_groups_with_a_reward_spread(tmp_path: Path) -> None:
    from app_runs import finish_app, start_app

    code, out, err = finish_app(
        start_app(
            tmp_path,
            "reward.fns={tests.integration.test_grpo_app_dynamic_sampling:half_uniform: 1.0}",
            "rollout.dynamic_sampling=true",
            "rollout.max_dropped_per_step=1000",  # never reached: every uniform group is dropped
            steps=3,
        ),
        timeout=150,
    )
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert {"zero_std_fraction", "dropped_uniform_groups", "batch_zero_std_groups"} <= set(row), row.keys()
        assert row["batch_zero_std_groups"] == 0, row
        assert row["groups/lost"] == 0 and row["groups/unaccounted"] == 0, row
    last = rows[-1]
    # 12 groups with a spread were trained; about as many even-numbered prompts finished and were dropped.
    assert last["groups/dropped_uniform"] >= 4, last
    assert last["groups/dropped_uniform"] == sum(r["dropped_uniform_groups"] for r in rows)
    assert any(r["zero_std_fraction"] is not None and r["zero_std_fraction"] >= 0.3 for r in rows), rows
    assert "uniform groups" in out and "dropped" in out, out
