"""The GRPO app's roles: start them (each on its own processes, GPUs split between them) and stop
them. (A failed call names its role: ``apps.common.roles``.)"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apps.common.roles import POLICY_ENV, QUIET_ENV, ROLE_ENV, SERVICE_ROLES, RoleFailed, call_role
from forge.actors import Policy
from forge.controller import ForgeActor
from forge.controller.errors import describe

__all__ = ["ROLE_ENV", "SERVICE_ROLES", "RoleFailed", "Roles", "call_role", "start_roles", "stop_roles"]

if TYPE_CHECKING:
    from monarch.actor import ActorMesh

    from apps.common.weights import PolicyWeights
    from apps.grpo.config import GRPOConfig
    from forge.actors import PolicyConfig
    from forge.actors.trainer import TrainerConfig
    from forge.controller import HostPool, ServiceInterface
    from forge.data.datasets import DataSource
    from forge.generation.weight_folder import RunFolder

logger = logging.getLogger("forge.grpo")


# ----------------------------------------------------------------------------- roles
@dataclass
class Roles:
    """Handles of every role; services are routed, actors are called with ``call_one``."""

    policy: ServiceInterface | None = None
    reference: ServiceInterface | None = None
    reward: ServiceInterface | None = None
    trainer: ActorMesh | None = None
    """The trainer: one SPMD actor mesh (``forge.distributed.call_spmd``)."""
    buffer: ActorMesh | None = None
    dataset: ActorMesh | None = None
    env: ServiceInterface | None = None
    """The environment service of multi-turn runs (``env.cls``); None for single-turn ones."""
    rollout: ServiceInterface | None = None
    """The rollout workers (``rollout.workers``), which make the groups from the controller's
    prompts; None: the controller makes them itself."""
    local: list[ActorMesh] = field(default_factory=list)
    """The actors in the controller's own process (buffer, dataset)."""
    weights: PolicyWeights | None = None
    """The trainer -> policy weight sync, and what the policy replicas serve now."""
    host_pool: HostPool | None = None
    """The ``hosts`` section's pool (its job is killed after the roles stop); None: this host."""
    weight_folder: RunFolder | None = None
    """The file transport's folder of this run (``forge.generation.weight_folder``), the only one
    its policy loads from; removed after the roles stop. None for ``message``."""

    @property
    def weights_dir(self) -> str | None:
        """The run's weight folder (the file transport's), or None."""
        return None if self.weight_folder is None else str(self.weight_folder.path)

    def services(self) -> dict[str, ServiceInterface]:
        """Role name -> service handle, for the services that were started."""
        return {n: s for n in SERVICE_ROLES if (s := getattr(self, n)) is not None}

    async def stop(self, timeout_s: float = 60.0) -> None:
        """``stop_roles``: every started role, in parallel, within ``timeout_s``."""
        await stop_roles(self, timeout_s)


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


def role_specs(cfg: GRPOConfig, model_path: str, weights_dir: str | None = None) -> list[RoleSpec]:
    """The GRPO run's remote roles: the policy, reference, reward (and env) services and the
    trainer. ``weights_dir``: the run's weight folder, the only one its policy loads files from."""
    from forge.actors import ReferenceConfig, ReferenceModel, RewardActor, Trainer
    from forge.envs import SessionAffinity

    p = cfg.policy
    reference = ReferenceConfig(
        model_path=model_path,
        temperature=p.temperature,
        dtype=cfg.reference.dtype,
        pack_sequences=cfg.reference.pack_sequences,
    )
    routers = {"endpoint_routers": {"generate": "key_affinity", "generate_turn": SessionAffinity}}
    specs = [
        RoleSpec(
            "policy", Policy, policy_config(cfg, model_path, cfg.group_size, weights_dir), POLICY_ENV, options=routers
        ),
        RoleSpec("reference", ReferenceModel, reference, QUIET_ENV, options={"router": "least_loaded"}),
        RoleSpec("reward", RewardActor, dict(cfg.reward.fns), QUIET_ENV, options={"router": "least_loaded"}),
        RoleSpec("trainer", Trainer, trainer_config(cfg, model_path), QUIET_ENV, service=False),
    ]
    if cfg.ref_from_base:  # the trainer scores the reference with its adapter off: no replicas
        specs = [s for s in specs if s.name != "reference"]
    if cfg.env.cls:
        from forge.envs import EnvActor, EnvConfig, EnvSessionRouter

        env = EnvConfig(cfg.env.cls, dict(cfg.env.options), model_path, cfg.env.step_timeout_s)
        specs.append(RoleSpec("env", EnvActor, env, QUIET_ENV, options={"router": EnvSessionRouter}))
    return specs


