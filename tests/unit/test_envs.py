"""forge.envs pure logic: trajectories as token ids, the loss mask, session routing, tool calls,
step validation and the toy game. In-process; the env service is tested in test_envs_service.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from forge.actors.trainer import Trainer, TrainerConfig
from forge.controller.routing import RouteRequest
from forge.envs import (
    Action,
    EnvError,
    Environment,
    EnvSessionRouter,
    SessionAffinity,
    SessionKey,
    StepResult,
    ToolEnvironment,
    Trajectory,
    check_step,
    load_environment,
    parse_tool_call,
)
from forge.envs.toy import ReverseWithFeedback, feedback_marks
from forge.types import EpisodeBatch, Prompt, TurnResult


def _turn(ids: list[int], version: int) -> TurnResult:
    return TurnResult(
        token_ids=torch.tensor(ids),
        logprobs=-0.1 * torch.arange(1, len(ids) + 1).float(),
        text="",
        policy_version=version,
    )


def three_turn_trajectory() -> tuple[Trajectory, list[list[int]], list[list[int]]]:
    sampled = [[11, 12, 13], [21, 22], [31, 32, 33, 34]]
    env = [[5, 6], [7, 8, 9], []]  # the last step is done, with an empty observation
    traj = Trajectory("g/0", "g", torch.tensor([1, 2, 3, 4]))
    for turn, (s, e) in enumerate(zip(sampled, env)):
        traj.add_turn(_turn(s, version=7 - turn))  # later turns by older versions: min matters
        traj.add_observation(torch.tensor(e, dtype=torch.long), reward=0.5 if turn == 2 else 0.0, done=turn == 2)
    return traj, sampled, env


def test_trainer_input_ids_are_the_sampled_and_env_ids_concatenated_across_three_turns():
    """Through Episode, EpisodeBatch (pack, concat, unpack) and the trainer's own packing, the input
    ids are the prompt, then each turn's sampled ids and the env's ids, exactly; the loss mask
    covers the sampled tokens only; behaviour logprobs sit on the sampled tokens."""
    traj, sampled, env = three_turn_trajectory()
    expected = [1, 2, 3, 4] + sampled[0] + env[0] + sampled[1] + env[1] + sampled[2]
    assert traj.history_ids().tolist() == expected
    episode = traj.to_episode("g", ref_logprobs=torch.zeros(len(expected) - 4), advantage=1.0)
    single_turn = EpisodeBatch.pack([traj.to_episode("h", torch.zeros(len(expected) - 4), 0.0)])
    single_turn.loss_mask = None  # a batch from single-turn rollouts, concatenated with ours
    joined = EpisodeBatch.concat([EpisodeBatch.pack([episode]), single_turn])
    (back,) = [e for e in joined.unpack() if e.group_id == "g"]
    ours = joined.rows(0, 1)  # group g's episode, as the trainer slices a micro-batch
    batch = Trainer._pack(SimpleNamespace(config=TrainerConfig(model_path="unused", stop_token_ids=[12])), ours)
    assert batch.input_ids[0].tolist() == expected
    sampled_mask = [False] * 3 + [True] * 3 + [False] * 2 + [True] * 2 + [False] * 3 + [True] * 4
    assert batch.loss_mask[0].tolist() == sampled_mask  # columns: the token predicted at t+1
    assert batch.response_mask[0].sum() == len(expected) - 4
    assert back.behaviour_logprobs[back.loss_mask].tolist() == pytest.approx(
        [-0.1, -0.2, -0.3, -0.1, -0.2]
        + [
            -0.1,
            -0.2,
            -0.3,
            -0.4,
        ]
    )
    assert float(back.behaviour_logprobs[~back.loss_mask].abs().sum()) == 0.0
    assert traj.turn_versions == [7, 6, 5] and back.policy_version == 5  # staleness from the oldest turn
    assert back.reward == 0.5


def test_a_turn_without_one_logprob_per_token_is_refused():
    traj = Trajectory("s", "g", torch.tensor([1]))
    with pytest.raises(ValueError, match="one logprob per sampled token"):
        traj.add_turn(TurnResult(torch.tensor([1, 2]), torch.tensor([0.0]), "", 0))


class _Replica:
    def __init__(self, replica_id: int, in_flight: int = 0) -> None:
        self.replica_id = replica_id
        self.in_flight = in_flight

    def has_forming(self, endpoint, key) -> bool:
        return False


def test_session_affinity_keeps_a_group_together_and_each_session_on_its_replica():
    """All first turns of a group go to one replica; each session's later turns follow it, even
    when the group's own replica would now be another."""
    router = SessionAffinity(slack=100)
    replicas = [_Replica(i) for i in range(4)]
    for group in range(20):
        first = {
            router.choose(RouteRequest("t", SessionKey(f"{group}/{i}", str(group))), replicas).replica_id
            for i in range(8)
        }
        assert len(first) == 1
    groups_home = {
        router.choose(RouteRequest("t", SessionKey(f"{g}/0", str(g))), replicas).replica_id for g in range(20)
    }
    assert len(groups_home) > 1  # groups are spread over replicas
    session = SessionKey("9/3", "9")
    home = router.choose(RouteRequest("t", session), replicas).replica_id
    for _ in range(5):
        assert router.choose(RouteRequest("t", session), replicas).replica_id == home


