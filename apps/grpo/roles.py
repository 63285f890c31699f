"""The GRPO app's roles: start them (each on its own processes, GPUs split between them), stop
them, and name the role when a call to it fails."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge.controller import ForgeActor
from forge.controller.errors import describe

if TYPE_CHECKING:
    from apps.grpo.config import GRPOConfig
    from forge.actors.trainer import TrainerConfig

logger = logging.getLogger("forge.grpo")


class RoleFailed(Exception):
    """A call to a role (policy, reference, reward, trainer, buffer, dataset) failed, or the role
    is gone for good; ``error`` is forge's error for the failed call, if there was one."""

    def __init__(self, role: str, error: BaseException | str) -> None:
        detail = error if isinstance(error, str) else describe(error, limit=600, typed=True)
        super().__init__(f"role '{role}' failed: {detail}")
        self.role = role
        self.detail = detail
        self.error = error if isinstance(error, BaseException) else None

    @property
    def recoverable(self) -> bool:
        """Whether a service replica died or was restarting under the call (the service
        restarts it), rather than the role's own code failing: the call may be made again."""
        from forge.controller import NoHealthyReplica, ReplicaFailed, RequestTimeout

        return self.role in SERVICE_ROLES and isinstance(self.error, (ReplicaFailed, NoHealthyReplica, RequestTimeout))


SERVICE_ROLES = ("policy", "reference", "reward", "env")
"""The roles started as services: their replicas restart (``faults``) and the run goes on."""

ROLE_ENV = "FORGE_GRPO_ROLE"
"""Set to the role's name in each role's processes, so that tools (``ps e``, psutil, the
fault tests) can tell them apart."""


# ----------------------------------------------------------------------------- roles
@dataclass
class ServedWeights:
    """The weights every policy replica should serve; a restarted replica loads them before it
    takes traffic. ``weights`` is a state dict or a safetensors path; None: the model's own."""

    weights: Any = None
    version: int = 0


@dataclass
class Roles:
    """Handles of every role; services are routed, actors are called with ``call_one``."""

    policy: Any = None
    reference: Any = None
    reward: Any = None
    trainer: Any = None
    buffer: Any = None
    dataset: Any = None
    env: Any = None
    """The environment service of multi-turn runs (``env.cls``); None for single-turn ones."""
    local: list[Any] = field(default_factory=list)
    served: ServedWeights = field(default_factory=ServedWeights)
    """What the policy replicas serve now (set by each weight push)."""
    host_pool: Any = None
    """The ``hosts`` section's pool (its job is killed after the roles stop); None: this host."""
    weight_folder: Any = None
    """The file transport's folder of this run (``forge.generation.weight_folder.RunFolder``), the
    only one its policy loads from; removed after the roles stop. None for ``message``."""

    def services(self) -> dict[str, Any]:
        """Role name -> service handle, for the services that were started."""
        return {n: s for n in SERVICE_ROLES if (s := getattr(self, n)) is not None}


