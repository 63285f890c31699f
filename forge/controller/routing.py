"""Routers: which healthy replica takes a request.

A router is a class with one method, ``choose(request, replicas) -> replica``. The service
passes only replicas that can take traffic, in replica-id order, never an empty list. Routers
are per endpoint: a service has a default and may override it per endpoint; users plug in their
own class.

A request has two keys, each with one meaning (``RouteRequest``): ``key`` chooses the replica,
``batch_key`` the batch queue on it. A router reads ``key``; only batch-aware preference reads
``batch_key``. A multiplexed endpoint's model id is both.

Built in:

- ``round_robin``: each replica in turn.
- ``least_loaded``: power of two choices on in-flight counts (two random replicas, the less
  loaded wins): near-optimal balance without scanning every replica.
- ``sticky``: the key is a session id; a session stays on its replica while it is healthy.
- ``key_affinity``: rendezvous hashing of the similarity key, so equal keys meet on one replica
  (where they share caches and batches) and only ~1/n of keys move when a replica joins or
  leaves. A request that names a batch queue goes where a batch of that queue is already
  forming. When the chosen replica's load exceeds ``load_factor`` times the mean (plus
  ``slack``), the request spills to the least-loaded replica, which bounds the imbalance a hot
  key can cause.
- ``model_aware``: the key is a model id; replicas that hold the model first, else the one with
  the fewest models; the default of multiplexed endpoints (``forge.controller.multiplex``).

Stickiness has one mechanism, ``Pins``: a bounded table of names (sessions, groups) pinned to
replicas, with an optional load bound past which a pinned request spills. ``Sticky``,
``svc.session()`` and the session routers of ``forge.envs`` all use it.
"""

from __future__ import annotations

import abc
import bisect
import collections
import hashlib
import itertools
import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from forge.checks import check_int


class ReplicaView(Protocol):
    """What a router may look at: identity, load and whether a key's batch is forming."""

    replica_id: int

    @property
    def in_flight(self) -> int: ...

    def has_forming(self, endpoint: str, key: Hashable) -> bool: ...


@dataclass(frozen=True)
class RouteRequest:
    """One request as a router sees it."""

    endpoint: str
    key: Hashable = None
    """What the request is routed by (a similarity key, a session, a model id); None: no preference."""
    batch_key: Hashable = None
    """The batch queue the caller named on the replica (``route(..., batch_key=)``, or a
    multiplexed endpoint's model id). None: the endpoint's ``Batching.key`` or its one default
    queue decides, so no router can tell in advance where its batch forms."""


class Router(abc.ABC):
    """Chooses a replica for one request. Subclass and pass the class (or an instance)."""

    @abc.abstractmethod
    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> ReplicaView:
        """Return one of ``replicas`` (never empty) for ``request``."""


class RoundRobin(Router):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> ReplicaView:
        return replicas[next(self._counter) % len(replicas)]


def least_loaded_of_two(replicas: Sequence[ReplicaView], rng: random.Random) -> ReplicaView:
    """Power of two choices: two distinct random replicas, the one with fewer in flight."""
    if len(replicas) == 1:
        return replicas[0]
    a, b = rng.sample(range(len(replicas)), 2)
    ra, rb = replicas[a], replicas[b]
    return ra if ra.in_flight <= rb.in_flight else rb


class LeastLoaded(Router):
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> ReplicaView:
        return least_loaded_of_two(replicas, self._rng)


def replica_by_id(replicas: Sequence[ReplicaView], replica_id: int) -> ReplicaView | None:
    """The replica ``replica_id`` among ``replicas``, or None if it is not one of them.

    The service passes replicas in replica-id order, a subsequence of 0..n-1: while every replica
    is a candidate, replica i is at index i (O(1)); otherwise bisection finds it (O(log n)).
    """
    if replica_id < len(replicas) and replicas[replica_id].replica_id == replica_id:
        return replicas[replica_id]
    i = bisect.bisect_left(replicas, replica_id, key=lambda r: r.replica_id)
    if i < len(replicas) and replicas[i].replica_id == replica_id:
        return replicas[i]
    return None


