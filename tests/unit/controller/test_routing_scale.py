"""Routers at many replicas: consistent placement, bounded imbalance, batch and model
preference, all with O(1) work per request (the speed itself is ``benchmarks/router_scale.py``'s).

The tolerances are derived, not tuned. On a ``HashRing`` with P points per replica, a replica's
share of the keys deviates from 1/n with a relative standard deviation of about 1/sqrt(P); over K
keys, sampling adds a binomial standard deviation of sqrt(K/n). The tests allow four of each: with
P = 128 that is 1.35/n of the keys plus 4 sqrt(K/n) keys.
"""

import collections
import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from forge.controller import KeyAffinity, ModelAware, RouteRequest
from forge.controller.routing import HashRing, Sticky, least_loaded_of_two

KEYS = [f"prompt-{i}" for i in range(10_000)]


@dataclass
class View:
    replica_id: int
    in_flight: int = 0
    forming: set = field(default_factory=set)
    models: set = field(default_factory=set)

    def has_forming(self, endpoint, key):
        return (endpoint, key) in self.forming

    def has_model(self, model_id):
        return model_id in self.models

    @property
    def num_models(self):
        return len(self.models)


def views(ids):
    return [View(i) for i in ids]


def most_moved(ideal_share: float) -> int:
    """The most keys of ``KEYS`` one replica may take or give up when its ideal share is
    ``ideal_share``: the ring's spread and the sampling spread, four standard deviations each."""
    points = HashRing().points
    mean = len(KEYS) * ideal_share
    return math.ceil(mean * (1 + 4 / math.sqrt(points)) + 4 * math.sqrt(mean))


def owners(ring, reps):
    return {k: reps[ring.owner(k, reps)].replica_id for k in KEYS}


@pytest.mark.parametrize("n", [8, 64])
def test_a_joining_replica_takes_only_its_share_of_keys(n):
    ring = HashRing()
    before = owners(ring, views(range(n)))
    after = owners(ring, views(range(n + 1)))
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == n for k in moved)  # every moved key went to the new replica
    assert 0 < len(moved) <= most_moved(1 / (n + 1))


@pytest.mark.parametrize("n", [8, 64])
@pytest.mark.parametrize("leaving", ["middle", "highest"])
def test_a_leaving_replica_gives_up_only_its_keys_and_takes_them_back_on_return(n, leaving):
    ring = HashRing()
    reps = views(range(n))
    gone = n // 2 if leaving == "middle" else n - 1
    before = owners(ring, reps)
    after = owners(ring, [r for r in reps if r.replica_id != gone])
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved and all(before[k] == gone for k in moved)
    assert len(moved) <= most_moved(1 / n)
    spread = collections.Counter(after[k] for k in moved)
    assert len(spread) > min(n - 1, 8) // 2  # its keys spread over many replicas, not one neighbour
    assert owners(ring, reps) == before  # back: every key is where it was


def test_distinct_keys_spread_within_the_rings_tolerance():
    n = 8
    counts = collections.Counter(owners(HashRing(), views(range(n))).values())
    assert len(counts) == n and max(counts.values()) <= most_moved(1 / n)


