"""Many adapters, one policy: K LoRA GRPO runs, each with its own task, reward, trainer and buffer,
sharing one vLLM policy service of R replicas.

Run (the tiny model is made on the fly if missing):

    python -m apps.multi_lora.main --config configs/multi_lora_tiny.yaml
    python -m apps.multi_lora.main --config configs/multi_lora_tiny.yaml max_loras=1

What it does:

1. Each entry of ``runs`` is a GRPO run (``apps.grpo``'s config ``grpo``, then ``shared``, then
   its own overrides), trained by the GRPO app's own rollouts and step loop (``run.py``): its
   trainer trains its adapter, its reward scores its task, its buffer holds its groups, and
   ``<output_dir>/<name>/metrics.jsonl`` is its own record, with its own policy versions.
2. One ``MultiLoraPolicy`` service serves every run (``forge.actors.multi_lora_policy``): each
   request names its run's adapter as its model id, so forge's multiplexing batches each run's
   prompts together, shares the replicas' execution slots between the runs' batches, routes a
   run's prompts to the replicas holding its adapter (``model_aware``) and, with ``max_loras``
   below K, evicts the least recently used idle adapter of a replica to load another.
3. Every run syncs its adapter to every replica after each step (the replica keeps it on disk,
   and in vLLM if it holds it), so each run samples from its own newest version.
4. A run ends on its own: its steps done, or its failure (its reward raised, its trainer died, a
   role of its own would not start). It stops its roles and its adapter is evicted from every
   replica; the others go on. The job's ``summary.json`` says how each run ended, and the job
   exits non-zero if any run failed, naming it.

5. Each run trains as a GRPO run does (``apps.grpo.run_loop``): held-out evaluation
   (``eval.every``, through the run's adapter), checkpoints (``trainer.checkpoint_every``) and
   ``--resume`` (every run continues from its own newest checkpoint), a dead trainer replaced
   from its run's newest checkpoint (``faults.trainer_max_restarts``), multi-turn runs
   (``env.cls``: each turn sampled with the run's adapter, stamped with its version).

Simplifications: the policy's own metrics are not drained into any run's record (they would
mix the runs); a multi-turn run's turns are routed by adapter, not by session (a replica that
holds the adapter may not hold the session's prefix). Policy replicas restart as in the GRPO
app, and a restarted one loads every live run's newest adapter before it takes traffic.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import forge.controller  # noqa: F401  (before anything imports monarch)
from apps.common import cli
from apps.common.inputs import prepare_data
from apps.common.launch import policy_config, start_role
from apps.common.roles import RoleFailed
from apps.common.shared_adapters import multi_adapter_policy
from apps.grpo.roles import fault_options, prepare_model
from apps.multi_lora.adapters import SharedAdapters
from apps.multi_lora.run import RunResult, run_one

if TYPE_CHECKING:
    from apps.multi_lora.config import MultiLoraConfig, RunConfig

logger = logging.getLogger("forge.multi_lora")


class RunsFailed(RuntimeError):
    """Some runs of the job failed (the others finished)."""


async def start_policy(first: RunConfig, model_path: str, max_loras: int) -> Any:
    """The shared policy service, configured from the first run (the runs agree on it)."""
    cfg = first.grpo
    spec = multi_adapter_policy(policy_config(cfg, model_path, cfg.group_size), max_loras)
    return await start_role(spec, cfg, {}, None, **fault_options(cfg))


async def run(cfg: MultiLoraConfig, terminal: Any, resume_from: dict[str, Path | None] | None = None) -> str:
    """Start the shared policy, run every run to its own end (each from its checkpoint in
    ``resume_from``, if any), stop; returns the summary."""
    t0 = time.perf_counter()
    runs = cfg.run_configs()
    for r in runs:
        cli.record_config(r.grpo, terminal, f"multi_lora/{r.name}")
    model_path = prepare_model(runs[0].grpo)
    for r in runs[1:]:  # each run's own generated task, if it names one
        prepare_data(r.grpo.data)
    max_loras = cfg.adapters_per_replica
    policy = None
    try:
        policy = await start_policy(runs[0], model_path, max_loras)
    except Exception as exc:
        raise RoleFailed("policy", f"the shared policy did not start: {exc}") from exc
    try:
        adapters = SharedAdapters(policy, runs[0].grpo.faults.health_timeout_s)  # also the policy's resync hook
        points = resume_from or {}
        results = await asyncio.gather(*(run_one(r, adapters, model_path, terminal, points.get(r.name)) for r in runs))
        models = policy.metrics().get("models", {})
    finally:
        await policy.shutdown()
    return report(cfg, results, models, time.perf_counter() - t0)


def report(cfg: MultiLoraConfig, results: list[RunResult], models: dict[str, Any], seconds: float) -> str:
    """Write ``<output_dir>/summary.json``; the job's summary, or ``RunsFailed`` naming the failed runs."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    keep = ("loads", "evictions", "hits", "misses", "load_failures")
    summary = {
        "seconds": seconds,
        "max_loras": cfg.adapters_per_replica,
        "runs": [r.as_dict() for r in results],
        "policy_models": {k: models.get(k) for k in keep},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [f"multi_lora: {len(results)} runs in {seconds:.1f}s (summary {out / 'summary.json'})"]
    lines += [f"  {r.name}: {r.summary or 'FAILED: ' + r.error}" for r in results]
    failed = [r for r in results if not r.ok]
    if failed:
        names = ", ".join(f"{r.name} ({r.error})" for r in failed)
        raise RunsFailed(f"{len(failed)} of {len(results)} runs failed: {names}\n" + "\n".join(lines))
    return "\n".join(lines)


main = cli.entry(
    "multi_lora", "apps.multi_lora.config:MultiLoraConfig", run, __doc__, failures=(RoleFailed, RunsFailed)
)


if __name__ == "__main__":
    sys.exit(main())
