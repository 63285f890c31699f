"""Start and stop an app's roles: each on processes of its own (``RoleSpec``, ``start_role``), started
together so that one that fails stops the others (``start_all``), with GPUs split between them
(``assign_gpus``); their handles (``Roles``), and their stop. The GRPO, SFT, eval and multi-adapter
apps each say which roles they start (their ``role_specs``) and start them with these."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apps.common.config import settings
from apps.common.roles import ROLE_ENV, SERVICE_ROLES, RoleFailed
from forge.controller import ForgeActor
from forge.controller.errors import describe

__all__ = [
    "GPU_ROLES",
    "RoleSpec",
    "Roles",
    "assign_gpus",
    "job_gone",
    "RunResources",
    "open_run",
    "policy_config",
    "start_all",
    "start_role",
    "stop_roles",
]

if TYPE_CHECKING:
    from monarch.actor import ActorMesh

    from apps.common.config import RunSections, WeightSyncSection
    from apps.common.weights import PolicyWeights
    from forge.actors import PolicyConfig
    from forge.controller import HostPool, ServiceInterface
    from forge.generation.weight_folder import RunFolder

logger = logging.getLogger("forge.apps")


@dataclass(frozen=True)
class RoleSpec:
    """One role that runs on processes of its own: its actor class and argument, and how it
    starts. ``name`` is also the config section that places it (procs, hosts, GPUs, env)."""

    name: str
    actor_cls: type
    arg: Any
    env: dict[str, str]
    """The role's processes' environment, under the section's own ``env``."""
    service: bool = True
    """A service (replicas that restart); False: one actor mesh (the trainer)."""
    options: dict[str, Any] = field(default_factory=dict)
    """More ``ActorOptions`` (routers)."""


@dataclass
class Roles:
    """Handles of an app's roles (a GRPO run has them all, SFT the trainer and the policy), and only
    those: what the run owns beside them is its ``RunResources``. Services are routed, actors are
    called with ``call_one``."""

    policy: ServiceInterface | None = None
    reference: ServiceInterface | None = None
    reward: ServiceInterface | None = None
    reward_model: ServiceInterface | None = None
    """The learned reward models' service (GRPO's ``reward.models``); None without them."""
    trainer: ActorMesh | None = None
    """The trainer: one SPMD actor mesh (``forge.distributed.call_spmd``)."""
    critic: ActorMesh | None = None
    """PPO's value function (GRPO's ``algorithm: ppo``): a second trainer mesh; None otherwise."""
    buffer: ActorMesh | None = None
    dataset: ActorMesh | None = None
    env: ServiceInterface | None = None
    """The environment service of multi-turn runs (``env.cls``); None for single-turn ones."""
    rollout: ServiceInterface | None = None
    """The rollout workers (``rollout.workers``), which make the groups from the controller's
    prompts; None: the controller makes them itself."""
    local: list[ActorMesh] = field(default_factory=list)
    """The actors in the controller's own process (buffer, dataset)."""

    def services(self) -> dict[str, ServiceInterface]:
        """Role name -> service handle, for the services that were started."""
        return {n: s for n in SERVICE_ROLES if (s := getattr(self, n)) is not None}

    async def stop(self, timeout_s: float = 60.0) -> None:
        """``stop_roles``: every started role, in parallel, within ``timeout_s``."""
        await stop_roles(self, timeout_s)


@dataclass
class RunResources:
    """What a run owns beside its roles, from before the first starts until after the last stops:
    the hosts' pool, the file transport's weight folder, and the trainer -> policy weight sync.
    The app's ``main`` opens it (``open_run``), hands it to what needs it and closes it."""

    host_pool: HostPool | None = None
    """The ``hosts`` section's pool (its job is killed on ``close``); None: this host."""
    weight_folder: RunFolder | None = None
    """The file transport's folder of this run (``forge.generation.weight_folder``), the only one
    its policy loads from; removed on ``close``. None for ``message``."""
    weights: PolicyWeights | None = None
    """The trainer -> policy weight sync, and what the policy replicas serve now; set once the
    trainer and the policy are up. None: a run without both (eval)."""

    @property
    def weights_dir(self) -> str | None:
        """The run's weight folder (the file transport's), or None."""
        return None if self.weight_folder is None else str(self.weight_folder.path)

    def close(self) -> None:
        """Release the hosts' job and remove the weight folder; never raises. Called after the
        roles stopped (their processes run on the pool's hosts and read the folder)."""
        if self.host_pool is not None:
            try:
                self.host_pool.close()  # a Slurm allocation is released, a ProcessJob's workers end
            except Exception as exc:
                logger.warning("the hosts' job did not stop cleanly: %s", exc)
            self.host_pool = None
        if self.weight_folder is not None:
            self.weight_folder.close()  # the weights in /dev/shm are memory until removed
            self.weight_folder = None


