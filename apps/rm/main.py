"""A reward model on Monarch actors: a scalar head over a causal LM's checkpoint, trained on
preference pairs with the Bradley-Terry loss, on the same trainer actor as GRPO and SFT.

Run (the tiny model and the addition preference pairs are made on the fly if missing):

    python -m apps.rm.main --config configs/rm_addition.yaml
    python -m apps.rm.main --config configs/rm_addition.yaml model.path=outputs/sft_addition/final_model
    python -m apps.rm.main --config configs/rm_addition.yaml --resume      # a killed run continues

Each step trains ``batch_size`` pairs (``apps.common.preferences``): the model scores the prompt
and each response (``transformers``' sequence-classification head with one output, read at the
last token) and the loss is ``-log sigmoid(score_chosen - score_rejected)``. Held-out pairs give
``eval/pairwise_accuracy`` (the share scored the right way round) and ``eval/loss``. The trainer
section shards (``trainer.procs``/``hosts``), checkpoints (``trainer.checkpoint_every``,
``--resume``) and exports as SFT's does.

``final_model`` is a Hugging Face sequence-classification folder, with the prompt format it was
trained on (``forge_prompt_format.json``), that the GRPO app's ``reward.models`` serves as a
batched ``RewardModel`` service.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import forge.controller  # noqa: F401  (before anything imports monarch)
from apps.common import cli
from apps.common.config import settings
from apps.common.launch import RoleSpec, RunResources
from apps.common.preferences import PreferenceApp, run_preferences
from apps.common.roles import QUIET_ENV, RoleFailed

if TYPE_CHECKING:
    from apps.rm.config import RMConfig


def role_specs(cfg: RMConfig, model_path: str, resources: RunResources) -> list[RoleSpec]:
    """The trainer alone, its model under a scalar head."""
    from forge.actors import Trainer, TrainerConfig
    from forge.actors.trainer import OptimizerSettings

    t = cfg.trainer
    trainer = TrainerConfig(
        **settings(t, OptimizerSettings),
        model_path=model_path,
        seed=cfg.seed,
        head="scalar",
        checkpoint_dir=cfg.checkpoint_dir if t.checkpoint_every else None,
        total_steps=cfg.steps,
    )
    return [RoleSpec("trainer", Trainer, trainer, QUIET_ENV, service=False)]


def write_format(cfg: RMConfig, folder: Path) -> None:
    """The prompt format the model was trained on, beside its weights: a ``RewardModel`` formats
    every prompt it scores the same way."""
    from forge.actors.reward_model import write_prompt_format

    write_prompt_format(folder, cfg.data.prompt_template, cfg.data.chat_template)


APP = PreferenceApp("rm", role_specs, after_export=write_format)


async def run(cfg: RMConfig, terminal, resume_from: Path | None = None) -> str:
    return await run_preferences(APP, cfg, terminal, resume_from)


main = cli.entry("rm", "apps.rm.config:RMConfig", run, __doc__, failures=(RoleFailed,))


if __name__ == "__main__":
    sys.exit(main())
