"""The runs' adapters on the shared policy service: each run's weight sync, and what a replica serves.

``SharedAdapters`` is the job's record of every run's newest adapter; it makes itself the policy
service's resync hook when it is made, so a restarted replica serves every live run's newest
version before it takes traffic. ``AdapterWeights`` is one run's ``PolicyWeights``: its fetch is the GRPO app's (the
trainer's adapter tensors), its push goes to the run's adapter on every replica. ``AdapterView``
is the policy service as one run's rollouts see it: every request names the run's adapter.
"""

from __future__ import annotations

import time
from typing import Any

from apps.common.roles import RoleFailed, call_role
from apps.common.shared_adapters import SharedAdapters
from apps.common.weights import PolicyWeights

__all__ = ["AdapterView", "AdapterWeights", "SharedAdapters"]


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
        try:
            await self.adapters.publish(self.adapter_id, weights, version, rollback)
        except RoleFailed as exc:
            if not exc.recoverable:
                raise
            record_metric("weight_sync/interrupted", 1, "sum")  # the restarted replica resyncs
        finally:
            self.served = self.adapters.served[self.adapter_id]  # recorded before the replicas were told
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