def replica_updates(cfg: RunSections) -> str:
    """How each policy replica takes an update (``PolicyConfig.weight_updates``): a rolling sync
    drains each replica in its turn; eval takes no updates."""
    mode = getattr(getattr(cfg, "weight_sync", None), "mode", "drain")
    return "drain" if mode == "rolling" else mode


def policy_config(cfg: RunSections, model_path: str, group_size: int, weights_dir: str | None = None) -> PolicyConfig:
    """The policy's ``PolicyConfig``: the ``policy`` section's settings and the run's model, seed
    and weight folder (the only one it loads files from; None: any path)."""
    from forge.actors import PolicyConfig, PolicySettings

    policy = PolicyConfig(
        **settings(cfg.policy, PolicySettings),
        model_path=model_path,
        group_size=group_size,
        seed=cfg.seed,
        weights_dir=weights_dir,
        lora=getattr(getattr(cfg, "trainer", None), "lora", None),  # LoRA: versions are adapters (eval has none)
        weight_updates=replica_updates(cfg),
    )
    policy.engine_kwargs = {"use_tqdm_on_load": False, **cfg.policy.engine_kwargs}
    return policy


async def start_role(
    spec: RoleSpec,
    cfg: RunSections,
    gpus: dict[str, list[str] | None],
    host_pool: HostPool | None,
    *,
    hosts: int | None = None,
    **service_options: Any,
) -> Any:
    """Start one role as its spec and its config section say; returns its handle. ``hosts``:
    hosts per replica instead of the section's (a trainer replaced on fewer hosts).
    ``service_options``: restart and health options for a service (``fault_options``)."""
    section = getattr(cfg, spec.name)
    options = {
        "name": spec.name,
        "env": {**spec.env, ROLE_ENV: spec.name, **section.env},
        "procs": section.procs,
        "hosts": hosts or section.hosts,
        "host_pool": host_pool,
        "gpus": gpus.get(spec.name),  # None for roles that never take GPUs (env)
        "gpus_per_proc": section.gpus_per_proc,
        **spec.options,
    }
    t0 = time.perf_counter()
    if not spec.service:
        handle = await spec.actor_cls.options(**options).as_actor(spec.arg)
    else:
        launcher = spec.actor_cls.options(num_replicas=section.num_replicas, **options, **service_options)
        handle = await launcher.as_service(spec.arg)
    logger.info("role %s started in %.1fs", spec.name, time.perf_counter() - t0)
    return handle


async def start_all(roles: Roles, starts: dict[str, Any]) -> None:
    """Run ``starts`` (role name -> coroutine returning its handle) concurrently and set each
    handle on ``roles``; if one fails, stop what did start and raise ``RoleFailed`` naming it."""
    names = list(starts)
    results = await asyncio.gather(*starts.values(), return_exceptions=True)
    for name, result in zip(names, results):
        if not isinstance(result, BaseException) and result is not None:
            setattr(roles, name, result)
    for name, result in zip(names, results):
        if isinstance(result, BaseException):
            await roles.stop()
            raise RoleFailed(name, describe(result, limit=600, typed=True)) from result


async def stop_roles(roles: Roles, timeout_s: float = 60.0) -> None:
    """Stop every started role (in parallel); never raises, never waits past ``timeout_s``."""
    stops = [svc.shutdown() for svc in roles.services().values()]
    stops += [ForgeActor.shutdown(mesh) for mesh in (roles.trainer, roles.critic) if mesh is not None]
    stops += [actor.stop() for actor in roles.local]

    async def stop(awaitable: Any) -> None:
        await awaitable

    try:
        await asyncio.wait_for(asyncio.gather(*(stop(s) for s in stops), return_exceptions=True), timeout_s)
    except asyncio.TimeoutError:
        logger.warning("some roles did not stop within %.0fs; their processes are reaped at exit", timeout_s)


