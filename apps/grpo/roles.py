"""The GRPO app's roles: start them (each on its own processes, GPUs split between them), stop
them, and name the role when a call to it fails."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge.controller import ForgeActor

logger = logging.getLogger("forge.grpo")


class RoleFailed(Exception):
    """A role (policy, reference, reward, trainer, buffer, dataset) failed; the run stops."""

    def __init__(self, role: str, error: BaseException | str) -> None:
        detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        super().__init__(f"role '{role}' failed: {detail}")
        self.role = role


# ----------------------------------------------------------------------------- roles
@dataclass
class Roles:
    """Handles of every role; services are routed, actors are called with ``call_one``."""

    policy: Any = None
    reference: Any = None
    reward: Any = None
    trainer: Any = None
    buffer: Any = None
    dataset: Any = None
    local: list[Any] = field(default_factory=list)

    def services(self) -> dict[str, Any]:
        return {
            n: s
            for n, s in (("policy", self.policy), ("reference", self.reference), ("reward", self.reward))
            if s is not None
        }


async def start_roles(cfg: Any, model_path: str) -> Roles:
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
        TrainerConfig,
        TrainerSettings,
    )

    p, t = cfg.policy, cfg.trainer
    policy_cfg = PolicyConfig(
        **settings(p, PolicySettings),
        model_path=model_path,
        group_size=cfg.group_size,
        seed=cfg.seed,
    )
    policy_cfg.engine_kwargs = {"use_tqdm_on_load": False, **p.engine_kwargs}
    reference_cfg = ReferenceConfig(model_path=model_path, temperature=p.temperature, dtype=cfg.reference.dtype)
    trainer_cfg = TrainerConfig(
        **settings(t, TrainerSettings),
        model_path=model_path,
        temperature=p.temperature,
        seed=cfg.seed,
        checkpoint_dir=cfg.checkpoint_dir if t.checkpoint_every else None,
    )
    dataset_cfg = DatasetConfig(
        source=cfg.data.source,
        path=cfg.data.path,
        prompt_template=cfg.data.prompt_template,
        seed=cfg.seed,
        options=dict(cfg.data.options),
    )
    # A role's failure ends the run (with a message naming it), so replicas are not restarted.
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

    async def service(role: str, actor_cls: type, arg: Any, env: dict[str, str], **options: Any) -> None:
        _show_gpus(gpus[role])
        section = getattr(cfg, role)
        setattr(
            roles,
            role,
            await actor_cls.options(
                name=role,
                procs=section.procs,
                num_replicas=section.num_replicas,
                with_gpus=section.with_gpus,
                env={**env, **section.env},
                max_restarts=0,
                **options,
            ).as_service(arg),
        )

    policy = functools.partial(
        service, "policy", Policy, policy_cfg, policy_env, endpoint_routers={"generate": PromptAffinity}
    )
    reference = functools.partial(service, "reference", ReferenceModel, reference_cfg, quiet, router="least_loaded")
    reward = functools.partial(service, "reward", RewardActor, dict(cfg.reward.fns), quiet, router="least_loaded")

    async def trainer() -> None:
        _show_gpus(gpus["trainer"])
        roles.trainer = await Trainer.options(
            name="trainer",
            procs=t.procs,
            with_gpus=t.with_gpus,
            env={**quiet, **t.env},
        ).as_actor(trainer_cfg)

    async def local() -> None:
        # Light roles live in the controller's process: no process start, no extra CPU.
        roles.buffer = this_proc().spawn("buffer", ReplayBuffer, cfg.max_policy_age, 4 * cfg.max_buffered_groups)
        roles.dataset = this_proc().spawn("dataset", Dataset, dataset_cfg)
        roles.local = [roles.buffer, roles.dataset]
        await asyncio.gather(roles.buffer.setup.call_one(), roles.dataset.setup.call_one())

    starters = {"policy": policy, "reference": reference, "reward": reward, "trainer": trainer, "buffer/dataset": local}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        results = await asyncio.gather(*(fn() for fn in starters.values()), return_exceptions=True)
    finally:
        _show_gpus(None if visible is None else visible.split(","), restore=True)
    for name, result in zip(starters, results):
        if isinstance(result, BaseException):
            await stop_roles(roles)
            raise RoleFailed(name, _describe(result)) from result
    return roles


def settings(section: Any, settings_cls: type) -> dict[str, Any]:
    """The fields of ``settings_cls`` (e.g. ``TrainerSettings``) as a config section holds them."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(settings_cls)}


GPU_ROLES = ("policy", "reference", "reward", "trainer")


def assign_gpus(cfg: Any) -> dict[str, list[str] | None]:
    """Disjoint GPU ids for the roles with ``with_gpus``, taken in order from the visible ones.

    forge's provisioner splits GPUs among the replicas of *one* service; separate services
    would each start counting at the first GPU, so the app gives each role its own slice.
    """
    from forge.controller.provisioner import visible_gpus

    need = {}
    for role in GPU_ROLES:
        section = getattr(cfg, role)
        if section.with_gpus:
            need[role] = section.procs * (section.num_replicas if role != "trainer" else 1)
    devices = visible_gpus() if need else []
    if sum(need.values()) > len(devices):
        wanted = ", ".join(f"{r} {n}" for r, n in need.items())
        raise ValueError(
            f"the roles with with_gpus need {sum(need.values())} GPUs ({wanted}) but {len(devices)} are visible "
            f"({devices}); set CUDA_VISIBLE_DEVICES, or lower procs/num_replicas"
        )
    out: dict[str, list[str] | None] = dict.fromkeys(GPU_ROLES)
    start = 0
    for role, n in need.items():
        out[role] = devices[start : start + n]
        start += n
    return out


def _show_gpus(devices: list[str] | None, restore: bool = False) -> None:
    """Make only ``devices`` visible to the next role started (None: leave or restore)."""
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    elif restore:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)


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


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:600]


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

        raise RoleFailed(role, _describe(translate_error(exc, role))) from exc


def prepare_model(cfg: Any) -> str:
    """The checkpoint folder; makes the tiny model there first if the config asks for it."""
    path = Path(cfg.model.path)
    if cfg.model.tiny.make_if_missing:
        from forge.models import make_tiny_model

        t = cfg.model.tiny
        make_tiny_model(
            path, arch=t.arch, hidden_size=t.hidden_size, num_layers=t.num_layers, seed=t.seed, init_std=t.init_std
        )
    elif not path.is_dir():
        raise FileNotFoundError(f"model.path {str(path)!r} is not a folder; point it at a Hugging Face checkpoint")
    return str(path.resolve())
