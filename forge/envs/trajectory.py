"""A multi-turn trajectory kept as token ids end to end.

The policy samples ids, the environment answers with ids, and the trajectory is their
concatenation, in order, exactly as they were produced: nothing is decoded and re-encoded
between turns (a round trip through text can change token boundaries, and then the trainer
would score tokens the policy never sampled). Each sampled token carries its behaviour
logprob; the loss mask is true on sampled tokens and false on the environment's; each turn
records the policy version that sampled it, and the episode's version is the oldest turn's,
so the buffer's staleness check holds for every token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forge.types import Episode, TurnResult

__all__ = ["Trajectory"]


@dataclass
class Trajectory:
    """One session's token history: the prompt, then sampled and environment segments."""

    session: str
    group: str
    prompt_ids: torch.Tensor  # int64 [P]
    segments: list[torch.Tensor] = field(default_factory=list)  # int64, in order
    sampled: list[bool] = field(default_factory=list)  # per segment: the policy's (True) or the env's
    logprobs: list[torch.Tensor] = field(default_factory=list)  # per segment, zeros for the env's
    turn_versions: list[int] = field(default_factory=list)  # the policy version of each turn (its oldest token's)
    versions: list[torch.Tensor] = field(default_factory=list)  # per segment: each token's version, -1 for the env's
    rewards: list[float] = field(default_factory=list)  # per environment step
    done: bool = False
    _length: int = 0

    def __post_init__(self) -> None:
        self.prompt_ids = self.prompt_ids.long()
        if self.prompt_ids.dim() != 1 or self.prompt_ids.numel() == 0:
            raise ValueError(f"session {self.session!r}: the prompt must be a non-empty 1-D id tensor")
        self._length = int(self.prompt_ids.numel())

    @property
    def turns(self) -> int:
        return len(self.turn_versions)

    @property
    def length(self) -> int:
        """Tokens in the history: prompt + every segment."""
        return self._length

    def history_ids(self) -> torch.Tensor:
        """The policy's next prompt: everything so far, as ids."""
        return torch.cat([self.prompt_ids, *self.segments])

    def add_turn(self, turn: TurnResult) -> None:
        """Append what the policy sampled, with its behaviour logprobs and version."""
        ids, logprobs = turn.token_ids.long(), turn.logprobs.float()
        if ids.dim() != 1 or ids.shape != logprobs.shape:
            raise ValueError(
                f"session {self.session!r}: a turn needs one logprob per sampled token, "
                f"got ids {tuple(ids.shape)} and logprobs {tuple(logprobs.shape)}"
            )
        self._append(ids, logprobs, sampled=True, versions=turn.versions().long())
        self.turn_versions.append(int(turn.policy_version))

    def add_observation(self, ids: torch.Tensor, reward: float, done: bool) -> None:
        """Append the environment's answer (left out of the loss) and its reward."""
        ids = ids.long()
        if ids.numel():
            unsampled = torch.full(ids.shape, -1, dtype=torch.long)
            self._append(ids, torch.zeros(ids.numel(), dtype=torch.float32), sampled=False, versions=unsampled)
        self.rewards.append(float(reward))
        self.done = done

    def _append(self, ids: torch.Tensor, logprobs: torch.Tensor, sampled: bool, versions: torch.Tensor) -> None:
        self.segments.append(ids)
        self.versions.append(versions)
        self.logprobs.append(logprobs)
        self.sampled.append(sampled)
        self._length += int(ids.numel())

    @property
    def response_ids(self) -> torch.Tensor:
        """Everything after the prompt: sampled and environment ids concatenated."""
        return torch.cat(self.segments) if self.segments else torch.zeros(0, dtype=torch.long)

    @property
    def loss_mask(self) -> torch.Tensor:
        """bool, one per response token: True where the policy sampled it."""
        if not self.segments:
            return torch.zeros(0, dtype=torch.bool)
        return torch.cat(
            [torch.full((s.numel(),), keep, dtype=torch.bool) for s, keep in zip(self.segments, self.sampled)]
        )

    @property
    def behaviour_logprobs(self) -> torch.Tensor:
        """float32, one per response token: the behaviour logprob where sampled, 0 elsewhere."""
        return torch.cat(self.logprobs) if self.logprobs else torch.zeros(0, dtype=torch.float32)

    @property
    def reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def policy_version(self) -> int:
        """The oldest turn's version: the buffer's staleness rule then holds for every token."""
        if not self.turn_versions:
            raise ValueError(f"session {self.session!r} has no turn yet")
        return min(self.turn_versions)

    def to_episode(self, group_id: str, ref_logprobs: torch.Tensor, advantage: float) -> Episode:
        """The trajectory as the trainer's ``Episode``: prompt, response and the loss mask."""
        response = self.response_ids
        if ref_logprobs.shape != response.shape:
            raise ValueError(
                f"session {self.session!r}: {tuple(ref_logprobs.shape)} reference logprobs for "
                f"{tuple(response.shape)} response tokens"
            )
        return Episode(
            group_id=group_id,
            prompt_ids=self.prompt_ids,
            response_ids=response,
            behaviour_logprobs=self.behaviour_logprobs,
            ref_logprobs=ref_logprobs.float(),
            reward=self.reward,
            advantage=float(advantage),
            policy_version=self.policy_version,
            loss_mask=self.loss_mask,
            token_versions=torch.cat(self.versions) if self.versions else torch.zeros(0, dtype=torch.long),
        )