def policy_config(cfg: Any, model_path: str, group_size: int, weights_dir: str | None = None) -> PolicyConfig:
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
    )
    policy.engine_kwargs = {"use_tqdm_on_load": False, **cfg.policy.engine_kwargs}
    return policy


async def start_role(
    spec: RoleSpec,
    cfg: Any,
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


async def start_all(roles: Any, starts: dict[str, Any]) -> None:
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


async def start_roles(cfg: GRPOConfig, model_path: str) -> Roles:
    """Start every role concurrently (the remote ones from ``role_specs``, the buffer and the
    dataset in this process); if one fails to start, stop the others and raise."""
    roles = Roles()
    await open_weight_folder(cfg, roles)
    if cfg.hosts.job != "none":
        from forge.controller.jobs import JOB_LOGS, open_host_pool

        roles.host_pool = await open_host_pool(cfg.hosts, Path(cfg.logging.output_dir) / JOB_LOGS)
    gpus = assign_gpus(cfg)
    starts: dict[str, Any] = {
        spec.name: start_role(spec, cfg, gpus, roles.host_pool, **fault_options(cfg))
        for spec in role_specs(cfg, model_path, roles.weights_dir)
    }
    starts["local"] = start_local(cfg, model_path, roles)
    try:
        await start_all(roles, starts)
    except BaseException:  # a cancelled start (Ctrl-C, SIGTERM) too: the job is not left queued or running
        if roles.host_pool is not None:
            roles.host_pool.close()
        raise
    return roles


async def job_gone(roles: Roles) -> Exception | None:
    """Why the hosts' job stopped (a Slurm job cancelled or out of time), or None while it runs:
    checked whenever the run stops or a role dies, because a job gone is then the root cause."""
    pool = roles.host_pool
    if pool is None or pool.job is None:
        return None
    from forge.controller.hosts import JOB_CHECK_TIMEOUT_S

    try:
        return await asyncio.wait_for(asyncio.to_thread(pool.job_error), JOB_CHECK_TIMEOUT_S)
    except asyncio.TimeoutError:
        return None


async def open_weight_folder(cfg: Any, roles: Roles) -> None:
    """With the file transport, the run's own weight folder under ``weight_sync.dir``, before any
    role starts: a folder that others control stops the run here, naming it."""
    if cfg.weight_sync.transport == "file":
        from forge.generation.weight_folder import RunFolder

        roles.weight_folder = RunFolder.create(cfg.weight_sync.root())


async def start_local(cfg: GRPOConfig, model_path: str, roles: Roles) -> None:
    """The buffer and the dataset, in the controller's process: light roles need no process of
    their own (no start-up, no extra CPU)."""
    from monarch.actor import this_proc

    from forge.actors import Dataset, DatasetConfig, ReplayBuffer

    dataset = DatasetConfig(
        source=cfg.data.source,
        records=records_source(cfg.data),
        prompt_template=cfg.data.prompt_template,
        chat_model=model_path if cfg.data.chat_template else None,
        seed=cfg.seed,
        options=dict(cfg.data.options),
    )
    roles.buffer = this_proc().spawn("buffer", ReplayBuffer, cfg.max_policy_age, 4 * cfg.max_buffered_groups)
    roles.dataset = this_proc().spawn("dataset", Dataset, dataset)
    roles.local = [roles.buffer, roles.dataset]
    await asyncio.gather(roles.buffer.setup.call_one(), roles.dataset.setup.call_one())


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
        total_steps=cfg.steps,  # where a decaying lr_schedule reaches 0
        ref_from_base=cfg.ref_from_base,  # the loss scores the reference with the adapter off
    )


