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


async def _rolling_policy(config: PolicyConfig, replicas: int, **options: object) -> object:
    """A policy service of ``replicas`` whose ``generate`` prefers the newest version (as the GRPO
    app routes it in rolling mode)."""
    routers = {"endpoint_routers": {"generate": NewestVersion(KeyAffinity())}}
    return await Policy.options(num_replicas=replicas, env={"OMP_NUM_THREADS": "1"}, **routers, **options).as_service(
        config
    )


def _rolling_weights(policy: object, folder: Path) -> PolicyWeights:
    """The rolling weight sync of ``policy``, one replica at a time, with no trainer (the tests push)."""
    return PolicyWeights(None, policy, "message", str(folder), resync_timeout_s=120.0, max_updating=1)


async def test_a_rolling_push_loads_one_replica_at_a_time_while_the_others_serve(
    tiny_model_dir: Path, tiny_model_dir_alt: Path, tmp_path: Path
) -> None:
    config = PolicyConfig(model_path=str(tiny_model_dir), group_size=4, max_tokens=120, max_model_len=192)
    policy = await _rolling_policy(config, 3)
    try:
        weights = _rolling_weights(policy, tmp_path)
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


def _turns_per_replica(policy: object) -> list[int]:
    return [r.metrics()["endpoints"].get("generate_turn", {}).get("requests", 0) for r in policy.service.replicas]


async def test_a_session_keeps_its_replica_across_a_rolling_update(
    tiny_model_dir: Path, tiny_model_dir_alt: Path, tmp_path: Path
) -> None:
    """Each session's turns stay on the replica of its first turn, before, during and after a
    rolling push; the turns after it are the new version's. The routers are the GRPO app's own
    in rolling mode (``role_specs``)."""
    import torch

    from apps.grpo.config import GRPOConfig
    from apps.grpo.roles import role_specs
    from forge.config import load_config
    from forge.types import TurnRequest

    cfg = load_config(GRPOConfig, "configs/multiturn_tiny.yaml", ["weight_sync.mode=rolling", "policy.num_replicas=2"])
    routers = next(spec for spec in role_specs(cfg, str(tiny_model_dir)) if spec.name == "policy").options
    config = PolicyConfig(model_path=str(tiny_model_dir), group_size=1, max_tokens=40, max_model_len=192)
    policy = await Policy.options(num_replicas=2, env={"OMP_NUM_THREADS": "1"}, **routers).as_service(config)
    try:
        weights = _rolling_weights(policy, tmp_path)
        histories = {f"s{i}": torch.tensor([3 + i, 4, 5 + i]) for i in range(6)}
        home: dict[str, int] = {}

        async def turn(session: str) -> object:
            result = await policy.generate_turn.route(TurnRequest(session, histories[session]), key=session)
            histories[session] = torch.cat([histories[session], result.token_ids])
            return result

        for session in histories:  # one at a time: the replica that took it is the one whose count grew
            before = _turns_per_replica(policy)
            await turn(session)
            grown = [i for i, (a, b) in enumerate(zip(before, _turns_per_replica(policy))) if b > a]
            assert len(grown) == 1
            home[session] = grown[0]
        assert len(set(home.values())) == 2, home  # the sessions are spread over both replicas
        expected = [list(home.values()).count(i) for i in range(2)]

        before = _turns_per_replica(policy)
        push = asyncio.ensure_future(weights.push(str(tiny_model_dir_alt / "model.safetensors"), 1))
        await asyncio.wait_for(asyncio.gather(*(turn(s) for s in histories)), 120)  # during the roll
        await asyncio.wait_for(push, 240)
        during = [b - a for a, b in zip(before, _turns_per_replica(policy))]
        assert during == expected, (during, expected)

        for session, replica in home.items():  # after it, one at a time again
            before = _turns_per_replica(policy)
            result = await turn(session)
            grown = [i for i, (a, b) in enumerate(zip(before, _turns_per_replica(policy))) if b > a]
            assert grown == [replica], (session, grown, replica)
            assert result.policy_version == 1
    finally:
        await policy.shutdown()