async def start_roles(cfg: GRPOConfig, model_path: str) -> Roles:
    """Start every role concurrently; if one fails to start, stop the others and raise."""
    from monarch.actor import this_proc

    from forge.actors import (
        Dataset,
        DatasetConfig,
        Policy,
        PolicyConfig,
        PolicySettings,
        PromptAffinity,
        ReferenceConfig,
        ReferenceModel,
        ReplayBuffer,
        RewardActor,
        Trainer,
    )
    from forge.envs import SessionAffinity

    p, t = cfg.policy, cfg.trainer
    policy_cfg = PolicyConfig(
        **settings(p, PolicySettings),
        model_path=model_path,
        group_size=cfg.group_size,
        seed=cfg.seed,
    )
    policy_cfg.engine_kwargs = {"use_tqdm_on_load": False, **p.engine_kwargs}
    reference_cfg = ReferenceConfig(
        model_path=model_path,
        temperature=p.temperature,
        dtype=cfg.reference.dtype,
        pack_sequences=cfg.reference.pack_sequences,
    )
    trainer_cfg = trainer_config(cfg, model_path)
    dataset_cfg = DatasetConfig(
        source=cfg.data.source,
        path=cfg.data.path,
        prompt_template=cfg.data.prompt_template,
        seed=cfg.seed,
        options=dict(cfg.data.options),
    )
    # Libraries' progress bars and notices stay off the terminal unless a role's env says
    # otherwise; vLLM also gets one OpenMP thread (more were never faster for small models on
    # shared cores).
    quiet = {
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "VLLM_LOGGING_LEVEL": "ERROR",  # any role that imports forge.generation imports vLLM
        "PYTHONWARNINGS": (
            "ignore::FutureWarning,ignore::DeprecationWarning,ignore::UserWarning:multiprocessing.resource_tracker"
        ),
    }
    policy_env = {**quiet, "OMP_NUM_THREADS": "1"}
    roles = Roles()

    gpus = assign_gpus(cfg)
    if cfg.hosts.job != "none":
        from forge.controller.jobs import host_pool_from

        roles.host_pool = host_pool_from(cfg.hosts)

    def placement(role: str) -> dict[str, Any]:
        """The role's ActorOptions for where it runs: processes, hosts and its own GPU ids."""
        section = getattr(cfg, role)
        return {
            "procs": section.procs,
            "hosts": section.hosts,
            "host_pool": roles.host_pool,
            "gpus": gpus.get(role),  # None for roles that never take GPUs (env)
            "gpus_per_proc": section.gpus_per_proc,
        }

    async def service(role: str, actor_cls: type, arg: Any, env: dict[str, str], **options: Any) -> None:
        section = getattr(cfg, role)
        setattr(
            roles,
            role,
            await actor_cls.options(
                name=role,
                num_replicas=section.num_replicas,
                env={**env, ROLE_ENV: role, **section.env},
                **placement(role),
                **fault_options(cfg),
                **options,
            ).as_service(arg),
        )

    policy = functools.partial(
        service,
        "policy",
        Policy,
        policy_cfg,
        policy_env,
        endpoint_routers={"generate": PromptAffinity, "generate_turn": SessionAffinity},
    )
    reference = functools.partial(service, "reference", ReferenceModel, reference_cfg, quiet, router="least_loaded")
    reward = functools.partial(service, "reward", RewardActor, dict(cfg.reward.fns), quiet, router="least_loaded")

    async def trainer() -> None:
        roles.trainer = await Trainer.options(
            name="trainer",
            env={**quiet, ROLE_ENV: "trainer", **t.env},
            **placement("trainer"),
        ).as_actor(trainer_cfg)

    async def local() -> None:
        # Light roles live in the controller's process: no process start, no extra CPU.
        roles.buffer = this_proc().spawn("buffer", ReplayBuffer, cfg.max_policy_age, 4 * cfg.max_buffered_groups)
        roles.dataset = this_proc().spawn("dataset", Dataset, dataset_cfg)
        roles.local = [roles.buffer, roles.dataset]
        await asyncio.gather(roles.buffer.setup.call_one(), roles.dataset.setup.call_one())

    starters = {"policy": policy, "reference": reference, "reward": reward, "trainer": trainer, "buffer/dataset": local}
    if cfg.env.cls:
        from forge.envs import EnvActor, EnvConfig, EnvSessionRouter

        env_cfg = EnvConfig(cfg.env.cls, dict(cfg.env.options), model_path, cfg.env.step_timeout_s)
        starters["env"] = functools.partial(service, "env", EnvActor, env_cfg, quiet, router=EnvSessionRouter)
    if cfg.weight_sync.transport == "file":  # before any role starts: a folder others control stops the run here
        from forge.generation.weight_folder import RunFolder

        try:
            roles.weight_folder = RunFolder.create(cfg.weight_sync.root())
        except BaseException:
            await stop_roles(roles)  # the hosts' job, if one was started
            raise
        policy_cfg.weights_dir = str(roles.weight_folder.path)
    results = await asyncio.gather(*(fn() for fn in starters.values()), return_exceptions=True)
    for name, result in zip(starters, results):
        if isinstance(result, BaseException):
            await stop_roles(roles)
            raise RoleFailed(name, describe(result, limit=600, typed=True)) from result
    return roles


def fault_options(cfg: GRPOConfig) -> dict[str, Any]:
    """The services' restart and health options (``ActorOptions``) from the ``faults`` section.

    A caller waits for a restarting role as long as the run would (``max_unhealthy_s``) before
    its call fails with ``NoHealthyReplica``; the run's own watch gives up on the role then.
    """
    f = cfg.faults
    return {
        "max_restarts": f.max_restarts,
        "restart_backoff_s": f.restart_backoff_s,
        "health_interval_s": f.health_interval_s,
        "health_timeout_s": f.health_timeout_s,
        "queue_timeout_s": f.max_unhealthy_s,
    }


