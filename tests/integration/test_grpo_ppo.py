"""PPO through the GRPO app (``algorithm=ppo``), as a user runs it: the critic learns the returns
(its explained variance and value loss), the policy's reward rises on per-token GAE advantages
with one sample per prompt, where GRPO learns nothing, and ``--resume`` brings the critic back
from its checkpoint, not a fresh random head; a killed critic is replaced; multi-turn works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from app_runs import finish_app, start_app

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(300)


def _rows(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def test_ppo_learns_with_its_critic_and_resumes_the_critic_from_its_checkpoint(tmp_path: Path) -> None:
    """One sample per prompt: GRPO's group advantages are all 0 there (it gained +0.003 in the same
    30 steps), so the reward rises only if the policy trains on the critic's GAE advantages."""
    run = ("algorithm=ppo", "prompts_per_step=256", "group_size=1", "trainer.checkpoint_every=10")
    code, out, err = finish_app(start_app(tmp_path, *run, steps=30), 170)
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 31))
    early, late = rows[:5], rows[-5:]
    assert _mean(late, "reward_mean") > _mean(early, "reward_mean") + 0.06, [round(r["reward_mean"], 3) for r in rows]
    # The critic starts as a random head (explained variance far below 0) and learns the returns.
    assert _mean(late, "critic/explained_variance") > _mean(early, "critic/explained_variance") + 10, rows[-1]
    assert _mean(late, "critic/value_loss") < _mean(early, "critic/value_loss") / 3, rows[-1]
    checkpoints = tmp_path / "out" / "checkpoints"
    kept = {p.name for p in checkpoints.glob("step_*")}
    assert kept and kept <= {p.name for p in (checkpoints / "critic").iterdir()}  # each has its critic's

    code, out, err = finish_app(start_app(tmp_path, *run, "--resume", steps=32), 120)
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    resumed = _rows(tmp_path)[-2:]
    assert [r["step"] for r in resumed] == [31, 32]
    # A critic resumed from step 30 predicts about as well as at step 30; a fresh one as at step 1.
    assert _mean(resumed, "critic/value_loss") < _mean(early, "critic/value_loss") / 3, resumed


def test_a_killed_critic_is_replaced_and_both_meshes_rewind_to_the_checkpoint(tmp_path: Path) -> None:
    """SIGKILL of the critic's process after step 3, checkpoints every 2 steps: a new critic mesh
    loads its checkpoint, the trainer rewinds to the same step (the policy versions say so), and
    the run completes every step once, exit 0."""
    from slow_reward import OVERRIDES as SLOW_REWARD
    from test_grpo_faults import _wait_for_checkpoint, _wait_for_step

    from apps.grpo.faults import role_processes

    steps = 8
    run = ("algorithm=ppo", *SLOW_REWARD, "trainer.checkpoint_every=2", f"trainer.keep_checkpoints={steps}")
    proc = start_app(tmp_path, *run, steps=steps)
    _wait_for_step(proc, tmp_path, 3)
    _wait_for_checkpoint(proc, tmp_path)
    (critic,) = role_processes(proc.pid, "critic")
    critic.kill()
    code, out, err = finish_app(proc, 240)
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))  # the trainer rewound too
    assert rows[-1]["restarts/trainer"] == 1, rows[-1]
    assert "the critic died or hung" in err and "the critic is back at step" in err, err[-3000:]


def test_ppo_trains_multi_turn_trajectories(tmp_path: Path) -> None:
    """The multi-turn game under PPO: each trajectory's sampled turns are GAE's steps (the
    environment's tokens between them are not), and the run trains its critic to the end."""
    critic = 'critic={lr: 3.0e-3, num_threads: 1, env: {OMP_NUM_THREADS: "1"}}'
    proc = start_app(tmp_path, "algorithm=ppo", critic, steps=4, config="configs/multiturn_tiny.yaml")
    code, out, err = finish_app(proc, 150)
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(0 < r["critic/value_loss"] < 10 and r["ppo/advantage_std"] > 0 for r in rows), rows[-1]
