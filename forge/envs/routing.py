"""Routing keys and routers of multi-turn rollouts.

A trajectory is a *session*: every turn after the first extends the same token history, so it
belongs on the policy replica that already holds that history's KV blocks in vLLM's prefix
cache. The samples of one prompt (a GRPO group) share the prompt itself, so they all start on
one replica too.

A request's key only routes it; the turns and steps of all sessions share the endpoint's one
batch queue on a replica (no ``batch_key``), so they batch together whatever their session.
The key is a plain session id, or a ``SessionKey`` where a session's first turn should join its
group. Both routers keep their sessions in ``forge.controller.routing.Pins``, the service
layer's one stickiness mechanism.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from forge.checks import check_int
from forge.controller import KeyAffinity, Sticky
from forge.controller.routing import Pins, ReplicaView, RouteRequest, least_loaded_of_two, rendezvous_score

__all__ = ["EnvSessionRouter", "SessionAffinity", "SessionKey"]


@dataclass(frozen=True)
class SessionKey:
    """A turn's routing key: its ``session``, and the ``group`` (the prompt's samples) whose
    replica a session's first turn joins. Equal when both are equal."""

    session: str
    group: str = ""


def _session_and_group(key: Hashable) -> tuple[Hashable, str]:
    """A ``SessionKey``'s session and group; any other key is a session without a group."""
    if isinstance(key, SessionKey):
        return key.session, key.group
    return key, ""


class SessionAffinity(KeyAffinity):
    """Policy routing for turns: a session's turns stay on one replica, a group starts on one.

    The key is a ``SessionKey`` (or a plain session id, for a session without a group).

    - A session that ran a turn before goes back to that replica (its prefix is cached there)
      while the replica is under ``KeyAffinity.bound`` (``load_factor`` x the mean load plus
      ``slack``); past it the turn spills to the least-loaded replica, which it then sticks to.
    - A session's first turn goes to its group's replica, so all samples of a prompt share the
      prompt's prefix, under the same bound: that is the per-replica cap, which keeps groups
      from piling onto one replica.
    - A new group starts on the least-loaded replica (ties: rendezvous hashing of the group),
      so groups spread evenly instead of by the luck of a hash.

    Sessions and groups are two ``Pins`` tables of the ``max_sessions`` most recently used
    names each; ``spills`` counts the turns that left a pinned replica at its bound.
    """

    def __init__(
        self, load_factor: float = 1.5, slack: int = 2, max_sessions: int = 100_000, seed: int | None = None
    ) -> None:
        super().__init__(load_factor=load_factor, slack=slack, batch_aware=False, seed=seed)
        check_int("SessionAffinity max_sessions", max_sessions, 1)
        self.sessions = Pins(max_sessions)
        self.groups = Pins(max_sessions)

    @property
    def spills(self) -> int:
        return self.sessions.spills + self.groups.spills

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> ReplicaView:
        if request.key is None:
            return least_loaded_of_two(replicas, self._rng)
        session, group = _session_and_group(request.key)
        bound = self.bound(replicas)
        if session in self.sessions:
            chosen = self.sessions.get(session, replicas, bound)
        else:
            chosen = self.groups.get(group, replicas, bound) if group else None
        if chosen is None:
            least = min(r.in_flight for r in replicas)
            chosen = self.owner(group or session, [r for r in replicas if r.in_flight == least])
            if group and group not in self.groups:
                self.groups.pin(group, chosen)
        self.sessions.pin(session, chosen)
        return chosen


class EnvSessionRouter(Sticky):
    """Environment routing: a session lives on exactly one env replica (the episode's state is
    there and nowhere else), so it never spills. Its first call goes to the owner of the session
    id by rendezvous hashing, which is pinned (``Sticky``: ``Pins``, no load bound); a session
    whose pin was forgotten (past ``max_sessions``) finds the same owner again while the replicas
    are the same. A replica that restarts loses its episodes, whose next step fails alone
    (``EnvError``)."""

    def __init__(self, seed: int | None = None, max_sessions: int = 100_000) -> None:
        super().__init__(seed, max_sessions, session_of=_session, place=_owner)


def _session(key: Hashable) -> Hashable:
    return _session_and_group(key)[0]


def _owner(session: Hashable, replicas: Sequence[ReplicaView]) -> ReplicaView:
    """The replica that owns ``session`` by rendezvous hashing (the same while the replicas are)."""
    return max(replicas, key=lambda r: rendezvous_score(session, r.replica_id))
