"""GPU placement on faked device lists: each replica and process gets its own device ids, passed
to its processes explicitly as ``CUDA_VISIBLE_DEVICES`` (no GPU is needed to check the ids)."""

from __future__ import annotations

import asyncio
import os

import pytest
from monarch.actor import current_rank

from forge.controller import ForgeActor, InsufficientGpus, endpoint
from forge.controller.options import ActorOptions
from forge.controller.provisioner import replica_gpus


class Devices(ForgeActor):
    @endpoint
    async def visible(self) -> tuple[int, str | None]:
        return current_rank().rank, os.environ.get("CUDA_VISIBLE_DEVICES")


def test_explicit_gpus_are_split_over_replicas_then_processes():
    opts = ActorOptions(num_replicas=2, procs=1, gpus=[0, 1, 2, 3], gpus_per_proc=2)
    assert replica_gpus(opts, 2) == [["0", "1"], ["2", "3"]]
    opts = ActorOptions(num_replicas=2, procs=2, gpus=["4", "5", "6", "7"])
    assert replica_gpus(opts, 2) == [["4", "5"], ["6", "7"]]


def test_with_gpus_takes_the_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    assert replica_gpus(ActorOptions(num_replicas=3, with_gpus=True), 3) == [["3"], ["5"], ["7"]]
    assert replica_gpus(ActorOptions(num_replicas=3), 3) == [None, None, None]


def test_too_few_gpus_is_an_error_naming_the_counts(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(InsufficientGpus, match=r"2 replicas x 2 GPUs each need 4 GPUs, but only 3"):
        replica_gpus(ActorOptions(num_replicas=2, with_gpus=True, gpus_per_proc=2), 2)


@pytest.mark.parametrize("bad", ["0,1", [True], [0.5], 3])
def test_a_bad_gpus_option_is_refused(bad):
    with pytest.raises(ValueError, match=r"options\(gpus=...\) must be a list of device ids"):
        ActorOptions(gpus=bad)


async def test_each_process_sees_its_own_gpus_per_proc_devices():
    """A 2-process replica with gpus_per_proc=2 (say a tensor-parallel engine per process)."""
    actor = await Devices.options(procs=2, gpus=["0", "1", "2", "3"], gpus_per_proc=2).as_actor()
    try:
        assert sorted((await actor.visible.call()).values()) == [(0, "0,1"), (1, "2,3")]
    finally:
        await ForgeActor.shutdown(actor)


async def test_roles_started_at_once_get_their_own_gpus_and_leave_the_controllers_env_alone(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    a, b = await asyncio.gather(
        Devices.options(gpus=["2"]).as_actor(), Devices.options(gpus=["0", "1"], gpus_per_proc=2).as_actor()
    )
    try:
        assert list((await a.visible.call()).values()) == [(0, "2")]
        assert list((await b.visible.call()).values()) == [(0, "0,1")]
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    finally:
        await asyncio.gather(ForgeActor.shutdown(a), ForgeActor.shutdown(b))