class Pins:
    """Sticky placement: names (sessions, groups) pinned to the replica that took them.

    ``get`` returns a name's replica while it is among the candidates and, with a ``bound``,
    holds fewer than ``bound`` requests; otherwise None, and the caller chooses anew and
    ``pin``s the choice (past the bound that is a *spill*, counted in ``spills``). The table
    keeps the ``max_names`` most recently used names, in an ordered dict, so each call costs
    O(1) whatever the number of live sessions (plus ``replica_by_id``).
    """

    def __init__(self, max_names: int = 100_000) -> None:
        check_int("Pins max_names", max_names, 1)
        self.max_names = max_names
        self.spills = 0
        self._pins: collections.OrderedDict[Hashable, int] = collections.OrderedDict()

    def get(self, name: Hashable, replicas: Sequence[ReplicaView], bound: int | None = None) -> ReplicaView | None:
        """``name``'s replica if it may take one more request now; None if ``name`` is not
        pinned, its replica is not among ``replicas``, or it is at ``bound``."""
        replica_id = self._pins.get(name)
        if replica_id is None:
            return None
        replica = replica_by_id(replicas, replica_id)
        if replica is None:
            return None
        if bound is not None and replica.in_flight >= bound:
            self.spills += 1
            return None
        self._pins.move_to_end(name)
        return replica

    def pin(self, name: Hashable, replica: ReplicaView) -> None:
        """Pin ``name`` to ``replica``, forgetting the least recently used name past ``max_names``."""
        self._pins[name] = replica.replica_id
        self._pins.move_to_end(name)
        if len(self._pins) > self.max_names:
            self._pins.popitem(last=False)

    def forget(self, name: Hashable) -> None:
        self._pins.pop(name, None)

    def names(self) -> list[Hashable]:
        """The pinned names, least recently used first."""
        return list(self._pins)

    def __contains__(self, name: object) -> bool:
        return name in self._pins

    def __len__(self) -> int:
        return len(self._pins)


class Sticky(Router):
    """The key is a session id: the first request of a session picks the least-loaded replica,
    later ones follow it while it can take traffic (``Pins``, no load bound). Requests without
    a key are balanced."""

    def __init__(self, seed: int | None = None, max_sessions: int = 100_000) -> None:
        self._rng = random.Random(seed)
        self.pins = Pins(max_sessions)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> ReplicaView:
        if request.key is None:
            return least_loaded_of_two(replicas, self._rng)
        chosen = self.pins.get(request.key, replicas)
        if chosen is None:
            chosen = min(replicas, key=lambda r: r.in_flight)
            self.pins.pin(request.key, chosen)
        return chosen


