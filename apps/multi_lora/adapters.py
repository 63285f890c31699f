"""The runs' adapters on the shared policy service: each run's weight sync, and what a replica serves.

``SharedAdapters`` is the job's record of every run's newest adapter; it makes itself the policy
service's resync hook when it is made, so a restarted replica serves every live run's newest
version before it takes traffic. ``AdapterWeights`` is one run's ``PolicyWeights``: its fetch is the GRPO app's (the
trainer's adapter tensors), its push goes to the run's adapter on every replica. ``AdapterView``
is the policy service as one run's rollouts see it: every request names the run's adapter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from apps.common.roles import RoleFailed, call_role
from apps.common.weights import PolicyWeights, ServedWeights

__all__ = ["AdapterView", "AdapterWeights", "SharedAdapters"]

logger = logging.getLogger("forge.multi_lora")


class SharedAdapters:
    """Every live run's newest adapter on one policy service, and their arrival and departure.

    Made, it is the service's resync hook (``policy.set_resync``): the record and the hook that
    replays it cannot be set up apart."""

    def __init__(self, policy: Any, timeout_s: float) -> None:
        self.policy = policy
        self.timeout_s = timeout_s
        """Longest one call to the policy replicas may take (a fanout, an eviction)."""
        self.served: dict[str, ServedWeights] = {}
        policy.set_resync(self.resync)  # a restarted replica serves every live run's newest adapter

    async def add(self, adapter_id: str) -> None:
        """Serve ``adapter_id`` on every replica (the base until its first version)."""
        self.served[adapter_id] = ServedWeights()
        await call_role("policy", self.policy.add_adapter.fanout(adapter_id, timeout=self.timeout_s))

    async def retire(self, adapter_id: str) -> int:
        """Evict ``adapter_id`` from every replica (after its requests there are done) and forget
        it: its run stopped. Returns how many replicas held it in vLLM. Never raises: a run's end
        must not fail for the policy's sake (a replica that is gone holds nothing)."""
        self.served.pop(adapter_id, None)
        held = 0
        try:
            held = await self.policy.retire_model(adapter_id, timeout_s=self.timeout_s)
            await self.policy.forget_adapter.fanout(adapter_id, timeout=self.timeout_s)
        except Exception as exc:
            logger.warning("adapter %s was not evicted from every policy replica: %s", adapter_id, exc)
        return held

    async def resync(self, actor_mesh: Any) -> None:
        """A restarted replica's step before it takes traffic: every live run's newest adapter."""
        for adapter_id, served in list(self.served.items()):
            await asyncio.wait_for(actor_mesh.add_adapter.call(adapter_id), self.timeout_s)
            if served.weights is not None:
                await asyncio.wait_for(
                    actor_mesh.update_adapter.call(adapter_id, served.weights, served.version), self.timeout_s
                )


class AdapterWeights(PolicyWeights):
    """One run's weight sync: its trainer's adapter to its adapter id on every policy replica."""

    def __init__(self, trainer: Any, adapters: SharedAdapters, adapter_id: str, fetch_timeout_s: float) -> None:
        super().__init__(trainer, adapters.policy, "message", "", adapters.timeout_s, fetch_timeout_s)
        self.adapters = adapters
        self.adapter_id = adapter_id

    async def push(self, weights: Any, version: int, rollback: bool = False) -> int:
        """Serve ``weights`` as the run's adapter ``version`` on every healthy replica (a replica
        restarting meanwhile gets it from ``SharedAdapters.resync``); an older version than the
        replicas serve only with ``rollback``."""
        from forge.observability import record_metric

        t0 = time.perf_counter()
        self.served = self.adapters.served[self.adapter_id] = ServedWeights(weights, version)
        timeout = self.adapters.timeout_s
        update = self.policy.update_adapter.fanout(self.adapter_id, weights, version, rollback, timeout=timeout)
        try:
            await call_role("policy", update)
        except RoleFailed as exc:
            if not exc.recoverable:
                raise
            record_metric("weight_sync/interrupted", 1, "sum")  # the restarted replica resyncs
        record_metric("weight_sync/push_s", time.perf_counter() - t0)
        return version

    async def sync(self) -> int:
        """Fetch and push the trainer's adapter, and wait: a restored checkpoint's (``--resume``,
        a replaced trainer), which may be older than the version the replicas serve."""
        weights, version = await self.fetch()
        return await self.push(weights, version, rollback=True)

    async def served_versions(self) -> list[int]:
        """The version of the run's adapter each replica serves next (its catalog's newest)."""
        call = self.policy.adapter_version.fanout(self.adapter_id, timeout=self.adapters.timeout_s)
        return await call_role("policy", call)

    async def probes(self, prompt_ids: list[int]) -> list[tuple[int, list[int], list[float]]]:
        """One sample of ``prompt_ids`` with the run's adapter, from the replica that routing picks
        (a replica holds an adapter in vLLM only while it serves it, so not from every one)."""
        call = self.policy.probe_adapter.route(prompt_ids, model_id=self.adapter_id, timeout=self.adapters.timeout_s)
        return [await call_role("policy", call)]


class _AdapterEndpoint:
    """One endpoint of the shared policy as one run's code calls it (``route(item, key=None)``),
    sent to the run's adapter's multiplexed endpoint instead."""

    def __init__(self, endpoint: Any, adapter_id: str, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.adapter_id = adapter_id
        self.timeout_s = timeout_s

    async def route(self, item: Any, key: Any = None) -> Any:
        # key (a prompt's or a session's affinity) is dropped: the adapter routes (model_aware) and batches.
        return await self.endpoint.route(item, model_id=self.adapter_id, timeout=self.timeout_s)


class AdapterView:
    """The shared policy service as one run sees it: ``generate`` (rollouts), ``sample``
    (held-out evaluation) and ``generate_turn`` (multi-turn rollouts) name the run's adapter."""

    def __init__(self, policy: Any, adapter_id: str, timeout_s: float) -> None:
        self.generate = _AdapterEndpoint(policy.generate_adapter, adapter_id, timeout_s)
        self.sample = _AdapterEndpoint(policy.sample_adapter, adapter_id, timeout_s)
        self.generate_turn = _AdapterEndpoint(policy.generate_turn_adapter, adapter_id, timeout_s)