def test_a_new_group_starts_on_the_least_loaded_replica_and_its_samples_follow():
    router = SessionAffinity(slack=4)
    busy, idle = _Replica(0, in_flight=5), _Replica(1, in_flight=0)
    for name in "abcdefgh":  # whatever their hash, new groups go where the load is least
        assert router.choose(RouteRequest("t", SessionKey(f"{name}/0", name)), [busy, idle]) is idle
    idle.in_flight = 6  # the group's own samples loaded it; still under the bound (ceil(1.5 * 12 / 2) + 4 = 13)
    assert all(router.choose(RouteRequest("t", SessionKey(f"g/{i}", "g")), [busy, idle]) is idle for i in range(1, 4))
    assert router.choose(RouteRequest("t", SessionKey("z/0", "z")), [busy, idle]) is busy  # the next group


def test_session_affinity_caps_a_replica_and_a_spilled_session_sticks_to_its_new_replica():
    router = SessionAffinity(load_factor=1.5, slack=0)
    replicas = [_Replica(0), _Replica(1)]
    session = SessionKey("a/0", "a")
    home = router.choose(RouteRequest("t", session), replicas)
    other = replicas[1 - home.replica_id]
    home.in_flight, other.in_flight = 10, 0  # bound: ceil(1.5 * 11 / 2) = 9 < 10
    spilled = router.choose(RouteRequest("t", session), replicas)
    assert spilled is other and router.spills == 1
    home.in_flight = 0
    assert router.choose(RouteRequest("t", session), replicas) is other  # its prefix is there now


def test_session_affinity_forgets_least_recently_used_sessions_beyond_max_sessions():
    router = SessionAffinity(max_sessions=3)
    replicas = [_Replica(0), _Replica(1)]
    for name in "abcd":
        router.choose(RouteRequest("t", SessionKey(name, name)), replicas)
    assert router.sessions.names() == ["b", "c", "d"]
    router.choose(RouteRequest("t", SessionKey("b", "b")), replicas)
    router.choose(RouteRequest("t", SessionKey("e", "e")), replicas)
    assert router.sessions.names() == ["d", "b", "e"]


def test_session_keys_are_equal_only_for_the_same_session_and_group():
    """A SessionKey only routes (turns share one batch queue without it), so its equality is plain."""
    assert SessionKey("a", "g") == SessionKey("a", "g") and hash(SessionKey("a", "g")) == hash(SessionKey("a", "g"))
    assert SessionKey("a", "g") != SessionKey("b", "g") and SessionKey("a", "g") != SessionKey("a", "h")


def test_a_plain_session_key_sticks_like_a_session_without_a_group():
    router = SessionAffinity(slack=100)
    replicas = [_Replica(i) for i in range(3)]
    home = router.choose(RouteRequest("t", "s1"), replicas)
    replicas[home.replica_id].in_flight = 5  # still under the bound: the session stays
    assert all(router.choose(RouteRequest("t", "s1"), replicas) is home for _ in range(4))
    assert router.choose(RouteRequest("t", SessionKey("s1")), replicas) is home  # the same session


def test_env_session_router_keeps_a_session_on_its_replica_without_spilling():
    """The episode lives on one env replica: however loaded it is, its session's steps go there;
    a new session goes to its rendezvous owner, and a forgotten pin finds that owner again."""
    router = EnvSessionRouter(max_sessions=2)
    replicas = [_Replica(i) for i in range(4)]
    homes = {s: router.choose(RouteRequest("step", SessionKey(s)), replicas) for s in ("a", "b", "c")}
    assert len({r.replica_id for r in homes.values()}) > 1
    homes["c"].in_flight = 1_000
    assert router.choose(RouteRequest("step", "c"), replicas) is homes["c"]  # no spill, plain key or SessionKey
    assert "a" not in router.pins.names()  # forgotten past max_sessions ...
    assert router.choose(RouteRequest("step", "a"), replicas) is homes["a"]  # ... yet back on its owner