async def job_gone(resources: RunResources) -> Exception | None:
    """Why the hosts' job stopped (a Slurm job cancelled or out of time), or None while it runs:
    checked whenever the run stops or a role dies, because a job gone is then the root cause."""
    pool = resources.host_pool
    if pool is None or pool.job is None:
        return None
    from forge.controller.hosts import JOB_CHECK_TIMEOUT_S

    try:
        return await asyncio.wait_for(asyncio.to_thread(pool.job_error), JOB_CHECK_TIMEOUT_S)
    except asyncio.TimeoutError:
        return None


async def open_run(cfg: RunSections, weight_sync: WeightSyncSection | None = None) -> RunResources:
    """What the run owns before any role starts: the ``hosts`` section's pool (its job queued and
    its hosts up), and with ``weight_sync``'s file transport the run's own weight folder under
    ``weight_sync.dir`` (a folder that others control stops the run here, naming it). None: the
    run's policy loads no trainer weights (eval). If the pool fails to open the folder is removed."""
    resources = RunResources()
    if weight_sync is not None and weight_sync.transport == "file":
        from forge.generation.weight_folder import RunFolder

        resources.weight_folder = RunFolder.create(weight_sync.root())
    if cfg.hosts.job != "none":
        from forge.controller.jobs import JOB_LOGS, open_host_pool

        try:
            resources.host_pool = await open_host_pool(cfg.hosts, Path(cfg.logging.output_dir) / JOB_LOGS)
        except BaseException:  # a cancelled open (Ctrl-C) too: nothing is left in /dev/shm
            resources.close()
            raise
    return resources


GPU_ROLES = ("policy", "reference", "reward", "reward_model", "trainer", "critic")
MESH_ROLES = ("trainer", "critic")
"""The roles that are one SPMD actor mesh, not a service of replicas."""


def assign_gpus(
    cfg: RunSections, visible: list[str] | None = None, roles: tuple[str, ...] = GPU_ROLES
) -> dict[str, list[str] | None]:
    """Each role's GPU ids, passed to its processes explicitly (``ActorOptions(gpus=...)``).

    A role whose section lists ``gpus`` gets exactly those; roles may list the same ids to share
    GPUs (the one-GPU config puts every role on GPU 0). The other roles with ``with_gpus`` get
    disjoint slices, in role order, of the ``visible`` devices (default: the ``hosts`` section's
    ``gpus_per_host``, else ``CUDA_VISIBLE_DEVICES`` or all) that no role lists. A role needs
    ``procs x gpus_per_proc x num_replicas`` ids (the trainer has one replica); over several hosts
    the same ids are used on each host. ``roles``: the config's sections that may take GPUs.
    """
    need: dict[str, int] = {}
    out: dict[str, list[str] | None] = dict.fromkeys(roles)
    for role in roles:
        section = getattr(cfg, role, None)
        if section is None:  # a role this app's config has no section for
            continue
        n = section.procs * section.gpus_per_proc * (section.num_replicas if role not in MESH_ROLES else 1)
        if section.gpus is not None:
            if len(section.gpus) != n:
                raise ValueError(
                    f"{role}.gpus lists {len(section.gpus)} device(s) {list(section.gpus)}, but the role needs "
                    f"{role}.procs x {role}.gpus_per_proc"
                    + (f" x {role}.num_replicas" if role not in MESH_ROLES else "")
                    + f" = {n}"
                )
            out[role] = [str(g) for g in section.gpus]
        elif section.with_gpus:
            need[role] = n
    if not need:
        return out
    if visible is None:  # the job's hosts' GPUs if the hosts section knows them, else this host's
        from forge.controller.provisioner import visible_gpus

        visible = cfg.hosts.host_gpus() or visible_gpus()
    listed = {g for ids in out.values() if ids for g in ids}
    free = [d for d in visible if d not in listed]
    if sum(need.values()) > len(free):
        wanted = ", ".join(f"{r} {n}" for r, n in need.items())
        raise ValueError(
            f"the roles with with_gpus need {sum(need.values())} GPUs ({wanted}) but {len(free)} are free "
            f"({free} of the visible {visible}); set CUDA_VISIBLE_DEVICES, lower procs/num_replicas, or "
            "let roles share GPUs with <role>.gpus"
        )
    start = 0
    for role, n in need.items():
        out[role] = free[start : start + n]
        start += n
    return out
