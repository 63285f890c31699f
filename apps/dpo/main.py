"""DPO on Monarch actors: the policy learns a preference directly, with no reward model, on the
same trainer actor as GRPO and SFT, against a frozen reference service.

Run (the addition preference pairs are made on the fly if missing):

    python -m apps.sft.main --config configs/sft_addition.yaml   # first: outputs/sft_addition/final_model
    python -m apps.dpo.main --config configs/dpo_addition.yaml
    python -m apps.dpo.main --config configs/dpo_addition.yaml trainer.dpo_loss=ipo trainer.dpo_beta=0.5
    python -m apps.dpo.main --config configs/dpo_addition.yaml --resume      # a killed run continues

Each step trains ``batch_size`` pairs (``apps.common.preferences``). A response's implicit reward
is ``dpo_beta`` times its sequence logprob under the trained model minus the reference's; the
loss is DPO's sigmoid loss on the pair's reward margin, or IPO's (``trainer.dpo_loss``). The
reference logprobs come from the reference service (``ReferenceModel``, the starting model at
temperature 1, batched and length-bucketed), once per pair: a pair seen again in a later epoch
reuses them. Held-out pairs give ``eval/pairwise_accuracy`` (the share whose chosen response
gets the higher implicit reward) and ``eval/loss``; with ``eval.generate`` the policy service
samples the held-out prompts on the step's weights (``eval/accuracy``, as SFT's). Sharding,
checkpoints, ``--resume`` and ``final_model`` are the trainer's, as in SFT.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import forge.controller  # noqa: F401  (before anything imports monarch)
from apps.common import cli
from apps.common.config import settings
from apps.common.evaluation import EvalPlan
from apps.common.launch import Roles, RoleSpec, RunResources, policy_config
from apps.common.preferences import PreferenceApp, run_preferences
from apps.common.roles import POLICY_ENV, QUIET_ENV, RoleFailed, call_role
from forge.data.preferences import PreferencePair
from forge.types import PreferenceExample

if TYPE_CHECKING:
    from apps.dpo.config import DPOConfig


def role_specs(cfg: DPOConfig, model_path: str, resources: RunResources) -> list[RoleSpec]:
    """The trainer (a causal LM with DPO's loss), the reference service, and with
    ``eval.generate`` the policy that samples the held-out prompts."""
    from forge.actors import Policy, ReferenceConfig, ReferenceModel, Trainer, TrainerConfig
    from forge.actors.trainer_config import DPOSettings, OptimizerSettings

    t = cfg.trainer
    trainer = TrainerConfig(
        **settings(t, OptimizerSettings),
        **settings(t, DPOSettings),
        model_path=model_path,
        seed=cfg.seed,
        checkpoint_dir=cfg.checkpoint_dir if t.checkpoint_every else None,
        total_steps=cfg.steps,
    )
    # Temperature 1: DPO compares the models' own distributions, as SFT trains them.
    reference = ReferenceConfig(model_path=model_path, temperature=1.0, dtype=cfg.reference.dtype)
    specs = [
        RoleSpec("trainer", Trainer, trainer, QUIET_ENV, service=False),
        RoleSpec("reference", ReferenceModel, reference, QUIET_ENV, options={"router": "least_loaded"}),
    ]
    if cfg.eval.generate:
        policy = policy_config(cfg, model_path, group_size=1, weights_dir=resources.weights_dir)
        specs.append(RoleSpec("policy", Policy, policy, POLICY_ENV))
    return specs


class PairReferences:
    """Each pair's reference logprobs (chosen, rejected), from the reference service once per
    pair: one request per pair (its two responses as one group), all of a batch's at once."""

    def __init__(self, reference: Any) -> None:
        self.reference = reference
        self.cache: dict[str, tuple[float, float]] = {}

    async def __call__(
        self, pairs: list[PreferencePair], examples: list[PreferenceExample]
    ) -> list[tuple[float, float]]:
        from forge.actors.reference_model import ResponseGroup

        todo = [(p.pair_id, e) for p, e in zip(pairs, examples) if p.pair_id not in self.cache]

        async def score(example: PreferenceExample) -> tuple[float, float]:
            chosen = int(example.chosen_ids.numel())
            group = ResponseGroup(
                example.prompt_ids,
                torch.cat([example.chosen_ids, example.rejected_ids]),
                [chosen, int(example.rejected_ids.numel())],
            )
            flat = await call_role("reference", self.reference.logprobs_groups.route(group))
            return float(flat[:chosen].sum()), float(flat[chosen:].sum())

        for (pair_id, _), refs in zip(todo, await asyncio.gather(*(score(e) for _, e in todo))):
            self.cache[pair_id] = refs
        return [self.cache[p.pair_id] for p in pairs]


async def on_started(cfg: DPOConfig, roles: Roles, resources: RunResources) -> None:
    """With a policy: the trainer -> policy weight sync (a restarted replica loads the served weights)."""
    from apps.common.weights import PolicyWeights

    if roles.policy is None:
        return
    resources.weights = PolicyWeights(
        roles.trainer, roles.policy, cfg.weight_sync.transport, resources.weights_dir, 300.0
    )
    roles.policy.set_resync(resources.weights.resync)


class SampledAccuracy:
    """``eval.generate``: the policy's accuracy on the held-out prompts, on the step's weights."""

    def __init__(self, plan: EvalPlan) -> None:
        self.plan = plan

    async def __call__(self, cfg: DPOConfig, roles: Roles, resources: RunResources, step: int) -> dict[str, float]:
        await resources.weights.sync()
        return await self.plan.run(roles.policy, step)


def eval_plan(cfg: DPOConfig) -> EvalPlan | None:
    """``eval.generate``'s held-out prompts, loaded and checked before any process starts."""
    from apps.common.inputs import make_model, prepare_data

    if not cfg.eval.generate:
        return None
    prepare_data(cfg.data)
    return EvalPlan.from_config(
        cfg.eval,
        cfg.data,
        str(make_model(cfg.model).resolve()),
        temperature=1.0,  # the samples' temperature when eval.temperature is 0
        max_tokens=cfg.policy.max_tokens,
        reward_fns=dict(cfg.eval.reward),
    )


async def run(cfg: DPOConfig, terminal: Any, resume_from: Path | None = None) -> str:
    plan = eval_plan(cfg)
    app = PreferenceApp(
        "dpo",
        role_specs,
        references=lambda cfg, roles: PairReferences(roles.reference),
        on_started=on_started,
        evaluate=None if plan is None else SampledAccuracy(plan),
        show=("loss", "eval/pairwise_accuracy", "eval/accuracy"),
    )
    return await run_preferences(app, cfg, terminal, resume_from)


main = cli.entry("dpo", "apps.dpo.config:DPOConfig", run, __doc__, failures=(RoleFailed,))


if __name__ == "__main__":
    sys.exit(main())