def test_tool_calls_run_and_append_the_result_until_the_policy_answers():
    class Calc(ToolEnvironment):
        tools = {"add": lambda arg: str(sum(int(x) for x in arg.split())), "boom": lambda arg: 1 // 0}

        async def reset(self, prompt):
            return prompt.text

        async def answer(self, action):
            return StepResult("", float(action.text.strip() == "5"), done=True)

    async def play():
        env = Calc()
        await env.reset(Prompt("p", "2 + 3 =", "5"))
        steps = []
        for turn, text in enumerate(["call add 2 3", "call boom", "call nope x", "5"]):
            steps.append(await env.step(Action((), text, turn)))
        return steps

    add, boom, nope, final = asyncio.run(play())
    assert add == StepResult(" result 5 ", 0.0, False)
    assert boom.observation == " error zerodivisionerror " and not boom.done
    assert "unknown tool nope" in nope.observation and "add boom" in nope.observation
    assert final == StepResult("", 1.0, True)
    assert parse_tool_call("  call add 1 2 ").argument == "1 2"
    assert parse_tool_call("123") is None


def test_a_call_past_max_tool_calls_is_scored_as_the_answer():
    """With max_tool_calls=2, the third call is not run: the episode ends with the answer's score."""

    class Echo(ToolEnvironment):
        tools = {"echo": lambda arg: arg}
        max_tool_calls = 2

        async def reset(self, prompt):
            return prompt.text

        async def answer(self, action):
            return StepResult("", -1.0, done=True)

    async def play():
        env = Echo()
        await env.reset(Prompt("p", "say", "x"))
        return [await env.step(Action((), "call echo hi", turn)) for turn in range(3)]

    first, second, third = asyncio.run(play())
    assert first == second == StepResult(" result hi ", 0.0, False)
    assert third == StepResult("", -1.0, True)


@pytest.mark.parametrize(
    "value, message",
    [
        (None, "must return a StepResult"),
        (("obs", 1.0), "must return a StepResult"),
        (StepResult(3.5, 0.0, False), "observation must be a str or a sequence of int"),
        (StepResult([1, "a"], 0.0, False), "observation must be a str or a sequence of int"),
        (StepResult("", float("nan"), True), "reward must be a finite number"),
        (StepResult("", "1", True), "reward must be a finite number"),
        (StepResult("", 1.0, 1), "done must be a bool"),
    ],
)
def test_malformed_steps_are_named(value, message):
    with pytest.raises(EnvError, match=message):
        check_step(value, "env x")


def test_well_formed_steps_pass_and_tuples_are_accepted():
    assert check_step(("o", 1, False), "e") == StepResult("o", 1.0, False)
    assert check_step(StepResult((4, 5), 0.5, True), "e") == StepResult([4, 5], 0.5, True)


def test_load_environment_names_the_problem():
    assert load_environment("forge.envs.toy:ReverseWithFeedback") is ReverseWithFeedback
    with pytest.raises(ValueError, match="package.module:Class"):
        load_environment("forge.envs.toy.ReverseWithFeedback")
    with pytest.raises(ValueError, match="cannot be imported"):
        load_environment("forge.envs.nope:Env")
    with pytest.raises(ValueError, match="not a subclass of forge.envs.Environment"):
        load_environment("forge.envs.toy:feedback_marks")
    assert issubclass(ReverseWithFeedback, Environment)


def test_toy_game_marks_right_digits_and_scores_the_final_guess():
    async def play(guesses):
        env = ReverseWithFeedback(max_guesses=3)
        await env.reset(Prompt("p", "371=", "173"))
        return [await env.step(Action((), g, t)) for t, g in enumerate(guesses)]

    first, second, third = asyncio.run(play(["193", "17", "173"]))
    assert first == StepResult(" 1x3=", 0.0, False)
    assert second == StepResult(" 17x=", 0.0, False)
    assert third == StepResult("", 1.0, True)
    (right,) = asyncio.run(play(["173"]))
    assert right.done and right.reward == 1.0  # a right guess ends the game at once
    *_, last = asyncio.run(play(["000", "000", "100"]))
    assert last.done and last.reward == pytest.approx(0.9 / 3 + 0.1)
    assert feedback_marks("", "12") == "xx"