async def test_a_rolling_push_of_weights_that_fail_validation_stops_naming_the_version_and_nothing_half_loads(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A state dict with a tensor of the wrong shape: the first replica refuses it before loading
    anything, the push stops with ``RoleFailed`` naming the version and the replicas' versions,
    and both replicas still serve version 0 and sample with it."""
    import torch
    from safetensors.torch import load_file

    from apps.common.roles import RoleFailed

    config = PolicyConfig(model_path=str(tiny_model_dir), group_size=2, max_tokens=8, max_model_len=64)
    policy = await _rolling_policy(config, 2)
    try:
        weights = _rolling_weights(policy, tmp_path)
        bad = load_file(str(tiny_model_dir / "model.safetensors"))
        name = next(n for n, t in bad.items() if t.dim() == 2)
        bad[name] = torch.zeros(bad[name].shape[0] + 1, bad[name].shape[1])
        with pytest.raises(RoleFailed, match=r"version 3 .*refused by replica 0.*replicas serve \[0, 0\]"):
            await asyncio.wait_for(weights.push(bad, 3), 120)
        assert await policy.version.fanout() == [0, 0]
        assert [r.version for r in policy.service.replicas] == [None, None]
        assert not any(r.updating for r in policy.service.replicas)
        prompts = [Prompt(prompt_id=str(i), text=f"{i}=", answer="") for i in range(4)]
        groups = await asyncio.wait_for(asyncio.gather(*(policy.generate.route(p) for p in prompts)), 60)
        assert all(g.policy_version == 0 for g in groups)
    finally:
        await policy.shutdown()


def _replica_process(mesh_name: str) -> object:
    """The process of the replica whose proc mesh is ``mesh_name`` (not its own children)."""
    import os

    import psutil

    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if child.environ().get("FORGE_PROC_MESH") == mesh_name and (
                child.parent().environ().get("FORGE_PROC_MESH") != mesh_name
            ):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no process of replica mesh {mesh_name}")


async def test_a_replica_killed_during_its_rolling_update_restarts_on_the_new_version_and_nothing_is_lost(
    tiny_model_dir: Path, tiny_model_dir_alt: Path, tmp_path: Path
) -> None:
    """SIGKILL of the replica the roll is updating (it is draining its batch): the push finishes,
    the dead replica restarts and resyncs to the pushed version before it takes traffic, and every
    group asked for before the kill comes back (resent to a live replica)."""
    import time

    from forge.controller import ReplicaState

    config = PolicyConfig(model_path=str(tiny_model_dir), group_size=4, max_tokens=120, max_model_len=192)
    policy = await _rolling_policy(config, 2, restart_backoff_s=0.1)
    try:
        weights = _rolling_weights(policy, tmp_path)
        policy.set_resync(weights.resync)
        prompts = [Prompt(prompt_id=str(i), text=f"{i}{i}=", answer="") for i in range(12)]
        pending = [asyncio.ensure_future(policy.generate.route(p, key=p.text)) for p in prompts]
        await asyncio.sleep(0.2)  # both replicas are generating
        push = asyncio.ensure_future(weights.push(str(tiny_model_dir_alt / "model.safetensors"), 1))
        deadline = time.monotonic() + 60
        while not any(r.updating for r in policy.service.replicas):
            assert time.monotonic() < deadline and not push.done(), "the roll never started"
            await asyncio.sleep(0.005)
        victim = next(r for r in policy.service.replicas if r.updating)
        _replica_process(victim.mesh_name).kill()

        await asyncio.wait_for(push, 240)
        groups = await asyncio.wait_for(asyncio.gather(*pending), 240)
        assert len(groups) == len(prompts) and all(len(g.completions) == 4 for g in groups)
        deadline = time.monotonic() + 180
        while not (victim.generation == 1 and victim.state is ReplicaState.HEALTHY):
            assert time.monotonic() < deadline, f"the killed replica did not come back ({victim.state})"
            await asyncio.sleep(0.2)
        assert [r.version for r in policy.service.replicas] == [1, 1]
        assert await policy.version.fanout() == [1, 1]
        assert not any(r.updating for r in policy.service.replicas)
    finally:
        await policy.shutdown()
