"""Multi-turn rollouts of the GRPO app: a group is ``group_size`` trajectories of one prompt,
each a conversation between the policy and an environment service.

One trajectory, turn by turn::

    env.reset(prompt)            -> the first observation's ids (the policy's prompt)
    policy.generate_turn(ids)    -> sampled ids + behaviour logprobs + policy version
    env.step(action)             -> observation ids, reward, done       (repeat until done)

Every policy and env call carries the trajectory's ``SessionKey``: the policy's
``SessionAffinity`` router keeps a session's turns on the replica whose prefix cache holds its
history and starts a group's samples on one replica under a load cap; the env's router sends a
session to the one replica that holds its episode. Turns of all trajectories in flight are
prebatched on each replica, and so are env steps.

The trajectory is token ids end to end (``forge.envs.Trajectory``): the trainer's input is the
prompt ids, then the sampled and environment ids exactly as they were produced, with a loss
mask over the sampled ones. The group's advantages are normalised over its trajectories'
rewards (the sum of each trajectory's step rewards).

Failures: a trajectory whose environment raises, returns a malformed step, hangs past
``env.step_timeout_s`` or does not finish within ``env.max_turns`` fails alone, with a warning
naming the session and the cause; the group trains on the others. A group all of whose
trajectories failed is tried again with the same prompt (``apps.grpo.trajectory_groups``: a few times, then the
run stops: the environment is broken, not unlucky). A policy or env replica that dies makes the
whole group be generated again, as in single-turn rollouts: a policy turn resent to a restarted
replica just misses its prefix cache, but an env step resent to a restarted env replica finds
no episode there (``UnknownSession``), so the group is played again from its prompt.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from apps.common.launch import Roles
from apps.common.roles import RoleFailed, call_role
from apps.grpo.trajectory_groups import TrajectoryFailed, failed, play_group, score_group
from forge.controller import ReplicaFailed
from forge.envs import Action, EnvError, ResetRequest, SessionKey, StepRequest, Trajectory, UnknownSession
from forge.types import EpisodeBatch, Prompt, TurnRequest

logger = logging.getLogger("forge.grpo")


class MultiTurnGroups:
    """A group maker (``apps.grpo.groups``) whose groups are multi-turn trajectories against ``roles.env``."""

    def __init__(self, roles: Roles, group_size: int, *, max_turns: int, max_tokens: int, max_model_len: int) -> None:
        if roles.env is None:
            raise ValueError("multi-turn rollouts need an environment service (env.cls in the config)")
        self.roles = roles
        self.group_size = group_size
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.failed_trajectories = 0
        self._sessions = itertools.count()

    async def make(self, prompt: Prompt, group_id: str) -> EpisodeBatch:
        """``group_size`` trajectories of ``prompt`` -> reference logprobs -> scored episodes."""
        t0 = time.perf_counter()
        runs, failures = await play_group(lambda: self._run(prompt, group_id), self.group_size, group_id, "env")
        self.failed_trajectories += failures
        return await score_group(self.roles, group_id, runs, t0)

    async def _run(self, prompt: Prompt, group_id: str) -> list[Trajectory]:
        return [await self.trajectory(prompt, group_id)]

    async def trajectory(self, prompt: Prompt, group_id: str) -> Trajectory:
        """Play one episode to its end; ``TrajectoryFailed`` (logged) if it cannot finish."""
        session = f"{group_id}/{next(self._sessions)}"
        key = SessionKey(session, group_id)
        env, policy = self.roles.env, self.roles.policy
        traj: Trajectory | None = None
        try:
            first = await call_role("env", env.reset.route(ResetRequest(session, prompt), key=key))
            traj = Trajectory(session, group_id, first.observation_ids)
            for turn in range(self.max_turns):
                if traj.length + self.max_tokens > self.max_model_len:
                    raise TrajectoryFailed(
                        f"session {session}: turn {turn} would pass policy.max_model_len={self.max_model_len} "
                        f"({traj.length} tokens of history + max_tokens={self.max_tokens})"
                    )
                sampled = await call_role(
                    "policy", policy.generate_turn.route(TurnRequest(session, traj.history_ids()), key=key)
                )
                traj.add_turn(sampled)
                action = Action(tuple(sampled.token_ids.tolist()), sampled.text, turn)
                reply = await call_role("env", env.step.route(StepRequest(session, action), key=key))
                traj.add_observation(reply.observation_ids, reply.reward, reply.done)
                if traj.done:
                    return traj
            raise TrajectoryFailed(
                f"session {session}: the environment did not finish the episode within env.max_turns={self.max_turns}"
            )
        except RoleFailed as exc:
            if isinstance(exc.error, UnknownSession) and traj is not None:
                # Reset here and not ended: the env replica that held the episode restarted and
                # the service resent the step to its successor. Like a policy replica's death,
                # the whole group is played again (``groups.make_with_retries``).
                raise RoleFailed("env", ReplicaFailed(f"session {session}: {exc.error}")) from exc
            if isinstance(exc.error, EnvError):
                raise failed(TrajectoryFailed(str(exc.error))) from exc
            raise
        except TrajectoryFailed as exc:
            raise failed(exc) from None
        finally:
            if traj is None or not traj.done:  # the env keeps a finished episode no longer
                await self._close(session)

    async def _close(self, session: str) -> None:
        """End the session's episode on the env replicas, whichever holds it; never raises."""
        try:
            await asyncio.wait_for(self.roles.env.close.fanout([session]), 10.0)
        except Exception as exc:  # noqa: BLE001 - a replica that is gone holds no episode
            logger.debug("closing env session %s: %r", session, exc)
