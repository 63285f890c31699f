"""``rollout.workers``: the groups made in worker processes, so the controller moves groups, not items.

Without it the controller makes every group itself: per group a policy request, a reward and a
reference request, their batching, routing and (de)serialisation, all in one Python process
(``docs/benchmarks.md``, section 17). With ``rollout.workers: N`` a service of N
``RolloutWorker`` replicas does that part. The controller still draws the prompts, names the
groups, applies backpressure and dynamic sampling and writes the buffer, so every book stays
where it was; per group it sends one ``GroupOrder`` (batched, one message per batch of orders)
and gets the scored group back packed (``apps.grpo.group_orders``).

A worker reaches the policy, reference, reward (and env) replicas through attached services
(``forge.controller.attach``): its own routers and batchers over the replicas the controller
owns. The controller keeps them current: after any replica of those roles, or a worker, fails
or comes back, ``ViewPublisher`` sends every worker the roles' new views, and a restarted
worker gets them before it takes traffic (its resync).

Faults: a worker whose process dies is restarted like any service replica; the orders it held
are resent by the service to another worker, or fail as a replica's death, and the controller
generates those groups again from the same prompts with the same ids (``groups.make_with_retries``):
none is lost, and the buffer refuses a second copy. A replica of another role dying under a
worker is the worker's to retry, exactly as the controller would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from apps.common.launch import Roles
from apps.common.roles import QUIET_ENV, ROLE_ENV, RoleFailed
from apps.grpo.group_orders import GroupOrder, MadeGroup, MadeGroups
from apps.grpo.groups import GroupMaker, GroupSettings, group_maker, make_with_retries
from forge.controller import Batching, ForgeActor, ServiceInterface, ServiceView, endpoint
from forge.controller.attach import attach, attached_replicas, service_view

__all__ = ["RolloutWorker", "ViewPublisher", "start_rollout_workers", "stop_rollout_workers"]

logger = logging.getLogger("forge.grpo")

ORDERS_PER_BATCH = 64
"""Most group orders in one message to a worker."""
BATCHES_PER_WORKER = 32
"""Batches of orders one worker works on at once (their groups' requests interleave)."""
VIEW_PUSH_TIMEOUT_S = 30.0
ATTACHED_ROLES = ("policy", "reference", "reward", "reward_model", "env")


class RolloutWorker(ForgeActor):
    """Makes groups from the controller's orders over attached role services."""

    def __init__(self, settings: GroupSettings) -> None:
        self.settings = settings
        self.services: dict[str, ServiceInterface] = {}
        self.maker: GroupMaker | None = None
        self._making: set[asyncio.Task] = set()  # the groups being made now

    @endpoint(concurrent=True)
    async def attach(self, views: dict[str, ServiceView]) -> None:
        """Attach the roles' services (first call) or bring them up to date (later calls)."""
        for role, view in views.items():
            if role in self.services:
                await attached_replicas(self.services[role]).apply(view)
            else:
                self.services[role] = await attach(view)
        if self.maker is None:  # the run's own group maker, over the attached services
            self.maker = group_maker(Roles(**{role: self.services.get(role) for role in ATTACHED_ROLES}), self.settings)

    @staticmethod
    def unpack_made(made: MadeGroups, n: int) -> list[MadeGroup]:
        """``groups``' debatch: each order's outcome, for its caller."""
        return made.unpack(n)

    @endpoint(
        batch=Batching(
            max_size=ORDERS_PER_BATCH,
            max_wait_s=0.002,
            max_concurrent_batches=BATCHES_PER_WORKER,
            debatch="unpack_made",
        ),
        concurrent=True,
    )
    async def groups(self, orders: list[GroupOrder]) -> MadeGroups:
        """Make every order's group, concurrently; the batch's groups come back packed."""
        if self.maker is None:
            raise RuntimeError("this rollout worker has no role services: attach() was never called")
        making = [asyncio.ensure_future(self._make(order)) for order in orders]
        self._making.update(making)
        try:
            return MadeGroups.pack(list(await asyncio.gather(*making)))
        finally:
            self._making.difference_update(making)

    @endpoint(concurrent=True)
    async def quiesce(self, timeout_s: float = 15.0) -> int:
        """Stop making groups (the run is ending) and wait until every group's own clean-up is
        done, such as a trajectory closing its env session, while this process can still hear the
        answers; returns how many groups were stopped. Call it before the workers stop."""
        making = list(self._making)
        for task in making:
            task.cancel()
        await asyncio.wait_for(asyncio.gather(*making, return_exceptions=True), timeout_s)
        return len(making)

    async def _make(self, order: GroupOrder) -> MadeGroup:
        maker = self.maker
        assert maker is not None
        try:
            group, regenerated = await make_with_retries(maker.make, order.prompt, order.group_id)
        except RoleFailed as exc:  # a role's own failure, or a replica that did not come back
            return MadeGroup(None, str(exc), 0)
        return MadeGroup(group, None, regenerated)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        """Monarch's stop hook: fail what the attached services still queue (the replicas are the controller's)."""
        await asyncio.gather(*(s.shutdown() for s in self.services.values()), return_exceptions=True)


class ViewPublisher:
    """Sends every worker the roles' current views after any replica change; coalesced: one push
    in flight, and one more if something changed meanwhile."""

    def __init__(self, workers: ServiceInterface, views: Callable[[], dict[str, ServiceView]]) -> None:
        self.workers = workers
        self.views = views
        self.pushes = 0
        self._dirty = False
        self._closed = False
        self._task: asyncio.Task | None = None

    def changed(self) -> None:
        """A replica listener (``Service.add_replica_listener``)."""
        if self._closed:
            return
        self._dirty = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._publish(), name="rollout-view-push")

    async def _publish(self) -> None:
        while self._dirty:
            self._dirty = False
            try:
                await asyncio.wait_for(self.workers.attach.fanout(self.views()), VIEW_PUSH_TIMEOUT_S)
                self.pushes += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a dead worker gets the views in its resync
                logger.warning("rollout workers: sending the roles' new replicas failed: %r", exc)

    async def close(self) -> None:
        """No more pushes, even if replicas change while the roles stop."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def start_rollout_workers(
    roles: Roles,
    count: int,
    settings: GroupSettings,
    worker_cls: type[RolloutWorker] | None = None,
    **options: Any,
) -> tuple[ServiceInterface, ViewPublisher]:
    """Start ``count`` workers (``worker_cls``: a subclass of ``RolloutWorker``) attached to
    ``roles``' services and keep them current; returns the workers' service (set it as
    ``roles.rollout``) and the publisher (close it before the roles stop)."""

    def views() -> dict[str, ServiceView]:
        return {name: service_view(s) for name, s in roles.services().items() if name in ATTACHED_ROLES}

    async def resync(mesh: Any) -> None:  # a restarted worker attaches before it takes orders
        await mesh.attach.call_one(views())

    options = {"procs": 1, "router": "least_loaded", "env": {**QUIET_ENV, ROLE_ENV: "rollout"}, **options}
    launcher = (worker_cls or RolloutWorker).options(name="rollout", num_replicas=count, **options)
    workers = await launcher.as_service(settings)
    try:
        workers.set_resync(resync)
        await asyncio.wait_for(workers.attach.fanout(views()), VIEW_PUSH_TIMEOUT_S)
    except BaseException:
        await workers.shutdown()
        raise
    publisher = ViewPublisher(workers, views)
    for name, service in roles.services().items():
        if name in ATTACHED_ROLES:
            service.add_replica_listener(publisher.changed)
    workers.add_replica_listener(publisher.changed)
    return workers, publisher


async def stop_rollout_workers(roles: Roles, views: ViewPublisher | None) -> None:
    """End the workers' part before the roles stop: no more view pushes, every group in a worker
    stopped with its clean-up done (``RolloutWorker.quiesce``), then the workers' service; sets
    ``roles.rollout`` to None. Never raises: the run is ending."""
    if views is not None:
        await views.close()
    workers, roles.rollout = roles.rollout, None
    if workers is None:
        return
    try:
        await asyncio.wait_for(workers.quiesce.fanout(), VIEW_PUSH_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - a dead worker has nothing left to clean up
        logger.debug("rollout workers: quiesce: %r", exc)
    await workers.shutdown()
