"""What the controller and its rollout workers send each other: a group to make, a group made.

With ``rollout.workers`` the controller keeps the prompts, the group ids and every book
(backpressure, dynamic sampling, the buffer's writes, exactly-once accounting) and sends each
group's prompt to a worker as one ``GroupOrder``. The worker answers a batch of orders with
one ``MadeGroups``: the groups it made packed into one ``Groups`` (ten tensors for the
whole batch), and per order the error that stopped it, if any, and the tries it made after a
replica's death. The service's debatch hands each caller its ``MadeGroup``.
"""

from __future__ import annotations

from dataclasses import dataclass

from forge.types import EpisodeBatch, Groups, Prompt

__all__ = ["GroupOrder", "MadeGroup", "MadeGroups"]


@dataclass
class GroupOrder:
    """Make the group of ``prompt`` under ``group_id`` (the id the buffer deduplicates by)."""

    prompt: Prompt
    group_id: str


@dataclass
class MadeGroup:
    """One order's outcome: its group, or the error that stopped it (a role's own failure, not
    a replica's death: those the worker retries)."""

    group: EpisodeBatch | None
    error: str | None
    regenerated: int
    """Times the worker generated the group again after a replica died under it."""


@dataclass
class MadeGroups:
    """A batch of orders' outcomes, the groups packed; ``errors`` and ``regenerated`` per order."""

    groups: Groups[EpisodeBatch] | None
    errors: list[str | None]
    regenerated: list[int]

    @classmethod
    def pack(cls, outcomes: list[MadeGroup]) -> MadeGroups:
        made = [o.group for o in outcomes if o.group is not None]
        return cls(
            Groups.pack(made) if made else None,
            [o.error for o in outcomes],
            [o.regenerated for o in outcomes],
        )

    def unpack(self, n: int) -> list[MadeGroup]:
        """One ``MadeGroup`` per order, in order; ``ValueError`` if the batch's answer does not fit
        its ``n`` orders (a worker's bug: the run stops naming it)."""
        made = self.groups.unpack() if self.groups is not None else []
        if len(self.errors) != n or len(self.regenerated) != n or len(made) != self.errors.count(None):
            raise ValueError(
                f"a rollout worker answered {n} group orders with {len(self.errors)} outcomes and {len(made)} groups "
                f"for {self.errors.count(None)} successes"
            )
        groups = iter(made)
        return [
            MadeGroup(next(groups) if error is None else None, error, tries)
            for error, tries in zip(self.errors, self.regenerated)
        ]
