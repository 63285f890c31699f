"""The GRPO app's roles: which it starts (``role_specs``: the policy, reference, reward and env
services and the trainer; the buffer and the dataset in the controller's process) and how
(``start_roles``, with the ``faults`` section's restarts). Starting and stopping a role is
``apps.common.launch``'s; a failed call names its role (``apps.common.roles``)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apps.common.config import settings
from apps.common.inputs import make_model, prepare_data, records_source
from apps.common.launch import (
    Roles,
    RoleSpec,
    assign_gpus,
    policy_config,
    start_all,
    start_role,
)
from apps.common.roles import POLICY_ENV, QUIET_ENV
from forge.actors import Policy

logger = logging.getLogger("forge.grpo")

__all__ = ["fault_options", "prepare_model", "role_specs", "start_local", "start_roles", "trainer_config"]

if TYPE_CHECKING:
    from apps.common.launch import RunResources
    from apps.grpo.config import GRPOConfig
    from forge.actors.trainer import TrainerConfig


def role_specs(cfg: GRPOConfig, model_path: str, weights_dir: str | None = None) -> list[RoleSpec]:
    """The GRPO run's remote roles: the policy, reference, reward (and env) services and the
    trainer (and PPO's critic). ``weights_dir``: the run's weight folder, the only one its policy loads files from."""
    from forge.actors import ReferenceConfig, ReferenceModel, RewardActor, Trainer
    from forge.envs import SessionAffinity

    p = cfg.policy
    reference = ReferenceConfig(
        model_path=model_path,
        temperature=p.temperature,
        dtype=cfg.reference.dtype,
        pack_sequences=cfg.reference.pack_sequences,
    )
    generate: Any = "key_affinity"
    if cfg.weight_sync.mode == "rolling":  # new groups go to the replicas on the newest weights
        from forge.controller.routing import KeyAffinity
        from forge.controller.versions import NewestVersion

        generate = NewestVersion(KeyAffinity())
    endpoint_routers: dict[str, Any] = {"generate": generate, "generate_turn": SessionAffinity}
    if cfg.rollout.agent:  # an agent's turns (the front door's ``sample`` calls) go to the replica holding its prefix
        endpoint_routers["sample"] = "key_affinity"
    routers = {
        "endpoint_routers": endpoint_routers,
        "concurrent_batches": {"generate": p.concurrent_batches},
    }
    specs = [
        RoleSpec(
            "policy", Policy, policy_config(cfg, model_path, cfg.group_size, weights_dir), POLICY_ENV, options=routers
        ),
        RoleSpec("reference", ReferenceModel, reference, QUIET_ENV, options={"router": "least_loaded"}),
        RoleSpec("reward", RewardActor, dict(cfg.reward.fns), QUIET_ENV, options={"router": "least_loaded"}),
        RoleSpec("trainer", Trainer, trainer_config(cfg, model_path), QUIET_ENV, service=False),
    ]
    if cfg.algorithm == "ppo":
        from apps.grpo.ppo import critic_config

        specs.append(RoleSpec("critic", Trainer, critic_config(cfg, model_path), QUIET_ENV, service=False))
    if cfg.reward.models:
        from forge.actors.reward_model import RewardModel, RewardModelConfig

        rm = RewardModelConfig(model_paths=list(cfg.reward.models), dtype=cfg.reward_model.dtype)
        specs.append(RoleSpec("reward_model", RewardModel, rm, QUIET_ENV, options={"router": "least_loaded"}))
    if cfg.ref_from_base:  # the trainer scores the reference with its adapter off: no replicas
        specs = [s for s in specs if s.name != "reference"]
    if cfg.env.cls:
        from forge.envs import EnvActor, EnvConfig, EnvSessionRouter

        env = EnvConfig(cfg.env.cls, dict(cfg.env.options), model_path, cfg.env.step_timeout_s)
        specs.append(RoleSpec("env", EnvActor, env, QUIET_ENV, options={"router": EnvSessionRouter}))
    return specs


async def start_roles(cfg: GRPOConfig, model_path: str, resources: RunResources) -> Roles:
    """Start every role concurrently (the remote ones from ``role_specs``, on ``resources``' hosts
    and reading its weight folder; the buffer and the dataset in this process); if one fails to
    start, stop the others and raise."""
    roles = Roles()
    gpus = assign_gpus(cfg)
    starts: dict[str, Any] = {
        spec.name: start_role(spec, cfg, gpus, resources.host_pool, **fault_options(cfg))
        for spec in role_specs(cfg, model_path, resources.weights_dir)
    }
    starts["local"] = start_local(cfg, model_path, roles)
    await start_all(roles, starts)
    return roles


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


def prepare_model(cfg: GRPOConfig) -> str:
    """The checkpoint folder; makes the tiny model there first if the config asks for it. Checks
    that the file transport's folder has room for the model's weights before any role starts."""
    path = make_model(cfg.model)
    cfg.check_weight_sync_space(path)
    prepare_data(cfg.data)
    check_reward_models(list(cfg.reward.models), path)
    return str(path.resolve())


def check_reward_models(paths: list[str], policy_path: Path) -> None:
    """Each reward model is a scalar-head checkpoint (an error naming the path otherwise); one
    whose tokenizer is not the policy's is allowed, and said once: it re-tokenises the text."""
    from transformers import AutoTokenizer

    from forge.actors.reward_model import check_reward_checkpoint

    policy_vocab = None
    for path in paths:
        check_reward_checkpoint(path)
        if policy_vocab is None:
            policy_vocab = AutoTokenizer.from_pretrained(policy_path).get_vocab()
        if AutoTokenizer.from_pretrained(path).get_vocab() != policy_vocab:
            logger.warning(
                "reward model %s has another tokenizer than the policy (%s): it re-tokenises each completion's "
                "text with its own",
                path,
                policy_path,
            )
