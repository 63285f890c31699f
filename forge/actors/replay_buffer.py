"""``ReplayBuffer``: scored groups waiting for a training step, evicted by policy age.

GRPO normalises rewards within a group, so the buffer stores and hands out whole groups, never
loose episodes. Rollouts run concurrently with training, so a group may have been sampled by a
policy a few versions behind the trainer; ``max_policy_age`` bounds how stale it may be
(``0`` is strictly on-policy, ``1`` is "off by one"). The loss corrects the rest with its
behaviour-logprob importance ratio.

Sampling takes groups out (each group trains once), oldest first, so data is used in the order
it was generated. A group is an ``EpisodeBatch`` (its episodes packed into flat tensors, cheap
to send). ``GroupBuffer`` holds the logic and is tested directly; ``ReplayBuffer`` is the actor
around it.

Every group is accounted for: ``added == sampled + dropped_stale + dropped_full + size``, and a
group whose ``group_id`` was added before is refused and counted in ``duplicates`` instead of
being stored, so no group trains twice (a rollout that is generated again after a replica died
keeps its ``group_id``).
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass

from forge.checks import check_int
from forge.controller import ForgeActor, endpoint
from forge.types import EpisodeBatch, Groups

__all__ = ["BufferStats", "GroupBuffer", "ReplayBuffer", "Sample", "group_version"]


def group_version(group: EpisodeBatch) -> int:
    """The policy version of a group: its oldest episode's."""
    return group.policy_version


@dataclass
class BufferStats:
    """Counters since the buffer started; ``added == sampled + evicted + size`` always holds."""

    added: int = 0
    """Groups stored."""
    sampled: int = 0
    """Groups handed out for training (each group once)."""
    evicted: int = 0
    """Groups dropped unused: ``dropped_stale + dropped_full``."""
    size: int = 0
    """Groups held now."""
    dropped_stale: int = 0
    """Dropped for being older than ``max_policy_age``."""
    dropped_full: int = 0
    """Dropped (oldest first) because the buffer was at ``capacity``."""
    duplicates: int = 0
    """Adds refused because a group with that ``group_id`` was added before."""

    @property
    def balanced(self) -> bool:
        """Whether every group added is sampled, dropped or still held (nothing lost)."""
        return self.added == self.sampled + self.evicted + self.size


@dataclass
class Sample:
    """What ``ReplayBuffer.sample`` returns: the batch (None if too few groups) and the number of
    stale groups the call evicted, so a caller that counts outstanding groups can keep count;
    ``stats``: the buffer's counters after the call (the run logs them every step)."""

    groups: list[EpisodeBatch] | None
    evicted: int
    stats: BufferStats | None = None

    def __getstate__(self) -> dict:
        # The groups travel as one batch (``Groups``): ten tensors, not ten per group.
        state = dict(self.__dict__)
        if self.groups:
            state["groups"] = Groups.pack(self.groups)
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state.get("groups"), Groups):
            state = {**state, "groups": state["groups"].unpack()}
        self.__dict__.update(state)


class GroupBuffer:
    """FIFO of episode groups with eviction by policy age.

    Args:
        max_policy_age: a group sampled with version ``g`` may train at version ``v`` only if
            ``v - g <= max_policy_age``.
        capacity: most groups held; adding to a full buffer drops the oldest group.
    """

    def __init__(self, max_policy_age: int, capacity: int | None = None) -> None:
        check_int("max_policy_age", max_policy_age, 0)
        if capacity is not None:
            check_int("capacity (or None)", capacity, 1)
        self.max_policy_age = max_policy_age
        self.capacity = capacity
        # Each held group with its policy version, read once when it is added.
        self._held: collections.deque[tuple[int, EpisodeBatch]] = collections.deque()
        self._seen: set[str] = set()  # every group_id ever added: a second add is a duplicate
        self.stats = BufferStats()

    def __len__(self) -> int:
        return len(self._held)

    def add(self, group: EpisodeBatch) -> bool:
        """Append one group (all its episodes share a ``group_id``); False if its ``group_id``
        was added before (the group is then refused and counted in ``duplicates``)."""
        if not isinstance(group, EpisodeBatch):
            raise TypeError(f"a group must be an EpisodeBatch, got {type(group).__name__}")
        if len(group) == 0:
            raise ValueError("a group needs at least one episode, got an empty EpisodeBatch")
        ids = set(group.group_ids)
        if len(ids) != 1:
            raise ValueError(f"a group's episodes must share one group_id, got {sorted(ids)}")
        (group_id,) = ids
        if group_id in self._seen:
            self.stats.duplicates += 1
            return False
        self._seen.add(group_id)
        if self.capacity is not None and len(self._held) >= self.capacity:
            self._held.popleft()
            self.stats.evicted += 1
            self.stats.dropped_full += 1
        self._held.append((group_version(group), group))
        self.stats.added += 1
        return True

    def evict(self, policy_version: int) -> int:
        """Drop every group too old to train at ``policy_version``; return how many."""
        oldest_allowed = policy_version - self.max_policy_age
        if not self._held or min(v for v, _ in self._held) >= oldest_allowed:
            return 0
        kept = collections.deque(held for held in self._held if held[0] >= oldest_allowed)
        dropped = len(self._held) - len(kept)
        self._held = kept
        self.stats.evicted += dropped
        self.stats.dropped_stale += dropped
        return dropped

    def sample(self, num_groups: int, policy_version: int) -> list[EpisodeBatch] | None:
        """Evict stale groups, then take the ``num_groups`` oldest; None if there are fewer."""
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.evict(policy_version)
        if len(self._held) < num_groups:
            return None
        batch = [self._held.popleft()[1] for _ in range(num_groups)]
        self.stats.sampled += num_groups
        return batch

    def snapshot(self) -> BufferStats:
        return dataclasses.replace(self.stats, size=len(self._held))


class ReplayBuffer(ForgeActor):
    """The buffer as an actor: ``add(group)``, ``sample(num_groups, policy_version)``, ``stats()``."""

    def __init__(self, max_policy_age: int, capacity: int | None = None) -> None:
        self.buffer = GroupBuffer(max_policy_age, capacity)

    @endpoint
    async def add(self, group: EpisodeBatch) -> int:
        """Store one group; returns the number of groups held."""
        self.buffer.add(group)
        return len(self.buffer)

    @endpoint
    async def add_many(self, groups: list[EpisodeBatch] | Groups[EpisodeBatch]) -> list[bool]:
        """Store several groups (one message for all; ``Groups`` packs them into ten
        tensors); per group, whether it was stored (False: a duplicate ``group_id``, refused)."""
        if isinstance(groups, Groups):
            groups = groups.unpack()
        return [self.buffer.add(group) for group in groups]

    @endpoint
    async def sample(self, num_groups: int, policy_version: int) -> Sample:
        """``num_groups`` groups fresh enough for ``policy_version`` (None if too few are held),
        and how many stale groups were evicted on the way."""
        before = self.buffer.stats.evicted
        groups = self.buffer.sample(num_groups, policy_version)
        return Sample(groups, self.buffer.stats.evicted - before, self.buffer.snapshot())

    @endpoint
    async def stats(self) -> BufferStats:
        return self.buffer.snapshot()
