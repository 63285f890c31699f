"""Agents trained through the OpenAI front door (``rollout.agent``, ``apps.grpo.agents``), against
the real vLLM policy service: the trajectory is the ids the agent was served, exactly; an agent
that fails fails its episode alone; and the agent app as a user runs it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from apps.common.launch import Roles  # noqa: E402
from apps.common.roles import RoleFailed  # noqa: E402
from apps.grpo.agents import AgentGroups, AgentSettings  # noqa: E402
from apps.grpo.cli import app_command  # noqa: E402
from forge.actors.policy import Policy, PolicyConfig  # noqa: E402
from forge.types import Prompt  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)
PROMPT = Prompt("p", "12=", "21")
TRANSCRIPTS: list[list[dict]] = []
CALLS = {"n": 0}


async def transcribed_agent(client, prompt: Prompt) -> float:
    """Three completions, each prompt the last plus its completion plus ``" x="``; asks for greedy
    sampling (a recorded session samples at the run's temperature anyway) and keeps what it was served."""
    text, turns = prompt.text, []
    for _ in range(3):
        reply = await client.completions.create(
            model="policy", prompt=text, temperature=0.0, logprobs=1, extra_body={"return_token_ids": True}
        )
        (choice,) = reply.choices
        turns.append(
            {
                "prompt_ids": reply.model_extra["prompt_token_ids"],
                "ids": choice.model_extra["token_ids"],
                "logprobs": choice.logprobs.token_logprobs,
                "version": choice.model_extra["policy_version"],
            }
        )
        text += choice.text + " x="
    TRANSCRIPTS.append(turns)
    return float(len(TRANSCRIPTS))


async def failing_agents(client, prompt: Prompt) -> float:
    """The n-th run of a group: raises after a call, never calls, runs past the timeout, returns
    no number, asks n=2 of a recorded session; the sixth plays one turn and returns 1.0."""
    CALLS["n"] += 1
    run = CALLS["n"]
    if run == 2:
        return 0.0
    if run == 3:
        await asyncio.sleep(30)
    if run == 5:
        await client.completions.create(model="policy", prompt=prompt.text, n=2)
    await client.completions.create(model="policy", prompt=prompt.text)
    if run == 1:
        raise ValueError("the agent's own bug")
    return "not a reward" if run == 4 else 1.0


async def always_raises(client, prompt: Prompt) -> float:
    raise RuntimeError("broken agent")


@pytest.fixture(scope="module")
async def policy(tiny_model_dir: Path):
    config = PolicyConfig(model_path=str(tiny_model_dir), max_tokens=4, max_model_len=256, temperature=1.0)
    service = await Policy.options(
        env={"OMP_NUM_THREADS": "1"}, endpoint_routers={"sample": "key_affinity"}
    ).as_service(config)
    yield service
    await service.shutdown()


def _groups(policy, tiny_model_dir: Path, agent: str, group_size: int, timeout_s: float = 60.0) -> AgentGroups:
    settings = AgentSettings(f"{__name__}:{agent}", timeout_s, str(tiny_model_dir), 256, 4, 1.0)
    return AgentGroups(Roles(policy=policy), group_size, settings)


async def test_an_agents_trajectory_is_the_ids_it_was_served_and_trains_only_the_sampled_ones(
    policy, tiny_model_dir: Path
) -> None:
    TRANSCRIPTS.clear()
    maker = _groups(policy, tiny_model_dir, "transcribed_agent", 4)
    try:
        group = await maker.make(PROMPT, "g")
    finally:
        await maker.aclose()
    episodes = group.unpack()
    assert len(episodes) == len(TRANSCRIPTS) == 4
    expected = {}
    for turns in TRANSCRIPTS:
        ids, mask, logprobs = [], [], []
        for k, turn in enumerate(turns):
            if k:  # the added text: everything after the last prompt and completion, out of the loss
                history = turns[k - 1]["prompt_ids"] + turns[k - 1]["ids"]
                assert turn["prompt_ids"][: len(history)] == history, "the history was re-tokenised"
                added = turn["prompt_ids"][len(history) :]
                ids, mask, logprobs = ids + added, mask + [False] * len(added), logprobs + [0.0] * len(added)
            ids += turn["ids"]
            mask += [True] * len(turn["ids"])
            logprobs += turn["logprobs"]
        expected[tuple(turns[0]["prompt_ids"] + ids)] = (mask, logprobs)
    for episode in episodes:
        key = tuple(episode.prompt_ids.tolist() + episode.response_ids.tolist())
        mask, logprobs = expected.pop(key)
        assert episode.loss_mask.tolist() == mask
        assert episode.behaviour_logprobs.tolist() == pytest.approx(logprobs, abs=1e-6)
    # Rewards 1..4 in the order the agents finished: normalised over the group.
    assert sorted(round(e.reward) for e in episodes) == [1, 2, 3, 4]
    assert abs(sum(e.advantage for e in episodes)) < 1e-5
    # Asked temperature 0, sampled at the run's 1.0: four greedy runs of one prompt would be equal.
    assert len({tuple(t[0]["ids"]) for t in TRANSCRIPTS}) > 1


async def test_an_agent_that_raises_never_calls_times_out_or_returns_no_number_fails_its_episode_alone(
    policy, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    CALLS["n"] = 0
    maker = _groups(policy, tiny_model_dir, "failing_agents", 6, timeout_s=3.0)
    with caplog.at_level(logging.WARNING, logger="forge.grpo"):
        try:
            group = await maker.make(PROMPT, "g2")
        finally:
            await maker.aclose()
    (episode,) = group.unpack()
    assert episode.reward == 1.0
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for cause in (
        "the agent raised ValueError",
        "the agent never called the model",
        "within rollout.agent_timeout_s=3",
        "the agent returned 'not a reward'",
        "samples n=1 at a time, got n=2",
    ):
        assert cause in warnings, warnings
    assert warnings.count("session g2/agent-") == 5


async def test_a_group_whose_every_agent_fails_stops_the_run_naming_the_agent(policy, tiny_model_dir: Path) -> None:
    maker = _groups(policy, tiny_model_dir, "always_raises", 2)
    try:
        with pytest.raises(RoleFailed, match="role 'agent' failed: every trajectory of group g3 failed 3 times"):
            await maker.make(PROMPT, "g3")
    finally:
        await maker.aclose()


def test_the_agent_app_trains_through_the_front_door(tmp_path: Path) -> None:
    """``configs/agent_tiny.yaml`` for a few steps: exit 0, every step trained on three-guess
    trajectories made through the front door."""
    args = app_command("configs/agent_tiny.yaml", tmp_path, "steps=4", "prompts_per_step=4", "group_size=4")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(1 <= r["rollout/turns"] <= 3 and not r.get("rollout/failed_trajectories") for r in rows)
    assert rows[-1]["groups/trained"] == 16  # a running count: 4 groups a step


@pytest.mark.slow
def test_the_agent_app_learns_the_reversal_game(tmp_path: Path) -> None:
    """The reversal game trained through the agent path: the last 10 steps' mean reward at least
    2x the first 10's (as the same game trained as an ``Environment``, ``test_multiturn``)."""
    args = app_command("configs/agent_tiny.yaml", tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [
        json.loads(line)["reward_mean"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    ]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= 2 * first, f"reward first 10 {first:.3f}, last 10 {last:.3f}"


async def test_the_tool_agent_chats_through_the_chat_template(tmp_path: Path) -> None:
    """``forge.envs.agents:tool_reversal_agent`` on the tiny chat model: each episode's prompt is the
    chat template's first user turn, and the sampled ids alone are trained."""
    from transformers import AutoTokenizer

    from forge.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "chat", arch="qwen3", hidden_size=64, chat_template=True, init_std=0.1)
    config = PolicyConfig(model_path=str(model), max_tokens=16, max_model_len=512, temperature=1.0)
    chat = await Policy.options(env={"OMP_NUM_THREADS": "1"}, endpoint_routers={"sample": "key_affinity"}).as_service(
        config
    )
    try:
        settings = AgentSettings("forge.envs.agents:tool_reversal_agent", 60.0, str(model), 512, 16, 1.0)
        maker = AgentGroups(Roles(policy=chat), 4, settings)
        try:
            group = await maker.make(PROMPT, "t")
        finally:
            await maker.aclose()
    finally:
        await chat.shutdown()
    tokenizer = AutoTokenizer.from_pretrained(model)
    first_turn = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT.text}], tokenize=False, add_generation_prompt=True
    )
    episodes = group.unpack()
    assert len(episodes) >= 4  # one trajectory per episode, more where a history was not continued
    for episode in episodes:
        assert episode.prompt_ids.tolist() == tokenizer(first_turn)["input_ids"]
        assert episode.loss_mask[0] and 0.0 <= episode.reward <= 1.0