def rendezvous_score(key: Hashable, replica_id: int) -> int:
    """Stable (process-independent) hash of (key, replica): the highest score owns the key."""
    digest = hashlib.blake2b(f"{key!r}|{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class KeyAffinity(Router):
    """Rendezvous hashing on the key with a bound on load imbalance; see the module docstring.

    Args:
        load_factor: a replica may hold up to ``load_factor`` x the mean in-flight load
            (plus ``slack`` requests) before keyed requests spill off it.
        slack: absolute headroom, so that tiny loads (0 vs 1) never count as imbalance.
        batch_aware: a request that names its batch queue (``RouteRequest.batch_key``) prefers a
            replica where a batch of that queue is already forming.
    """

    def __init__(self, load_factor: float = 1.5, slack: int = 2, batch_aware: bool = True, seed: int | None = None):
        if not (isinstance(load_factor, (int, float)) and load_factor >= 1.0):
            raise ValueError(f"KeyAffinity load_factor must be a number >= 1.0, got {load_factor!r}")
        if not (isinstance(slack, int) and slack >= 0):
            raise ValueError(f"KeyAffinity slack must be an integer >= 0, got {slack!r}")
        self.load_factor = float(load_factor)
        self.slack = slack
        self.batch_aware = batch_aware
        self._rng = random.Random(seed)

    def bound(self, replicas: Sequence[ReplicaView]) -> int:
        """Most in-flight requests a replica may hold before keyed traffic spills off it."""
        total = sum(r.in_flight for r in replicas) + 1  # counting the request being placed
        return math.ceil(self.load_factor * total / len(replicas)) + self.slack

    def owner(self, key: Hashable, replicas: Sequence[ReplicaView]) -> ReplicaView:
        return max(replicas, key=lambda r: rendezvous_score(key, r.replica_id))

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> ReplicaView:
        if request.key is None:
            return least_loaded_of_two(replicas, self._rng)
        bound = self.bound(replicas)
        if self.batch_aware and request.batch_key is not None:
            batch_key = request.batch_key
            forming = [r for r in replicas if r.has_forming(request.endpoint, batch_key) and r.in_flight < bound]
            if forming:
                return min(forming, key=lambda r: r.in_flight)
        owner = self.owner(request.key, replicas)
        if owner.in_flight < bound:
            return owner
        return min(replicas, key=lambda r: r.in_flight)


class ModelReplicaView(ReplicaView, Protocol):
    """What ``ModelAware`` looks at besides load: which models a replica holds, and how many."""

    def has_model(self, model_id: Hashable) -> bool: ...

    @property
    def num_models(self) -> int: ...


class ModelAware(KeyAffinity):
    """Model-aware routing for multiplexed endpoints; the key is the model id.

    A replica that holds the model (loaded, loading or waiting to load) takes the request,
    preferring one where a batch for the model is forming, then the least loaded. Failing
    that, a replica with the fewest models (ties: least loaded, then rendezvous hashing, so
    that equal states agree). Both stay within ``KeyAffinity.bound``: a hot model whose
    replicas are past it is loaded on one more replica. Arguments as for ``KeyAffinity``.

    The bound is looser than ``KeyAffinity``'s by default (2x the mean plus 8, not 1.5x plus
    2): a spill costs a model load, and often an eviction that costs another, so the bound
    should catch a hot model's sustained excess, not the noise of a burst. (In a simulation
    of 6 models on 3 replicas of capacity 2, bursts of 48 requests made 1.5x+2 load 11 to 43
    models where 6 suffice; 2x+8 loaded 6.)
    """

    def __init__(self, load_factor: float = 2.0, slack: int = 8, batch_aware: bool = True, seed: int | None = None):
        super().__init__(load_factor=load_factor, slack=slack, batch_aware=batch_aware, seed=seed)

    def choose(  # type: ignore[override]
        self, request: RouteRequest, replicas: Sequence[ModelReplicaView]
    ) -> ModelReplicaView:
        model_id = request.key
        if model_id is None:
            return least_loaded_of_two(replicas, self._rng)  # type: ignore[return-value]
        bound = self.bound(replicas)
        within = [r for r in replicas if r.in_flight < bound] or list(replicas)
        holders = [r for r in within if r.has_model(model_id)]
        if holders:
            if self.batch_aware:
                holders = [r for r in holders if r.has_forming(request.endpoint, model_id)] or holders
            return min(holders, key=lambda r: r.in_flight)
        fewest = min(r.num_models for r in within)
        ties = [r for r in within if r.num_models == fewest]
        least = min(r.in_flight for r in ties)
        return self.owner(model_id, [r for r in ties if r.in_flight == least])  # type: ignore[return-value]


_REGISTRY: dict[str, type[Router]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "sticky": Sticky,
    "key_affinity": KeyAffinity,
    "model_aware": ModelAware,
}


def register_router(name: str, cls: type[Router]) -> None:
    """Make ``cls`` available as ``router=name``. Names are unique."""
    if name in _REGISTRY:
        raise ValueError(f"a router named {name!r} is already registered ({_REGISTRY[name].__name__})")
    if not (isinstance(cls, type) and issubclass(cls, Router)):
        raise TypeError(f"register_router needs a Router subclass, got {cls!r}")
    _REGISTRY[name] = cls


def make_router(spec: Any) -> Router:
    """A fresh router from a registered name, a Router subclass, or an instance (used as is)."""
    if isinstance(spec, Router):
        return spec
    if isinstance(spec, str):
        if spec not in _REGISTRY:
            raise ValueError(f"unknown router {spec!r}; expected one of {sorted(_REGISTRY)} or a Router subclass")
        return _REGISTRY[spec]()
    if isinstance(spec, type) and issubclass(spec, Router):
        return spec()
    raise TypeError(f"router must be a name in {sorted(_REGISTRY)}, a Router subclass or instance, got {spec!r}")
