"""Multi-turn rollouts against the real vLLM policy: token-exact trajectories, prefix caching
and its reset on a weight update, and the multi-turn app as a user runs it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from apps.common.launch import Roles  # noqa: E402
from apps.grpo.cli import app_command  # noqa: E402
from apps.grpo.multiturn import MultiTurnGroups  # noqa: E402
from forge.actors.policy import Policy, PolicyConfig  # noqa: E402
from forge.actors.reference_model import ReferenceConfig, ReferenceModel  # noqa: E402
from forge.actors.trainer import Trainer, TrainerConfig  # noqa: E402
from forge.envs import Action, EnvActor, EnvConfig, Environment, EnvSessionRouter, SessionAffinity, StepResult  # noqa: E402
from forge.types import EpisodeBatch, Prompt, TurnRequest  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


class TranscribedEnv(Environment):
    """Three turns; answers in token ids and writes what it saw and said to ``transcripts``."""

    def __init__(self, transcripts: str) -> None:
        self.dir = Path(transcripts)
        self.seen: list[list[int]] = []
        self.said: list[list[int]] = []

    async def reset(self, prompt: Prompt):
        self.first = [8, 9, 10, 11]
        return self.first

    async def step(self, action: Action):
        self.seen.append(list(action.token_ids))
        done = action.turn == 2
        said = [] if done else [12 + action.turn, 14, 15]
        self.said.append(said)
        if done:
            record = {"prompt": self.first, "sampled": self.seen, "env": self.said}
            (self.dir / f"{os.getpid()}-{id(self)}.json").write_text(json.dumps(record))
        return StepResult(said, 1.0 if done else 0.0, done)


@pytest.fixture(scope="module")
def policy_config(tiny_model_dir: Path) -> PolicyConfig:
    return PolicyConfig(
        model_path=str(tiny_model_dir),
        max_tokens=4,
        max_model_len=256,
        engine_kwargs={"disable_log_stats": False},  # vLLM's prefix-cache counters
    )


async def test_trainer_input_is_the_sampled_and_env_ids_of_three_turns_byte_for_byte(
    tiny_model_dir: Path, policy_config: PolicyConfig, tmp_path: Path
) -> None:
    """A group of 4 three-turn trajectories through the real policy, reference and env services:
    the trainer's input ids are the env's prompt, then what vLLM sampled and what the env said,
    in order, exactly (as the env recorded them); the loss mask covers the sampled tokens."""
    policy = await Policy.options(
        env={"OMP_NUM_THREADS": "1"}, endpoint_routers={"generate_turn": SessionAffinity}
    ).as_service(policy_config)
    reference = await ReferenceModel.options(env={"OMP_NUM_THREADS": "1"}).as_service(
        ReferenceConfig(model_path=str(tiny_model_dir))
    )
    env = await EnvActor.options(router=EnvSessionRouter).as_service(
        EnvConfig(f"{__name__}:TranscribedEnv", {"transcripts": str(tmp_path)})
    )
    try:
        groups = MultiTurnGroups(
            Roles(policy=policy, reference=reference, env=env), 4, max_turns=3, max_tokens=4, max_model_len=256
        )
        group = await groups.make(Prompt("p", "12=", "21"), "g")
        trained = EpisodeBatch.concat([group])  # as the buffer hands them to the trainer
        batch = Trainer._pack(SimpleNamespace(config=TrainerConfig(model_path="unused")), trained)
        episodes = trained.unpack()
        records = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
        assert len(records) == len(episodes) == 4
        expected_rows = set()
        for r in records:
            s, e = r["sampled"], r["env"]
            assert len(s) == 3 and all(len(t) >= 1 for t in s)
            ids = r["prompt"] + s[0] + e[0] + s[1] + e[1] + s[2]
            mask = [True] * len(s[0]) + [False] * 3 + [True] * len(s[1]) + [False] * 3 + [True] * len(s[2])
            expected_rows.add((tuple(ids), tuple(mask)))
        got_rows = set()
        for i, episode in enumerate(episodes):
            n = int(batch.attention_mask[i].sum())
            ids = batch.input_ids[i, :n]
            assert ids.dtype == torch.long
            mask = batch.loss_mask[i, 3 : n - 1]  # column t: the token at t+1; the prompt is 4 long
            got_rows.add((tuple(ids.tolist()), tuple(mask.tolist())))
            assert ids.numpy().tobytes() == torch.cat([episode.prompt_ids, episode.response_ids]).numpy().tobytes()
            assert torch.isfinite(episode.behaviour_logprobs[episode.loss_mask]).all()
            assert (episode.behaviour_logprobs[episode.loss_mask] < 0).all()  # a real logprob per sampled token
            assert episode.policy_version == 0
        assert got_rows == expected_rows
    finally:
        await asyncio.gather(policy.shutdown(), reference.shutdown(), env.shutdown())


async def test_prefix_cache_serves_a_sessions_history_and_is_reset_by_a_weight_update(
    policy_config: PolicyConfig, tiny_model_dir_alt: Path
) -> None:
    """The second turn on a 96-token history hits vLLM's prefix cache (vLLM's own counters);
    after update_weights nothing computed with the old weights is reused, and each turn reports
    the version that sampled it."""
    policy = await Policy.options(env={"OMP_NUM_THREADS": "1"}).as_service(policy_config)
    try:
        history = torch.tensor([(7 * i) % 40 + 4 for i in range(96)])

        async def turn():
            before = (await policy.prefix_cache_stats.fanout())[0]
            result = await policy.generate_turn.route(TurnRequest("s", history))
            after = (await policy.prefix_cache_stats.fanout())[0]
            return result, after["hits"] - before["hits"], after["queries"] - before["queries"]

        first, hits0, queries0 = await turn()
        assert queries0 == 96 and hits0 == 0
        second, hits1, _ = await turn()
        assert hits1 >= 64  # three 32-token blocks of the history, less the block vLLM recomputes
        assert first.policy_version == second.policy_version == 0
        assert await policy.update_weights.fanout(str(tiny_model_dir_alt / "model.safetensors"), 1) == [1]
        third, hits2, _ = await turn()
        assert hits2 == 0  # the cache was reset: no KV block of the old weights is reused
        assert third.policy_version == 1
    finally:
        await policy.shutdown()


@pytest.mark.slow
def test_multiturn_app_runs_and_learns(tmp_path: Path) -> None:
    """``python -m apps.grpo.main --config configs/multiturn_tiny.yaml``: metrics.jsonl with
    reward_mean per step, and the last 10 steps' mean reward at least 2x the first 10's."""
    out = tmp_path / "out"
    args = app_command("configs/multiturn_tiny.yaml", tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= 2 * first, f"reward first 10 {first:.3f}, last 10 {last:.3f}"
    assert all(r["rollout/turns"] >= 1 for r in rows if "rollout/turns" in r)
