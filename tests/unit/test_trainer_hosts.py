"""The trainer over two hosts (``options(hosts=2, procs=1, host_pool=...)``), the hosts being two
worker processes on loopback: one SPMD trainer whose ranks live on different hosts takes the
same step as a single-host, one-rank trainer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psutil
import pytest

from forge.controller.hosts import HostPool, start_local_worker
from tests.unit.controller.test_hosts_spanning import LOOPBACK_ENV, free_port
from tests.unit.test_trainer_sharded import (
    _assert_same_stats,
    _assert_same_weights,
    _batch,
    _config,
    _initial_weights,
    _noise_moved,
    _start_in_process,
    _stop,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from forge.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("hosts") / "tiny", hidden_size=64, num_layers=3, init_std=0.1)


async def test_a_trainer_over_two_hosts_takes_the_same_step_as_one_rank_on_one_host(model_dir: Path):
    from forge.actors.trainer import Trainer
    from forge.distributed import call_spmd

    workers = [start_local_worker(free_port()) for _ in range(2)]
    one = spanning = None
    try:
        pool = HostPool.attach([w.args[-1] for w in workers])
        batch = _batch(model_dir)
        one, spanning = await asyncio.gather(
            _start_in_process(_config(model_dir)),
            Trainer.options(hosts=2, procs=1, host_pool=pool, name="trainer_hosts", env=LOOPBACK_ENV).as_actor(
                _config(model_dir, micro_batch_size=2)
            ),
        )
        # One trainer rank on each host: each worker process runs one of its processes.
        assert [len(psutil.Process(w.pid).children()) for w in workers] == [1, 1]
        s1, s2 = await asyncio.gather(call_spmd(one.train_step, batch), call_spmd(spanning.train_step, batch))
        _assert_same_stats(s2, s1, ("loss", "grad_norm", "kl", "tokens"))
        (w1, v1), (w2, v2) = await asyncio.gather(call_spmd(one.weights), call_spmd(spanning.weights))
        assert v1 == v2 == 1
        _assert_same_weights(w2, w1, _noise_moved(w1, _initial_weights(model_dir)))
    finally:
        await _stop(one, spanning)
        for w in workers:
            w.kill()
            w.wait(10)
