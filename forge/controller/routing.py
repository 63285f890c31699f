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
- ``key_affinity``: consistent hashing of the similarity key (``HashRing``), so equal keys meet
  on one replica (where they share caches and batches) and only ~1/n of keys move when a
  replica joins or leaves. A request that names a batch queue goes back to the replica this
  router last sent that queue to while a batch of it is still forming there. When the chosen
  replica's load exceeds ``load_factor`` times the mean (plus ``slack``), the request spills to
  the less loaded of two other replicas, which bounds the imbalance a hot key can cause.
- ``model_aware``: the key is a model id; replicas that hold the model first, else the one with
  the fewest models; the default of multiplexed endpoints (``forge.controller.multiplex``).

Every built-in router does O(1) work per request in the number of replicas (O(log n) for a
lookup on the hash ring or among a subset of replicas), because a controller routes thousands of
items a step over as many replicas as it is given:

- placement is a bisection on a hash ring built once per replica-id space, not a hash per
  replica;
- the forming batch is looked for on one replica, the one the queue was last sent to;
- the mean load is a running total, re-summed once every n requests (amortised O(1));
- a spill or a new session takes the better of two random replicas, not the minimum of all;
- a model is looked for on its first few replicas along the ring and on the one it last went to.

Stickiness has one mechanism, ``Pins``: a bounded table of names (sessions, groups) pinned to
replicas, with an optional load bound past which a pinned request spills. ``Sticky``,
``svc.session()`` and the session routers of ``forge.envs`` all use it.
"""

from __future__ import annotations

import abc
import collections
import itertools
import math
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from forge.checks import check_int
from forge.controller.hash_ring import HashRing, index_by_id, rendezvous_score, stable_hash

__all__ = [
    "HashRing",
    "KeyAffinity",
    "LeastLoaded",
    "ModelAware",
    "Pins",
    "ReplicaView",
    "RoundRobin",
    "RouteRequest",
    "Router",
    "Sticky",
    "index_by_id",
    "least_loaded_of_two",
    "make_router",
    "register_router",
    "rendezvous_score",
    "replica_by_id",
    "stable_hash",
]


class ReplicaView(Protocol):
    """What a router may look at: identity, load and whether a key's batch is forming."""

    replica_id: int

    @property
    def in_flight(self) -> int: ...

    def has_forming(self, endpoint: str, key: Hashable) -> bool: ...


class RouteRequest(NamedTuple):
    """One request as a router sees it (a named tuple: immutable, and one call to make per route)."""

    endpoint: str
    key: Hashable = None
    """What the request is routed by (a similarity key, a session, a model id); None: no preference."""
    batch_key: Hashable = None
    """The batch queue the caller named on the replica (``route(..., batch_key=)``, or a
    multiplexed endpoint's model id). None: the endpoint's ``Batching.key`` or its one default
    queue decides, so no router can tell in advance where its batch forms."""


@dataclass
class RouteTrace:
    """Where one routed request went, for a caller that reports it (an HTTP server's response
    header): pass one to ``route(..., trace=)``; the service writes it as it sends each try."""

    replica_id: int | None = None
    """The replica the last try was sent to; None until the request leaves for one."""
    tries: int = 0
    """Tries sent so far (more than one: its replica died and it was sent again)."""


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


def least_loaded_of_two(replicas: Sequence[ReplicaView], rng: random.Random, skip: int | None = None) -> ReplicaView:
    """Power of two choices: two distinct random replicas, the one with fewer in flight.

    ``skip`` is an index into ``replicas`` that is not drawn (a spill leaves its owner out)
    unless it is the only replica.
    """
    n = len(replicas) if skip is None else len(replicas) - 1
    if n <= 1:
        if n == 1 and skip == 0:
            return replicas[1]
        return replicas[0]
    # Two distinct indices in range(n) without building a population (random.sample would).
    a = rng.randrange(n)
    b = rng.randrange(n - 1)
    b += b >= a
    if skip is not None:
        a += a >= skip
        b += b >= skip
    ra, rb = replicas[a], replicas[b]
    return ra if ra.in_flight <= rb.in_flight else rb


class LeastLoaded(Router):
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> ReplicaView:
        return least_loaded_of_two(replicas, self._rng)


