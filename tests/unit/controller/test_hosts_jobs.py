"""Hosts from Monarch's job API (``monarch.job``): a ``hosts:`` config section names the job, and
``host_pool_from`` applies it and returns the pool replicas are placed on. ``ProcessJob`` (worker
processes on this machine) and ``LocalJob`` stand in for Slurm and Kubernetes here."""

from __future__ import annotations

import asyncio
import os

import psutil
import pytest

from forge.controller import ForgeActor
from forge.controller.jobs import HostsConfig, host_pool_from, make_job
from tests.unit.controller.test_hosts_spanning import LOOPBACK_ENV, AllReduce, free_port


async def test_a_process_job_gives_a_pool_whose_two_hosts_carry_one_replica():
    pool = host_pool_from(HostsConfig(job="process", num_hosts=2))
    workers = psutil.Process().children()  # the job's two worker processes, among others
    try:
        assert pool.size == 2
        actor = await AllReduce.options(hosts=2, host_pool=pool, env=LOOPBACK_ENV).as_actor()
        try:
            where = list((await actor.where.call()).values())
            hosts = {w["host_pid"] for w in where}
            assert len(hosts) == 2 and hosts <= {w.pid for w in workers} and os.getpid() not in hosts
            await asyncio.wait_for(actor.join.call(free_port()), 60)
            assert list((await asyncio.wait_for(actor.sum_ranks.call(), 60)).values()) == [3.0, 3.0]
        finally:
            await ForgeActor.shutdown(actor)
    finally:
        pool.close()
    assert not any(psutil.pid_exists(w.pid) and w.status() != psutil.STATUS_ZOMBIE for w in workers if w.pid in hosts)


async def test_a_local_job_places_replicas_on_this_host():
    pool = host_pool_from(HostsConfig(job="local"))
    svc = await AllReduce.options(host_pool=pool, num_replicas=2).as_service()
    try:
        assert [w["host_pid"] for w in await svc.where.fanout()] == [os.getpid()] * 2
    finally:
        await svc.shutdown()


def test_the_slurm_section_becomes_a_slurm_job_with_its_options(tmp_path):
    section = HostsConfig(job="slurm", num_hosts=4, options={"partition": "gpu", "gpus_per_node": 8})
    job = make_job(section, tmp_path)
    assert type(job).__name__ == "ForgeSlurmJob"  # forge's adapter of Monarch 0.7's SlurmJob
    assert (job._meshes, job._partition, job._gpus_per_node) == ({"hosts": 4}, "gpu", 8)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"job": "pbs"}, r"hosts.job must be one of .*'pbs'"),
        ({"job": "attach"}, r"needs hosts.addresses"),
        ({"job": "slurm", "num_hosts": 0}, r"hosts.num_hosts must be an integer >= 1, got 0"),
        ({"job": "process", "addresses": ["tcp://a:1"]}, r"only with hosts.job 'attach'"),
        ({"job": "kubernetes"}, r"needs hosts.options.namespace"),
    ],
)
def test_a_bad_hosts_section_is_refused_naming_the_key(section, message):
    with pytest.raises(ValueError, match=message):
        HostsConfig(**section)
