"""Weight-sync modes on real policy replicas: a rolling push loads a few replicas at a time.

Three tiny vLLM replicas behind one service. With ``max_updating=1`` the replicas' own records
of their updates (``Policy.update_times``) never overlap, every replica ends on the new version
(recorded in the service, where ``NewestVersion`` reads it), and each batch generated meanwhile
comes from one version (each replica drains before it loads).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from apps.common.weights import PolicyWeights  # noqa: E402
from forge.actors.policy import Policy, PolicyConfig  # noqa: E402
from forge.controller.routing import KeyAffinity  # noqa: E402
from forge.controller.versions import NewestVersion  # noqa: E402
from forge.types import Prompt  # noqa: E402

pytestmark = pytest.mark.timeout(300)


async def test_a_rolling_push_loads_one_replica_at_a_time_while_the_others_serve(
    tiny_model_dir: Path, tiny_model_dir_alt: Path, tmp_path: Path
) -> None:
    config = PolicyConfig(model_path=str(tiny_model_dir), group_size=4, max_tokens=120, max_model_len=192)
    policy = await Policy.options(
        num_replicas=3, env={"OMP_NUM_THREADS": "1"}, endpoint_routers={"generate": NewestVersion(KeyAffinity())}
    ).as_service(config)
    try:
        weights = PolicyWeights(None, policy, "message", str(tmp_path), resync_timeout_s=120.0, max_updating=1)
        prompts = [Prompt(prompt_id=str(i), text=f"{i}{i}=", answer="") for i in range(12)]
        pending = [asyncio.ensure_future(policy.generate.route(p, key=p.text)) for p in prompts]
        await asyncio.sleep(0.2)  # the replicas are generating when the push starts
        await asyncio.wait_for(weights.push(str(tiny_model_dir_alt / "model.safetensors"), 1), 240)
        groups = await asyncio.wait_for(asyncio.gather(*pending), 120)

        assert [r.version for r in policy.service.replicas] == [1, 1, 1]
        assert await policy.version.fanout() == [1, 1, 1]
        updates = sorted(u for replica_updates in await policy.update_times.fanout() for u in replica_updates)
        assert [u[2] for u in updates] == [1, 1, 1], updates
        for (_, loaded, _), (arrived, _, _) in zip(updates, updates[1:]):
            assert loaded <= arrived, f"two replicas were updating at once: {updates}"
        for group in groups:  # drained per replica: no sequence spans two versions
            assert all(len(set(c.token_versions.tolist())) <= 1 for c in group.completions)
        # New work now meets the newest version on every replica.
        assert all(
            g.policy_version == 1 for g in await asyncio.gather(*(policy.generate.route(p) for p in prompts[:3]))
        )
    finally:
        await policy.shutdown()