def replica_by_id(replicas: Sequence[ReplicaView], replica_id: int) -> ReplicaView | None:
    """The replica ``replica_id`` among ``replicas`` (in replica-id order), or None; see ``index_by_id``."""
    i = index_by_id(replicas, replica_id)
    return None if i is None else replicas[i]


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
    """The key is a session id: the first request of a session goes to the less loaded of two
    random replicas, later ones follow it while it can take traffic (``Pins``, no load bound).
    Requests without a key are balanced the same way.

    ``session_of`` maps a request's key to the session it pins (default: the key itself), and
    ``place`` picks a new session's replica (default: the less loaded of two random ones), so a
    router with another first choice (``forge.envs.EnvSessionRouter``) is this one, configured."""

    def __init__(
        self,
        seed: int | None = None,
        max_sessions: int = 100_000,
        *,
        session_of: Callable[[Hashable], Hashable] | None = None,
        place: Callable[[Hashable, Sequence[ReplicaView]], ReplicaView] | None = None,
    ) -> None:
        self._rng = random.Random(seed)
        self.pins = Pins(max_sessions)
        self._session_of = session_of
        self._place = place

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> ReplicaView:
        if request.key is None:
            return least_loaded_of_two(replicas, self._rng)
        session = request.key if self._session_of is None else self._session_of(request.key)
        chosen = self.pins.get(session, replicas)
        if chosen is None:
            chosen = least_loaded_of_two(replicas, self._rng) if self._place is None else self._place(session, replicas)
            self.pins.pin(session, chosen)
        return chosen


class KeyAffinity(Router):
    """Consistent hashing on the key with a bound on load imbalance; see the module docstring.

    Args:
        load_factor: a replica may hold up to ``load_factor`` x the mean in-flight load
            (plus ``slack`` requests) before keyed requests spill off it.
        slack: absolute headroom, so that tiny loads (0 vs 1) never count as imbalance.
        batch_aware: a request that names its batch queue (``RouteRequest.batch_key``) goes
            back to the replica this router last sent that queue to, while a batch of it is
            forming there and it is under the bound.
        max_keys: how many batch queues (and, for ``ModelAware``, models) the router remembers
            the last replica of; the least recently used are forgotten.
    """

    def __init__(
        self,
        load_factor: float = 1.5,
        slack: int = 2,
        batch_aware: bool = True,
        seed: int | None = None,
        max_keys: int = 100_000,
    ):
        if not (isinstance(load_factor, (int, float)) and load_factor >= 1.0):
            raise ValueError(f"KeyAffinity load_factor must be a number >= 1.0, got {load_factor!r}")
        if not (isinstance(slack, int) and slack >= 0):
            raise ValueError(f"KeyAffinity slack must be an integer >= 0, got {slack!r}")
        self.load_factor = float(load_factor)
        self.slack = slack
        self.batch_aware = batch_aware
        self.ring = HashRing()
        self._rng = random.Random(seed)
        self._last = Pins(max_keys)  # (endpoint, batch_key) or model id -> the replica it last went to
        # The running total of in-flight requests behind the mean; see ``bound``.
        self._total = 0
        self._placed = 0
        self._count = 0

    def bound(self, replicas: Sequence[ReplicaView]) -> int:
        """Most in-flight requests a replica may hold before keyed traffic spills off it.

        Call once per request placed. The total behind the mean is summed over ``replicas``
        once every ``len(replicas)`` calls (or when their number changes) and counts the
        requests placed in between, so it costs O(1) amortised. Between sums it lags the true
        total by the requests that finished, or that other routers placed, since the last one,
        at most ``len(replicas)`` requests ago.
        """
        n = len(replicas)
        if self._placed >= n or self._count != n:
            self._total = sum(r.in_flight for r in replicas)
            self._placed, self._count = 0, n
        self._total += 1  # counting the request being placed
        self._placed += 1
        return math.ceil(self.load_factor * self._total / n) + self.slack

    def owner(self, key: Hashable, replicas: Sequence[ReplicaView]) -> ReplicaView:
        """``key``'s replica on the hash ring, whatever the load."""
        return replicas[self.ring.owner(key, replicas)]

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> ReplicaView:
        if request.key is None:
            return least_loaded_of_two(replicas, self._rng)
        bound = self.bound(replicas)
        if not (self.batch_aware and request.batch_key is not None):
            return self._by_key(request.key, replicas, bound)
        queue = (request.endpoint, request.batch_key)
        chosen = self._last.get(queue, replicas)
        if chosen is None or chosen.in_flight >= bound or not chosen.has_forming(*queue):
            chosen = self._by_key(request.key, replicas, bound)
        self._last.pin(queue, chosen)
        return chosen

    def _by_key(self, key: Hashable, replicas: Sequence[ReplicaView], bound: int) -> ReplicaView:
        """The key's owner under the bound, else the less loaded of two other replicas."""
        owner = self.ring.owner(key, replicas)
        if replicas[owner].in_flight < bound:
            return replicas[owner]
        return least_loaded_of_two(replicas, self._rng, skip=owner)


