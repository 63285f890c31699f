"""Consistent hashing of keys onto replica ids, the placement behind ``key_affinity`` and
``model_aware`` (``forge.controller.routing``): a key's replica in O(log n), the same in every
process, and only the keys of a replica that leaves or joins move."""

from __future__ import annotations

import bisect
import collections
import hashlib
import heapq
from array import array
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from forge.checks import check_int

if TYPE_CHECKING:
    from forge.controller.routing import ReplicaView

__all__ = ["HashRing", "index_by_id", "rendezvous_score", "stable_hash"]


def index_by_id(replicas: Sequence[ReplicaView], replica_id: int) -> int | None:
    """The index of replica ``replica_id`` in ``replicas``, or None if it is not one of them.

    The service passes replicas in replica-id order, a subsequence of 0..n-1: while every replica
    is a candidate, replica i is at index i (O(1)); otherwise bisection finds it (O(log n)).
    """
    if replica_id < len(replicas) and replicas[replica_id].replica_id == replica_id:
        return replica_id
    i = bisect.bisect_left(replicas, replica_id, key=lambda r: r.replica_id)
    if i < len(replicas) and replicas[i].replica_id == replica_id:
        return i
    return None


def stable_hash(value: Hashable, digest_size: int = 8) -> int:
    """A hash of ``repr(value)`` that is the same in every process (``hash()`` of a str is
    salted per process, so placement by it would differ between a run and its restart)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=digest_size).digest(), "big")


def rendezvous_score(key: Hashable, replica_id: int) -> int:
    """Stable (process-independent) hash of (key, replica): the highest score owns the key."""
    digest = hashlib.blake2b(f"{key!r}|{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class HashRing:
    """Consistent hashing of keys onto replica ids: O(log n) per lookup, built once.

    Each replica id owns ``points`` pseudo-random points on a 32-bit circle; a key belongs to
    the first point at or after its own hash whose replica is among the candidates. The
    points depend on the id alone, so the ring is built for ids 0..space-1 and never for a
    set of candidates: a replica that leaves is a hole the walk steps over (its keys go to the
    next points, which belong to many replicas, ~1/n of the keys in all), one that comes back
    takes its keys back, and a new highest id adds its points and takes only the keys that
    land on them. ``space`` grows to the highest id seen and never shrinks, so which replica
    is the highest never moves a key.

    A walk takes one step per absent replica's point, about space / len(candidates) steps.
    Where fewer than 1 in ``_SPARSE`` ids are candidates (a small subset, or most replicas
    down) rendezvous hashing over the candidates is cheaper (O(len(candidates))) and is used
    instead; keys may move when a set crosses that line.
    """

    _SPARSE = 8
    _MAX_ORDERS = 10_000  # keys whose ring order ``walk`` keeps (models: few and looked up often)
    _ID_BITS = 32  # a point is (hash << 32) | replica_id, so one sorted array holds both

    def __init__(self, points: int = 128) -> None:
        check_int("HashRing points", points, 1)
        self.points = points
        self.space = 0
        self._ring = array("Q")
        self._orders: collections.OrderedDict[Hashable, tuple[int, tuple[int, ...]]] = collections.OrderedDict()

    def _grow(self, space: int) -> None:
        if space > 1 << self._ID_BITS:
            raise ValueError(f"HashRing holds replica ids below 2**{self._ID_BITS}, got {space - 1}")
        new = [
            (stable_hash((replica_id, p), 4) << self._ID_BITS) | replica_id
            for replica_id in range(self.space, space)
            for p in range(self.points)
        ]
        self._ring = array("Q", sorted([*self._ring, *new]))
        self.space = space
        self._orders.clear()  # the new ids' points come before some keys' next ids

    def _dense(self, replicas: Sequence[ReplicaView]) -> bool:
        top = replicas[-1].replica_id + 1
        if top > self.space:
            self._grow(top)
        return len(replicas) * self._SPARSE >= self.space

    def walk(self, key: Hashable, replicas: Sequence[ReplicaView], count: int) -> list[int]:
        """The indices into ``replicas`` (in replica-id order) of ``key``'s first ``count``
        distinct replicas in ring order, its owner first (all of them if there are fewer)."""
        count = min(count, len(replicas))
        if not self._dense(replicas):
            return heapq.nlargest(
                count, range(len(replicas)), key=lambda i: rendezvous_score(key, replicas[i].replica_id)
            )
        found: list[int] = []
        for replica_id in self._order(key, 2 * count):
            index = index_by_id(replicas, replica_id)
            if index is not None:
                found.append(index)
                if len(found) == count:
                    return found
        # Most of the key's first ids are not candidates: walk the ring itself.
        ring, mask, found = self._ring, (1 << self._ID_BITS) - 1, []
        i = bisect.bisect_left(ring, stable_hash(key, 4) << self._ID_BITS)
        while len(found) < count:  # ends: each id below ``space`` has points on the ring
            index = index_by_id(replicas, ring[i % len(ring)] & mask)
            if index is not None and index not in found:
                found.append(index)
            i += 1
        return found

    def _order(self, key: Hashable, count: int) -> tuple[int, ...]:
        """``key``'s first ``count`` distinct replica ids in ring order over every id below
        ``space``, whoever is a candidate: cached per key (a model's places are looked up on
        every request) and forgotten when the ring grows."""
        cached = self._orders.get(key)
        if cached is not None and cached[0] == count:
            self._orders.move_to_end(key)
            return cached[1]
        ring, mask, ids = self._ring, (1 << self._ID_BITS) - 1, []
        i = bisect.bisect_left(ring, stable_hash(key, 4) << self._ID_BITS)
        for step in range(len(ring)):
            replica_id = ring[(i + step) % len(ring)] & mask
            if replica_id not in ids:
                ids.append(replica_id)
                if len(ids) == count:
                    break
        self._orders[key] = (count, tuple(ids))
        if len(self._orders) > self._MAX_ORDERS:
            self._orders.popitem(last=False)
        return tuple(ids)

    def owner(self, key: Hashable, replicas: Sequence[ReplicaView]) -> int:
        """The index into ``replicas`` of ``key``'s owner: the first replica of its walk."""
        if not self._dense(replicas):
            return max(range(len(replicas)), key=lambda i: rendezvous_score(key, replicas[i].replica_id))
        # ``walk`` for one replica, without its list: this is the hot path of every keyed request.
        ring, mask = self._ring, (1 << self._ID_BITS) - 1
        i = bisect.bisect_left(ring, stable_hash(key, 4) << self._ID_BITS)
        while True:  # ends: a dense set has a replica, and each id below ``space`` has points
            index = index_by_id(replicas, ring[i % len(ring)] & mask)
            if index is not None:
                return index
            i += 1
