"""Evaluate any checkpoint on held-out records: greedy accuracy, pass@k, mean@k, reward, length.

Run:

    python -m apps.eval.main --config configs/eval_addition.yaml model.path=outputs/sft_addition/final_model
    python -m apps.eval.main --config configs/eval_addition.yaml model.path=<folder> eval.samples=16

It is the evaluation the GRPO and SFT apps run during training (``forge.evaluation``, the same
prompts formatting and the same reward), on a policy service of its own: the figures of a run's
last evaluation and of this app on that run's ``final_model`` are the same measurement. Prints
one JSON line and writes it to ``<logging.output_dir>/eval.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import forge.controller  # noqa: F401  (before anything imports monarch)
from apps.common import cli
from apps.common.evaluation import EvalPlan
from apps.common.inputs import make_model, prepare_data
from apps.common.launch import RoleSpec, assign_gpus, open_run, policy_config, start_role
from apps.common.roles import POLICY_ENV, RoleFailed

if TYPE_CHECKING:
    from apps.eval.config import EvalAppConfig


async def run(cfg: EvalAppConfig, terminal: Any, resume_from: Path | None = None) -> str:
    """Start a policy service on ``model.path``, evaluate it, stop it; returns the JSON line."""
    from forge.actors import Policy

    t_start = time.perf_counter()
    cli.record_config(cfg, terminal, "eval")
    model_path = str(make_model(cfg.model).resolve())
    prepare_data(cfg.data)
    p = cfg.policy
    plan = EvalPlan.from_config(  # the records are loaded and checked before the engine starts
        cfg.eval, cfg.data, model_path, temperature=p.temperature, max_tokens=p.max_tokens, reward_fns={}
    )
    resources = await open_run(cfg)  # the hosts' pool only: the policy loads no trainer weights
    spec = RoleSpec("policy", Policy, policy_config(cfg, model_path, group_size=1), POLICY_ENV)
    policy = None
    try:
        try:
            policy = await start_role(spec, cfg, assign_gpus(cfg, roles=("policy",)), resources.host_pool)
        except Exception as exc:
            raise RoleFailed("policy", exc) from exc
        out = Path(cfg.logging.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        metrics = await plan.run(policy, 0, samples_file=out / "samples.jsonl" if cfg.write_samples else None)
    finally:
        if policy is not None:
            await policy.shutdown()
        resources.close()
    metrics.pop("eval/step", None)
    result = {"model": model_path, **metrics, "wall_s": time.perf_counter() - t_start}
    (out / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    return json.dumps(result)


main = cli.entry("eval", "apps.eval.config:EvalAppConfig", run, __doc__, resumable=False, failures=(RoleFailed,))


if __name__ == "__main__":
    sys.exit(main())
