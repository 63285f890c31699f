"""``NewestVersion``: a router that sends new work to the replicas serving the newest version.

A service whose replicas serve versions of something (a policy's weights, a model's revision)
can roll an update across them a few replicas at a time: the others keep serving meanwhile.
Which version a replica serves is service state (``Replica.version``), written by the service
alone (``Service.record_version``, and a resync hook's return value after a restart), so any
service can route by it. ``NewestVersion`` wraps another router: among the replicas that can
take the request, it lets the inner router choose among those on the newest version, so that
new work meets the newest weights, unless that replica holds ``slack`` more requests than the
less loaded of two others: then the request goes there (a rolling update never piles the whole
load onto the few replicas it has reached). A replica that is loading a version now
(``Replica.updating``, ``Service.record_updating``) gets new work only when every replica is.
Replicas with no recorded version count as the newest when none has one. Unlike the built-in
routers it scans the replicas per request (O(n)): it is meant for the tens of replicas of a
policy service, not for thousands.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol

from forge.checks import check_int
from forge.controller.routing import ReplicaView, Router, RouteRequest, least_loaded_of_two, make_router

__all__ = ["NewestVersion", "VersionedReplica"]


class VersionedReplica(ReplicaView, Protocol):
    """A replica as ``NewestVersion`` sees it: its load and the version it serves."""

    version: int | None
    updating: bool


class NewestVersion(Router):
    """Prefers replicas on the newest version, within a load bound (see the module's docstring)."""

    def __init__(self, inner: Any = "round_robin", slack: int = 4, seed: int = 0) -> None:
        check_int("NewestVersion slack", slack, 0)
        self.inner = make_router(inner)
        self.slack = slack
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, replicas: Sequence[VersionedReplica]) -> VersionedReplica:  # type: ignore[override]
        ready = [r for r in replicas if not getattr(r, "updating", False)] or replicas
        newest = self._on_newest(ready)
        if len(newest) == len(replicas):
            return self.inner.choose(request, replicas)  # type: ignore[return-value]
        chosen = self.inner.choose(request, newest)
        other = least_loaded_of_two(replicas, self._rng) if len(replicas) > 1 else chosen
        if chosen.in_flight > other.in_flight + self.slack:
            return other  # type: ignore[return-value]
        return chosen  # type: ignore[return-value]

    @staticmethod
    def _on_newest(replicas: Sequence[VersionedReplica]) -> Sequence[VersionedReplica]:
        """The replicas on the newest recorded version (all of them when none has one)."""
        top = max((r.version for r in replicas if r.version is not None), default=None)
        if top is None:
            return replicas
        return [r for r in replicas if r.version == top]