def records_source(section: Any) -> DataSource:
    """The ``forge.data.DataSource`` fields of a config section (a ``data`` or ``eval.data``)."""
    from forge.data.datasets import DataSource

    return DataSource(**settings(section, DataSource))


def settings(section: Any, settings_cls: type) -> dict[str, Any]:
    """The fields of ``settings_cls`` (e.g. ``TrainerSettings``) as a config section holds them."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(settings_cls)}


GPU_ROLES = ("policy", "reference", "reward", "trainer")


def assign_gpus(
    cfg: Any, visible: list[str] | None = None, roles: tuple[str, ...] = GPU_ROLES
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
        roles.weight_folder = None


def prepare_model(cfg: GRPOConfig) -> str:
    """The checkpoint folder; makes the tiny model there first if the config asks for it. Checks
    that the file transport's folder has room for the model's weights before any role starts."""
    path = make_model(cfg.model)
    cfg.check_weight_sync_space(path)
    prepare_data(cfg.data)
    return str(path.resolve())


def make_model(section: Any) -> Path:
    """The ``model`` section's checkpoint folder; the tiny model is made there first if the
    section asks for it (``tiny.make_if_missing``)."""
    path = Path(section.path)
    if section.tiny.make_if_missing:
        from forge.models import make_tiny_model

        t = section.tiny
        make_tiny_model(
            path, arch=t.arch, hidden_size=t.hidden_size, num_layers=t.num_layers, seed=t.seed, init_std=t.init_std
        )
    elif not path.is_dir():
        raise FileNotFoundError(f"model.path {str(path)!r} is not a folder; point it at a Hugging Face checkpoint")
    check_tokenizer(path, section.tokenizer)
    return path


def check_tokenizer(model_path: Path, expected: str = "") -> None:
    """``model_path``'s tokenizer fits its embeddings and, if ``expected`` names a folder, is the
    same as that folder's (vocabulary, special tokens, chat template); a ``ValueError`` naming
    both otherwise. A checkpoint trained with another tokenizer reads every prompt as other tokens."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = AutoConfig.from_pretrained(model_path).get_text_config().vocab_size
    if len(tokenizer) > rows:
        raise ValueError(
            f"model.path {str(model_path)!r}: its tokenizer has {len(tokenizer)} tokens but its embeddings only "
            f"{rows} rows; the tokenizer is not the model's"
        )
    if not expected:
        return
    other = AutoTokenizer.from_pretrained(expected)
    mine, theirs = tokenizer.get_vocab(), other.get_vocab()
    differences = [f"{len(mine)} tokens vs {len(theirs)}"] if len(mine) != len(theirs) else []
    differences += [f"{t!r} is id {mine[t]} vs {theirs.get(t)}" for t in sorted(mine) if mine[t] != theirs.get(t)][:3]
    for name in ("eos_token", "pad_token", "bos_token", "chat_template"):
        if getattr(tokenizer, name, None) != getattr(other, name, None):
            differences.append(f"{name} {getattr(tokenizer, name, None)!r} vs {getattr(other, name, None)!r}")
    if differences:
        raise ValueError(
            f"model.path {str(model_path)!r} has another tokenizer than model.tokenizer {expected!r}: "
            + "; ".join(differences[:4])
            + ". Train the checkpoint from that tokenizer's model, or point model.tokenizer at its own"
        )


def prepare_data(section: Any) -> None:
    """Write a generated task's records at ``section.path`` if it names one and nothing is there
    (``data.make_if_missing``)."""
    if section.make_if_missing and section.path:
        from forge.data.arithmetic import make_task_data

        make_task_data(section.path, dict(section.make_if_missing))