def trainer_config(cfg: GRPOConfig, model_path: str) -> TrainerConfig:
    """The trainer's ``TrainerConfig``: the ``trainer`` section's settings plus what the run and
    the policy decide (temperature, seed, stop tokens, the generation limit ``dr_grpo`` needs)."""
    from forge.actors.trainer import TrainerConfig, TrainerSettings

    t = cfg.trainer
    return TrainerConfig(
        **settings(t, TrainerSettings),
        model_path=model_path,
        temperature=cfg.policy.temperature,
        seed=cfg.seed,
        checkpoint_dir=cfg.checkpoint_dir if t.checkpoint_every else None,
        stop_token_ids=list(cfg.policy.stop_token_ids),  # the loss trains nothing past the policy's stop
        max_response_tokens=cfg.max_response_tokens,  # dr_grpo's constant length
    )


def settings(section: Any, settings_cls: type) -> dict[str, Any]:
    """The fields of ``settings_cls`` (e.g. ``TrainerSettings``) as a config section holds them."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(settings_cls)}


GPU_ROLES = ("policy", "reference", "reward", "trainer")


def assign_gpus(cfg: GRPOConfig, visible: list[str] | None = None) -> dict[str, list[str] | None]:
    """Each role's GPU ids, passed to its processes explicitly (``ActorOptions(gpus=...)``).

    A role whose section lists ``gpus`` gets exactly those; roles may list the same ids to share
    GPUs (the one-GPU config puts every role on GPU 0). The other roles with ``with_gpus`` get
    disjoint slices, in role order, of the ``visible`` devices (default: the ``hosts`` section's
    ``gpus_per_host``, else ``CUDA_VISIBLE_DEVICES`` or all) that no role lists. A role needs
    ``procs x gpus_per_proc x num_replicas`` ids (the trainer has one replica); over several hosts
    the same ids are used on each host.
    """
    need: dict[str, int] = {}
    out: dict[str, list[str] | None] = dict.fromkeys(GPU_ROLES)
    for role in GPU_ROLES:
        section = getattr(cfg, role)
        n = section.procs * section.gpus_per_proc * (section.num_replicas if role != "trainer" else 1)
        if section.gpus is not None:
            if len(section.gpus) != n:
                raise ValueError(
                    f"{role}.gpus lists {len(section.gpus)} device(s) {list(section.gpus)}, but the role needs "
                    f"{role}.procs x {role}.gpus_per_proc"
                    + (f" x {role}.num_replicas" if role != "trainer" else "")
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


async def stop_roles(roles: Roles, timeout_s: float = 60.0) -> None:
    """Stop every started role (in parallel); never raises, never waits past ``timeout_s``."""
    stops = [svc.shutdown() for svc in roles.services().values()]
    if roles.trainer is not None:
        stops.append(ForgeActor.shutdown(roles.trainer))
    stops += [actor.stop() for actor in roles.local]

    async def stop(awaitable: Any) -> None:
        await awaitable

    try:
        await asyncio.wait_for(asyncio.gather(*(stop(s) for s in stops), return_exceptions=True), timeout_s)
    except asyncio.TimeoutError:
        logger.warning("some roles did not stop within %.0fs; their processes are reaped at exit", timeout_s)
    if roles.host_pool is not None:
        try:
            roles.host_pool.close()  # a Slurm allocation is released, a ProcessJob's workers end
        except Exception as exc:
            logger.warning("the hosts' job did not stop cleanly: %s", exc)
    if roles.weight_folder is not None:
        roles.weight_folder.close()  # the weights in /dev/shm are memory until removed


async def call_role(role: str, awaitable: Any) -> Any:
    """Await a call to ``role``; any failure becomes ``RoleFailed`` naming the role."""
    try:
        return await awaitable
    except asyncio.CancelledError:
        raise
    except RoleFailed:
        raise
    except Exception as exc:
        from forge.controller.replica import translate_error

        raise RoleFailed(role, translate_error(exc, role)) from exc


def prepare_model(cfg: GRPOConfig) -> str:
    """The checkpoint folder; makes the tiny model there first if the config asks for it. Checks
    that the file transport's folder has room for the model's weights before any role starts."""
    path = Path(cfg.model.path)
    if cfg.model.tiny.make_if_missing:
        from forge.models import make_tiny_model

        t = cfg.model.tiny
        make_tiny_model(
            path, arch=t.arch, hidden_size=t.hidden_size, num_layers=t.num_layers, seed=t.seed, init_std=t.init_std
        )
    elif not path.is_dir():
        raise FileNotFoundError(f"model.path {str(path)!r} is not a folder; point it at a Hugging Face checkpoint")
    cfg.check_weight_sync_space(path)
    return str(path.resolve())
