"""When the GRPO app gives up on a service role (``apps.grpo.faults.service_gave_up``): tiny
replica fakes; the end-to-end behaviour is in tests/integration/test_grpo_faults.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from apps.grpo.config import GRPOConfig
from apps.grpo.faults import service_gave_up
from apps.grpo.roles import fault_options
from forge.config import load_config
from forge.controller import ActorOptions, ReplicaState


@dataclass
class _Replica:
    replica_id: int
    state: ReplicaState = ReplicaState.HEALTHY
    restarts: int = 0
    failure: str | None = None


def test_a_restarting_replica_is_not_a_reason_to_give_up():
    """A replica that failed with restarts left, beside a healthy one, lets the run go on."""
    replicas = [_Replica(0, ReplicaState.FAILED, restarts=1, failure="killed"), _Replica(1)]
    assert service_gave_up(replicas, max_restarts=3, unhealthy_s=0.0, max_unhealthy_s=60) is None


def test_a_replica_that_used_up_its_restarts_gives_up_naming_the_count():
    """FAILED with restarts == max_restarts: give up, saying how many restarts it had."""
    replicas = [_Replica(0, ReplicaState.FAILED, restarts=2, failure="killed"), _Replica(1)]
    why = service_gave_up(replicas, max_restarts=2, unhealthy_s=0.0, max_unhealthy_s=60)
    assert why == "replica 0 failed again (killed) after 2 restarts, all that faults.max_restarts=2 allows"


def test_with_max_restarts_zero_the_message_says_no_restart_was_allowed():
    """max_restarts=0: the message says no restart was allowed, not 'failed 0 times'."""
    why = service_gave_up([_Replica(0, ReplicaState.FAILED, failure="killed")], 0, 0.0, 60)
    assert why is not None and "faults.max_restarts=0 allows no restart" in why and "0 restarts" not in why


def test_no_healthy_replica_for_longer_than_max_unhealthy_s_gives_up():
    """Every replica recovering for longer than max_unhealthy_s: give up, listing their states."""
    replicas = [_Replica(0, ReplicaState.RECOVERING, restarts=1), _Replica(1, ReplicaState.STARTING, restarts=1)]
    assert service_gave_up(replicas, 3, unhealthy_s=59.0, max_unhealthy_s=60) is None
    why = service_gave_up(replicas, 3, unhealthy_s=61.0, max_unhealthy_s=60)
    assert why == "no healthy replica for 61s (faults.max_unhealthy_s=60); replicas: r0 recovering, r1 starting"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["faults.max_restarts=-1"], r"faults.max_restarts must be >= 0 \(0: no restarts\), got -1"),
        (["faults.max_unhealthy_s=0"], r"faults.max_unhealthy_s must be a number of seconds > 0, got 0"),
        (
            ["faults.health_interval_s=5", "faults.health_timeout_s=2"],
            r"faults.health_timeout_s \(2.0\) must be >= faults.health_interval_s \(5.0\)",
        ),
    ],
)
def test_bad_faults_settings_are_refused_naming_the_key(overrides: list[str], message: str):
    """The faults section's values are checked at load time, naming the key and the rule."""
    with pytest.raises(ValueError, match=message):
        load_config(GRPOConfig, None, ["model.path=/m", *overrides])


def test_services_get_the_faults_settings_as_their_restart_and_health_options():
    """Every service role starts with the configured restarts, backoff, probes, and a wait for
    a restarting replica as long as the run tolerates (max_unhealthy_s)."""
    cfg = load_config(GRPOConfig, None, ["model.path=/m", "faults.max_restarts=7", "faults.max_unhealthy_s=42"])
    options = fault_options(cfg)
    assert options["max_restarts"] == 7 and options["queue_timeout_s"] == 42
    ActorOptions(**options)  # every key is a real service option
