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
from apps.common.roles import POLICY_ENV, ROLE_ENV, RoleFailed
from apps.grpo.roles import assign_gpus, make_model, prepare_data, settings

if TYPE_CHECKING:
    from apps.eval.config import EvalAppConfig


async def run(cfg: EvalAppConfig, terminal: Any, resume_from: Path | None = None) -> str:
    """Start a policy service on ``model.path``, evaluate it, stop it; returns the JSON line."""
    from forge.actors import Policy, PolicyConfig, PolicySettings

    t_start = time.perf_counter()
    cli.record_config(cfg, terminal, "eval")
    model_path = str(make_model(cfg.model).resolve())
    prepare_data(cfg.data)
    p = cfg.policy
    plan = EvalPlan.from_config(  # the records are loaded and checked before the engine starts
        cfg.eval, cfg.data, model_path, temperature=p.temperature, max_tokens=p.max_tokens, reward_fns={}
    )
    host_pool = None
    if cfg.hosts.job != "none":
        from forge.controller.jobs import host_pool_from

        host_pool = host_pool_from(cfg.hosts)
    policy_cfg = PolicyConfig(**settings(p, PolicySettings), model_path=model_path, group_size=1, seed=cfg.seed)
    policy_cfg.engine_kwargs = {"use_tqdm_on_load": False, **p.engine_kwargs}
    policy = None
    try:
        try:
            policy = await Policy.options(
                name="policy",
                num_replicas=p.num_replicas,
                procs=p.procs,
                hosts=p.hosts,
                host_pool=host_pool,
                gpus=assign_gpus(cfg, roles=("policy",))["policy"],
                gpus_per_proc=p.gpus_per_proc,
                env={**POLICY_ENV, ROLE_ENV: "policy", **p.env},
            ).as_service(policy_cfg)
        except Exception as exc:
            raise RoleFailed("policy", exc) from exc
        metrics = await plan.run(policy, 0)
    finally:
        if policy is not None:
            await policy.shutdown()
        if host_pool is not None:
            host_pool.close()
    metrics.pop("eval/step", None)
    result = {"model": model_path, **metrics, "wall_s": time.perf_counter() - t_start}
    out = Path(cfg.logging.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    return json.dumps(result)


def main(argv: list[str] | None = None) -> int:
    """Entry point: returns the process exit code (``apps.common.cli``)."""

    def schema() -> type:
        from apps.eval.config import EvalAppConfig

        return EvalAppConfig

    return cli.main(
        "eval",
        schema,
        run,
        argv,
        description="Evaluate a checkpoint on held-out records.",
        resumable=False,
        failures=(RoleFailed,),
    )


if __name__ == "__main__":
    sys.exit(main())