def test_placement_is_the_same_in_processes_with_different_str_hashes():
    """Placement must survive a controller restart, so it may not use the salted hash()."""
    code = (
        "from forge.controller.routing import KeyAffinity\n"
        "from dataclasses import dataclass\n"
        "@dataclass\nclass V:\n    replica_id: int\n    in_flight: int = 0\n"
        "reps, router = [V(i) for i in range(64)], KeyAffinity()\n"
        "print([router.owner(f'k{i}', reps).replica_id for i in range(200)])"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(runs) == 1


def test_equal_keys_meet_on_one_replica_among_many_and_other_routers_agree():
    reps = views(range(1024))
    routers = [KeyAffinity(load_factor=100), KeyAffinity(load_factor=100)]
    for key in KEYS[:200]:
        chosen = {r.choose(RouteRequest("ep", key), reps).replica_id for r in routers for _ in range(3)}
        assert len(chosen) == 1


def test_keys_reach_their_owner_when_most_replicas_are_down():
    """Fewer than 1 id in 8 up: the ring gives way to rendezvous hashing over the few, which
    still sends equal keys to one replica and spreads distinct ones."""
    r = KeyAffinity(load_factor=100)
    everyone = views(range(256))
    r.owner("warm", everyone)  # the ring has seen 256 ids
    few = everyone[::64]
    chosen = collections.Counter(r.choose(RouteRequest("ep", k), few).replica_id for k in KEYS[:400])
    assert set(chosen) == {0, 64, 128, 192}
    assert all(r.choose(RouteRequest("ep", k), few) is r.owner(k, few) for k in KEYS[:50])


def test_a_hot_key_is_held_to_the_load_bound_in_a_steady_stream():
    """One key takes a third of a stream over 16 replicas that holds 4 requests per replica
    (each arrival once full retires the oldest): its owner fills to the bound and no further,
    and the rest spill. In steady state the total is 4n, and the running total the bound reads
    is at most n placements stale, so the bound never exceeds ceil(1.5 * (4 + 1)) + 2."""
    n, window = 16, 64
    r = KeyAffinity(load_factor=1.5, slack=2, seed=0)
    rng = random.Random(0)
    reps = views(range(n))
    owner = r.owner("hot", reps)
    cap = math.ceil(r.load_factor * (window / n + 1)) + r.slack
    queue, peak, hot_elsewhere = collections.deque(), 0, 0
    for _ in range(5_000):
        key = "hot" if rng.random() < 1 / 3 else rng.choice(KEYS)
        chosen = r.choose(RouteRequest("ep", key), reps)
        hot_elsewhere += key == "hot" and chosen is not owner
        chosen.in_flight += 1
        queue.append(chosen)
        if len(queue) > window:
            queue.popleft().in_flight -= 1
        peak = max(peak, max(x.in_flight for x in reps))
    assert peak <= cap
    assert owner.in_flight >= window / n  # affinity holds it above the mean ...
    assert hot_elsewhere > 1_000  # ... and the excess spilled


def test_a_spill_never_lands_on_the_owner():
    rng = random.Random(0)
    reps = views(range(5))
    assert all(least_loaded_of_two(reps, rng, skip=2) is not reps[2] for _ in range(200))
    assert least_loaded_of_two(reps[:2], rng, skip=0) is reps[1]
    assert least_loaded_of_two(reps[:1], rng, skip=0) is reps[0]  # the only replica


def test_a_batch_queue_follows_its_forming_batch_among_many_replicas():
    """Requests with many routing keys but one batch queue all join the batch that opened,
    on one replica of 1024, until that replica reaches the bound."""
    r = KeyAffinity(load_factor=1.5, slack=2)
    reps = views(range(1024))
    first = r.choose(RouteRequest("ep", "k0", batch_key="q"), reps)
    first.forming.add(("ep", "q"))
    first.in_flight += 1
    for key in KEYS[1:3]:  # bound: ceil(1.5 * 3 / 1024) + 2 = 3
        assert r.choose(RouteRequest("ep", key, batch_key="q"), reps) is first
        first.in_flight += 1
    assert r.choose(RouteRequest("ep", KEYS[3], batch_key="q"), reps) is r.owner(KEYS[3], reps)


def test_model_aware_keeps_a_model_on_its_holders_among_many_replicas():
    """A model loads once and its requests stay with it; when its holder is past the bound
    it loads on one more of its places, and the two share the traffic from then on."""
    r = ModelAware(load_factor=2.0, slack=2)
    reps = views(range(512))
    for x in reps:
        x.in_flight = 1
    sent = collections.Counter()
    for _ in range(20):
        chosen = r.choose(RouteRequest("ep", "m"), reps)
        chosen.models.add("m")
        chosen.in_flight += 1
        sent[chosen.replica_id] += 1
    holders = [x for x in reps if "m" in x.models]
    places = {x.replica_id for x in r.places("m", reps)}
    most = math.ceil(20 / (r.bound(reps) - 1))  # a holder takes requests from load 1 up to the bound
    assert 1 < len(holders) <= most and {x.replica_id for x in holders} <= places
    assert sum(sent[x.replica_id] for x in holders) == 20


def test_model_aware_finds_a_model_it_spilled_beyond_its_places():
    """All of a model's places past the bound: it loads where it spills, and the router goes
    back there while that replica holds it."""
    r = ModelAware(load_factor=1.0, slack=0, seed=0, candidates=2)
    reps = views(range(64))
    for x in r.places("m", reps):
        x.in_flight = 50
    spilled = r.choose(RouteRequest("ep", "m"), reps)
    assert spilled not in r.places("m", reps)[:2]
    spilled.models.add("m")
    assert spilled in r.places("m", reps)
    assert r.choose(RouteRequest("ep", "m"), reps) is spilled


def test_sticky_spreads_new_sessions_without_scanning():
    """A new session takes the better of two random replicas, whose busiest replica stays within
    log2(ln n) + O(1) of the mean (the power of two choices; a random replica would drift to
    about sqrt(2 mean ln n) above it)."""
    n, mean = 64, 20
    r = Sticky(seed=0)
    reps = views(range(n))
    for i in range(n * mean):
        r.choose(RouteRequest("ep", f"s{i}"), reps).in_flight += 1
    assert max(x.in_flight for x in reps) <= mean + math.log2(math.log(n)) + 2