class ModelReplicaView(ReplicaView, Protocol):
    """What ``ModelAware`` looks at besides load: which models a replica holds, and how many."""

    def has_model(self, model_id: Hashable) -> bool: ...

    @property
    def num_models(self) -> int: ...


class ModelAware(KeyAffinity):
    """Model-aware routing for multiplexed endpoints; the key is the model id.

    A model's places are its first ``candidates`` replicas along the hash ring, and the
    replica this router last sent it to. Among them, a replica that holds the model (loaded,
    loading or waiting to load) takes the request, preferring one where a batch for the model
    is forming, then the least loaded. Failing that, the one with the fewest models (ties:
    least loaded, then the first in ring order, so that equal states agree). Both stay within
    ``KeyAffinity.bound``: a hot model whose places are all past it goes to the less loaded of
    two random replicas, which loads it, and is remembered as its last replica. Looking at a
    few places, not every replica, keeps the cost per request flat in the number of replicas;
    with ``candidates`` replicas or fewer, every replica is a place. Other arguments as for
    ``KeyAffinity``.

    The bound is looser than ``KeyAffinity``'s by default (2x the mean plus 8, not 1.5x plus
    2): a spill costs a model load, and often an eviction that costs another, so the bound
    should catch a hot model's sustained excess, not the noise of a burst. (In a simulation
    of 6 models on 3 replicas of capacity 2, bursts of 48 requests made 1.5x+2 load 11 to 43
    models where 6 suffice; 2x+8 loaded 6.)
    """

    def __init__(
        self,
        load_factor: float = 2.0,
        slack: int = 8,
        batch_aware: bool = True,
        seed: int | None = None,
        max_keys: int = 100_000,
        candidates: int = 8,
    ):
        super().__init__(load_factor=load_factor, slack=slack, batch_aware=batch_aware, seed=seed, max_keys=max_keys)
        check_int("ModelAware candidates", candidates, 1)
        self.candidates = candidates

    def places(self, model_id: Hashable, replicas: Sequence[ModelReplicaView]) -> list[ModelReplicaView]:
        """Where ``model_id`` is looked for and loaded: its first ``candidates`` replicas on
        the ring, and the replica it last went to."""
        places = [replicas[i] for i in self.ring.walk(model_id, replicas, self.candidates)]
        last = self._last.get(model_id, replicas)
        if last is not None and all(last is not r for r in places):
            places.append(last)  # type: ignore[arg-type]
        return places

    def choose(  # type: ignore[override]
        self, request: RouteRequest, replicas: Sequence[ModelReplicaView]
    ) -> ModelReplicaView:
        model_id = request.key
        if model_id is None:
            return least_loaded_of_two(replicas, self._rng)  # type: ignore[return-value]
        bound = self.bound(replicas)
        within = [r for r in self.places(model_id, replicas) if r.in_flight < bound]
        holders = [r for r in within if r.has_model(model_id)]
        if holders:
            if self.batch_aware:
                holders = [r for r in holders if r.has_forming(request.endpoint, model_id)] or holders
            chosen = min(holders, key=lambda r: r.in_flight)
        elif within:
            # The fewest models, then the least loaded; ties go to the first in ring order
            # (``min`` keeps the first), so that routers seeing equal states agree.
            chosen = min(within, key=lambda r: (r.num_models, r.in_flight))
        else:
            chosen = least_loaded_of_two(replicas, self._rng)  # type: ignore[assignment]
        self._last.pin(model_id, chosen)
        return chosen


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
