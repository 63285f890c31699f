"""NewestVersion: new work goes to the replicas on the newest version, within a load bound."""

from collections import Counter
from dataclasses import dataclass, field

import pytest

from forge.controller import KeyAffinity, RouteRequest
from forge.controller.versions import NewestVersion


@dataclass
class VersionedFake:
    replica_id: int
    version: int | None = None
    in_flight: int = 0
    updating: bool = False
    forming: set = field(default_factory=set)

    def has_forming(self, endpoint, key):
        return (endpoint, key) in self.forming


def test_requests_go_to_the_replicas_on_the_newest_version_and_the_inner_router_picks_among_them():
    reps = [VersionedFake(0, 3), VersionedFake(1, 4), VersionedFake(2, 3), VersionedFake(3, 4)]
    router = NewestVersion("round_robin")
    picks = Counter(router.choose(RouteRequest("generate"), reps).replica_id for _ in range(40))
    assert picks == {1: 20, 3: 20}
    # With key affinity inside, one key meets on one replica of the newest.
    keyed = NewestVersion(KeyAffinity())
    assert len({keyed.choose(RouteRequest("generate", key="k"), reps).replica_id for _ in range(10)}) == 1


def test_an_overloaded_newest_replica_spills_to_a_less_loaded_one_past_the_slack():
    reps = [VersionedFake(0, 5, in_flight=9), VersionedFake(1, 4, in_flight=0), VersionedFake(2, 4, in_flight=0)]
    assert all(NewestVersion(slack=4).choose(RouteRequest("g"), reps).replica_id != 0 for _ in range(20))
    reps[0].in_flight = 4  # within the slack: the newest still takes it
    assert all(NewestVersion(slack=4).choose(RouteRequest("g"), reps).replica_id == 0 for _ in range(20))


def test_replicas_without_a_recorded_version_share_the_work_when_none_has_one():
    reps = [VersionedFake(i) for i in range(3)]
    router = NewestVersion("round_robin")
    assert [router.choose(RouteRequest("g"), reps).replica_id for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="slack"):
        NewestVersion(slack=-1)


def test_a_replica_loading_a_version_gets_new_work_only_when_every_replica_is():
    reps = [VersionedFake(0, 3), VersionedFake(1, 3), VersionedFake(2, 3)]
    reps[0].updating = True
    router = NewestVersion("round_robin")
    assert {router.choose(RouteRequest("g"), reps).replica_id for _ in range(12)} == {1, 2}
    for replica in reps:
        replica.updating = True
    assert {router.choose(RouteRequest("g"), reps).replica_id for _ in range(12)} == {0, 1, 2}
