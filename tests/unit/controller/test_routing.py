"""Routers, with tiny in-process replica fakes."""

from collections import Counter
from dataclasses import dataclass, field

import pytest

from forge.controller import KeyAffinity, LeastLoaded, RoundRobin, Router, RouteRequest, Sticky, register_router
from forge.controller.routing import Pins, make_router, replica_by_id


@dataclass
class FakeReplica:
    replica_id: int
    in_flight: int = 0
    forming: set = field(default_factory=set)

    def has_forming(self, endpoint, key):
        return (endpoint, key) in self.forming


def replicas(n):
    return [FakeReplica(i) for i in range(n)]


def test_round_robin_visits_each_replica_in_turn():
    r = RoundRobin()
    reps = replicas(3)
    assert [r.choose(RouteRequest("ep"), reps).replica_id for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_loaded_never_picks_the_busiest_of_two():
    r = LeastLoaded(seed=0)
    reps = [FakeReplica(0, in_flight=10), FakeReplica(1, in_flight=0)]
    assert all(r.choose(RouteRequest("ep"), reps).replica_id == 1 for _ in range(20))


def test_least_loaded_balances_a_stream():
    """Power of two choices keeps in-flight counts within a small spread, catching up a replica
    that starts busy (round robin would keep its head start of 12; random choice drifts apart)."""
    r = LeastLoaded(seed=1)
    reps = replicas(4)
    reps[0].in_flight = 12
    for _ in range(400):
        r.choose(RouteRequest("ep"), reps).in_flight += 1
    loads = [x.in_flight for x in reps]
    assert max(loads) - min(loads) <= 3


def test_key_affinity_sends_equal_keys_to_one_replica():
    r = KeyAffinity(load_factor=100)
    reps = replicas(4)
    for key in ["a", "b", "prompt-17", 42]:
        chosen = {r.choose(RouteRequest("ep", key), reps).replica_id for _ in range(10)}
        assert len(chosen) == 1


def test_key_affinity_spreads_distinct_keys():
    r = KeyAffinity(load_factor=100)
    reps = replicas(4)
    counts = Counter(r.choose(RouteRequest("ep", f"k{i}"), reps).replica_id for i in range(400))
    assert len(counts) == 4 and min(counts.values()) > 60


def test_key_affinity_moves_only_the_removed_replicas_keys():
    """Rendezvous hashing: removing a replica remaps only the keys it owned."""
    r = KeyAffinity(load_factor=100)
    reps = replicas(4)
    keys = [f"k{i}" for i in range(300)]
    before = {k: r.choose(RouteRequest("ep", k), reps).replica_id for k in keys}
    after = {k: r.choose(RouteRequest("ep", k), reps[:2] + reps[3:]).replica_id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == 2 for k in moved)


def test_key_affinity_spills_to_least_loaded_past_the_bound():
    r = KeyAffinity(load_factor=1.5, slack=0)
    reps = replicas(3)
    owner = r.owner("hot", reps)
    owner.in_flight = 10
    others = [x for x in reps if x is not owner]
    others[0].in_flight, others[1].in_flight = 3, 1
    assert r.choose(RouteRequest("ep", "hot"), reps) is others[1]


def test_key_affinity_keeps_the_owner_within_the_bound():
    r = KeyAffinity(load_factor=1.5, slack=2)
    reps = replicas(3)
    owner = r.owner("k", reps)
    owner.in_flight = 3
    assert r.choose(RouteRequest("ep", "k"), reps) is owner


def test_key_affinity_sends_a_batch_queue_back_where_its_batch_is_forming():
    """A request naming a batch queue joins the batch that its queue's last request opened,
    whatever replica its own key owns; once that batch has run, the key decides again."""
    r = KeyAffinity()
    reps = replicas(3)
    first = r.choose(RouteRequest("ep", "k", batch_key="b"), reps)
    assert first is r.owner("k", reps)
    first.forming.add(("ep", "b"))  # the batch it opened is waiting for more items
    j = next(key for key in (f"j{i}" for i in range(100)) if r.owner(key, reps) is not first)
    assert r.choose(RouteRequest("ep", j, batch_key="b"), reps) is first
    assert r.choose(RouteRequest("other_ep", j, batch_key="b"), reps) is r.owner(j, reps)  # batches are per endpoint
    first.forming.clear()  # the batch ran
    assert r.choose(RouteRequest("ep", j, batch_key="b"), reps) is r.owner(j, reps)


def test_key_affinity_leaves_a_forming_batch_on_a_replica_past_the_bound():
    r = KeyAffinity(load_factor=1.5, slack=0)
    reps = replicas(3)
    first = r.choose(RouteRequest("ep", "k", batch_key="b"), reps)
    first.forming.add(("ep", "b"))
    first.in_flight = 30  # past the bound, whether or not the running total has seen it yet
    j = next(key for key in (f"j{i}" for i in range(100)) if r.owner(key, reps) is not first)
    assert r.choose(RouteRequest("ep", j, batch_key="b"), reps) is r.owner(j, reps)


def test_key_affinity_ignores_forming_batches_of_a_request_that_names_no_batch_queue():
    """Without a batch key the item joins the endpoint's shared queue, forming everywhere:
    following it would undo the affinity, so the routing key alone decides."""
    r = KeyAffinity()
    reps = replicas(3)
    for x in reps:
        x.forming.update({("ep", None), ("ep", "k")})
    assert all(r.choose(RouteRequest("ep", key), reps) is r.owner(key, reps) for key in ("k", "j", "i"))


def test_sticky_keeps_a_session_on_its_replica_until_it_leaves():
    r = Sticky(seed=0)
    reps = replicas(3)
    first = r.choose(RouteRequest("ep", "session-1"), reps)
    for x in reps:
        x.in_flight = 5 if x is first else 0
    assert r.choose(RouteRequest("ep", "session-1"), reps) is first
    rest = [x for x in reps if x is not first]
    moved = r.choose(RouteRequest("ep", "session-1"), rest)
    assert moved in rest
    assert r.choose(RouteRequest("ep", "session-1"), reps) is moved  # re-pinned where it went


def test_pins_hold_under_the_bound_spill_past_it_and_forget_the_least_recently_used():
    pins = Pins(max_names=2)
    reps = replicas(3)
    assert pins.get("a", reps) is None  # not pinned yet
    pins.pin("a", reps[2])
    pins.pin("b", reps[0])
    assert pins.get("a", reps, bound=1) is reps[2]
    reps[2].in_flight = 1
    assert pins.get("a", reps, bound=1) is None and pins.spills == 1  # at the bound: spill
    assert pins.get("a", reps) is reps[2]  # no bound: it holds
    assert pins.get("a", reps[:2]) is None  # its replica is no candidate
    pins.pin("c", reps[1])  # "b" is the least recently used
    assert pins.names() == ["a", "c"]
    with pytest.raises(ValueError, match="max_names must be an integer >= 1, got 0"):
        Pins(max_names=0)


def test_replica_by_id_finds_a_replica_among_any_ordered_subset():
    reps = replicas(6)
    assert replica_by_id(reps, 4) is reps[4]
    subset = [reps[i] for i in (0, 2, 3, 5)]
    assert replica_by_id(subset, 3) is reps[3] and replica_by_id(subset, 5) is reps[5]
    assert replica_by_id(subset, 1) is None and replica_by_id(subset, 9) is None


def test_router_registry_rejects_duplicates_and_unknown_names():
    class Mine(Router):
        def choose(self, request, replicas):
            return replicas[-1]

    register_router("test_last_one", Mine)
    assert isinstance(make_router("test_last_one"), Mine)
    with pytest.raises(ValueError, match="already registered"):
        register_router("test_last_one", Mine)
    with pytest.raises(ValueError, match="unknown router 'nope'"):
        make_router("nope")
    with pytest.raises(TypeError, match="Router subclass"):
        make_router(3)


def test_key_affinity_rejects_bad_bounds():
    with pytest.raises(ValueError, match="load_factor must be a number >= 1.0"):
        KeyAffinity(load_factor=0.5)
