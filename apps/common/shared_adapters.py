"""Adapters served by one multi-adapter policy service (``MultiLoraPolicy``), as one record.

``SharedAdapters`` holds every adapter's newest version and makes itself the policy service's
resync hook when it is made, so a restarted replica serves every adapter's newest version before
it takes traffic. The multi-adapter GRPO job (``apps.multi_lora``: one adapter per run, a new
version each weight sync) and the serve app (``apps.serve``: the adapters of ``policy.adapters``,
one version each) publish through it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from apps.common.launch import RoleSpec
from apps.common.roles import POLICY_ENV, call_role
from apps.common.weights import ServedWeights

__all__ = ["SharedAdapters", "multi_adapter_policy"]

logger = logging.getLogger("forge.adapters")


def multi_adapter_policy(config: Any, adapters_per_replica: int, options: dict[str, Any] | None = None) -> RoleSpec:
    """The ``policy`` role as a ``MultiLoraPolicy`` holding ``adapters_per_replica`` adapters per
    replica: the service's ``max_models`` and vLLM's ``max_loras`` set together, so the two never
    disagree about what a replica holds. ``config``: its ``PolicyConfig`` (with ``lora``)."""
    from forge.actors.multi_lora_policy import MultiLoraPolicy, multi_lora_engine_kwargs

    config.engine_kwargs = {**config.engine_kwargs, **multi_lora_engine_kwargs(adapters_per_replica)}
    return RoleSpec(
        "policy", MultiLoraPolicy, config, POLICY_ENV, options={**(options or {}), "max_models": adapters_per_replica}
    )


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

    async def publish(self, adapter_id: str, weights: Any, version: int, rollback: bool = False) -> None:
        """Serve ``weights`` (PEFT-named adapter tensors) as ``adapter_id``'s ``version`` on every
        healthy replica, recorded first so that a replica restarting meanwhile gets it from
        ``resync``; an older version than the replicas serve only with ``rollback``. A replica
        that fails meanwhile is a recoverable ``RoleFailed`` (it resyncs when back)."""
        self.served[adapter_id] = ServedWeights(weights, version)
        update = self.policy.update_adapter.fanout(adapter_id, weights, version, rollback, timeout=self.timeout_s)
        await call_role("policy", update)

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
