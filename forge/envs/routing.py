"""Routing keys and routers of multi-turn rollouts.

A trajectory is a *session*: every turn after the first extends the same token history, so it
belongs on the policy replica that already holds that history's KV blocks in vLLM's prefix
cache. The samples of one prompt (a GRPO group) share the prompt itself, so they all start on
one replica too.

``SessionKey`` carries the session and its group for the router while comparing equal to every
other ``SessionKey``: the service also uses a request's key to choose the replica's batch queue,
and all turns, whatever their session, should batch together.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from forge.controller import KeyAffinity, Router
from forge.controller.routing import ReplicaView, RouteRequest, least_loaded_of_two, rendezvous_score

__all__ = ["EnvSessionRouter", "SessionAffinity", "SessionKey"]


@dataclass(frozen=True)
class SessionKey:
    """Routes by ``session`` (and ``group`` for a session's first turn); batches with every other key."""

    session: str = field(compare=False)
    group: str = field(compare=False, default="")

    def __hash__(self) -> int:
        return hash(SessionKey)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SessionKey)

    def __repr__(self) -> str:
        return f"SessionKey({self.session!r}, group={self.group!r})"


class SessionAffinity(KeyAffinity):
    """Policy routing for turns: a session's turns stay on one replica, a group starts on one.

    - A session that ran a turn before goes back to that replica (its prefix is cached there)
      while the replica is under ``KeyAffinity.bound`` (``load_factor`` x the mean load plus
      ``slack``); past it the turn spills to the least-loaded replica, which it then sticks to.
    - A session's first turn goes to its group's replica, so all samples of a prompt share the
      prompt's prefix, under the same bound: that is the per-replica cap, which keeps groups
      from piling onto one replica.
    - A new group starts on the least-loaded replica (ties: rendezvous hashing of the group),
      so groups spread evenly instead of by the luck of a hash.

    Pins are kept for the ``max_sessions`` most recently used sessions and groups, in ordered
    dicts, so the work per request is O(replicas) whatever the number of live sessions.
    """

    def __init__(
        self, load_factor: float = 1.5, slack: int = 2, max_sessions: int = 100_000, seed: int | None = None
    ) -> None:
        super().__init__(load_factor=load_factor, slack=slack, batch_aware=False, seed=seed)
        if not (isinstance(max_sessions, int) and max_sessions >= 1):
            raise ValueError(f"SessionAffinity max_sessions must be an integer >= 1, got {max_sessions!r}")
        self.max_sessions = max_sessions
        self._pins: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._groups: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.spills = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> ReplicaView:
        key = request.key
        if not isinstance(key, SessionKey):
            return super().choose(request, replicas)
        bound = self.bound(replicas)
        pinned = self._pins.get(key.session)
        if pinned is None and key.group:
            pinned = self._groups.get(key.group)
        chosen: Any = None
        if pinned is not None:
            chosen = next((r for r in replicas if r.replica_id == pinned), None)
            if chosen is not None and chosen.in_flight >= bound:
                self.spills += 1
                chosen = None
        if chosen is None:
            least = min(r.in_flight for r in replicas)
            chosen = self.owner(key.group or key.session, [r for r in replicas if r.in_flight == least])
            if key.group and key.group not in self._groups:
                _remember(self._groups, key.group, chosen.replica_id, self.max_sessions)
        _remember(self._pins, key.session, chosen.replica_id, self.max_sessions)
        return chosen


def _remember(pins: collections.OrderedDict[str, int], name: str, replica_id: int, limit: int) -> None:
    pins[name] = replica_id
    pins.move_to_end(name)
    if len(pins) > limit:
        pins.popitem(last=False)  # forget the least recently used


class EnvSessionRouter(Router):
    """Environment routing: a session lives on exactly one env replica, its owner by rendezvous
    hashing of the session id (no spill: the episode's state is there and nowhere else). A
    replica that restarts loses its episodes, whose next step fails alone (``EnvError``)."""

    def __init__(self, seed: int | None = None) -> None:
        import random

        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> ReplicaView:
        key: Hashable = request.key
        if not isinstance(key, SessionKey):
            return least_loaded_of_two(replicas, self._rng)
        return max(replicas, key=lambda r: rendezvous_score(key.session, r.replica_id))
