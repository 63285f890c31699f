"""How a GRPO run replaces a dead trainer (``apps.grpo.trainer_restart.TrainerRestarts``): how
often, from which checkpoint, and what the role watch and the step loop do around it. The
replacement itself is a tiny fake (its outcome scripted); the checkpoints are real. The
end-to-end replacements are in tests/integration/test_grpo_faults.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from apps.common.launch import Roles, RunResources
from apps.common.roles import RoleFailed
from apps.grpo.config import GRPOConfig
from apps.grpo.trainer_restart import TrainerRestarts
from forge.checkpoint import TrainingState, write_checkpoint
from forge.config import load_config
from forge.controller import ReplicaFailed


class _Watch:
    """``RoleWatch``'s part a restart uses: which roles were retired."""

    def __init__(self) -> None:
        self.retired: list[str] = []

    def retire(self, role: str) -> None:
        self.retired.append(role)


class _ScriptedRestarts(TrainerRestarts):
    """``TrainerRestarts`` whose new mesh dies while restoring as often as ``outcomes`` says."""

    def __init__(self, cfg: GRPOConfig, outcomes: list[BaseException | None]) -> None:
        super().__init__(cfg, "/m", Roles(), RunResources(), _Watch())
        self.outcomes = outcomes
        self.replaced: list[str] = []
        self.dead: list[str] = []  # the role each replacement was for

    async def _replace(self, checkpoint: str, dead: str = "trainer") -> tuple[int, int]:
        self.replaced.append(Path(checkpoint).name)
        self.dead.append(dead)
        outcome = self.outcomes.pop(0)
        if outcome is not None:
            raise outcome
        return 4, 4


def _died(n: int) -> RoleFailed:
    return RoleFailed("trainer", ReplicaFailed(f"its process died ({n})"))


def _cfg(tmp_path: Path, *overrides: str) -> GRPOConfig:
    """A run whose output folder holds two complete checkpoints, steps 2 and 4, and the folder a
    writer killed while writing step 6's."""
    cfg = load_config(
        GRPOConfig, None, ["model.path=/m", f"logging.output_dir={tmp_path}", "trainer.checkpoint_every=2", *overrides]
    )
    model = torch.nn.Linear(2, 2)
    for step in (2, 4):
        write_checkpoint(cfg.checkpoint_dir, model, torch.optim.AdamW(model.parameters()), TrainingState(step, step))
    (Path(cfg.checkpoint_dir) / ".tmp_killed").mkdir()
    (Path(cfg.checkpoint_dir) / ".tmp_killed" / "__0_0.distcp").write_bytes(b"half")
    return cfg


async def test_with_two_restarts_two_trainer_deaths_are_both_survived_and_a_third_stops_the_run(
    tmp_path: Path,
) -> None:
    """faults.trainer_max_restarts=2: each of two deaths gets a new trainer from the newest
    complete checkpoint (not a killed writer's folder); the third stops the run without a third
    replacement, naming every death."""
    restarts = _ScriptedRestarts(_cfg(tmp_path, "faults.trainer_max_restarts=2"), [None, None])
    assert await restarts.restart(_died(1)) == (4, 4)
    assert await restarts.restart(_died(2)) == (4, 4)
    assert restarts.restarts == 2 and restarts.replaced == ["step_00000004"] * 2
    with pytest.raises(RoleFailed) as stopped:
        await restarts.restart(_died(3))
    assert restarts.replaced == ["step_00000004"] * 2, "a third replacement past the limit"
    assert "death 1: " in stopped.value.detail and "death 3: " in stopped.value.detail, stopped.value.detail
    assert "continue from its newest checkpoint (step_00000004)" in stopped.value.detail


async def test_a_trainer_that_dies_while_restoring_is_replaced_again_and_counts_as_a_death(tmp_path: Path) -> None:
    """The new trainer dies while it restores: with a restart left, another one restores the same
    checkpoint (``restarts/trainer`` counts both); with none left the run stops naming both deaths."""
    restarts = _ScriptedRestarts(_cfg(tmp_path, "faults.trainer_max_restarts=2"), [_died(2), None])
    assert await restarts.restart(_died(1)) == (4, 4)
    assert restarts.replaced == ["step_00000004"] * 2 and restarts.restarts == 2
    assert restarts.deaths[1].endswith("(while restoring step_00000004)"), restarts.deaths

    once = _ScriptedRestarts(_cfg(tmp_path / "once"), [_died(2), None])  # the default: one restart
    with pytest.raises(RoleFailed) as stopped:
        await once.restart(_died(1))
    assert once.replaced == ["step_00000004"], "a second replacement past trainer_max_restarts=1"
    assert "death 2: " in stopped.value.detail and "while restoring step_00000004" in stopped.value.detail


async def test_a_new_trainer_whose_own_code_fails_while_restoring_is_not_replaced_again(tmp_path: Path) -> None:
    """An error of the trainer's own code while it restores (a bad checkpoint) would come again:
    it stops the run at once, restarts left or not."""
    bad = RoleFailed("trainer", ValueError("checkpoint does not fit the model"))
    restarts = _ScriptedRestarts(_cfg(tmp_path, "faults.trainer_max_restarts=3"), [bad])
    with pytest.raises(RoleFailed) as stopped:
        await restarts.restart(_died(1))
    assert stopped.value is bad and restarts.replaced == ["step_00000004"]


async def test_a_replaced_trainer_is_forgotten_by_the_watch_and_late_reports_of_its_processes_are_silenced() -> None:
    """``RoleWatch.retire``: the dead trainer's failure no longer ends the run, and a report of
    its mesh's processes that arrives after the replacement is expected, not a new failure."""
    from types import SimpleNamespace

    from apps.grpo.faults import RoleWatch

    watch = RoleWatch(load_config(GRPOConfig, None, ["model.path=/m"]))
    watch._actor_meshes["trainer-old"] = "trainer"  # what watch_actor records from the mesh's name
    assert watch(SimpleNamespace(mesh_name="trainer-old")) is True
    await asyncio.sleep(0)  # the report reaches the loop
    assert watch.failed.is_set() and watch.error is not None and watch.error.role == "trainer"
    watch.retire("trainer")
    assert not watch.failed.is_set() and watch.error is None
    assert watch(SimpleNamespace(mesh_name="trainer-old")) is True  # a late report of the dead mesh
    await asyncio.sleep(0)
    assert not watch.failed.is_set() and watch.error is None
    assert watch(SimpleNamespace(mesh_name="policy-x")) is False  # not ours: a service's own replica


def test_a_checkpoint_is_due_every_n_steps_and_at_the_last_step() -> None:
    """``trainer.checkpoint_every=3`` over 8 steps: steps 3, 6 and the last (8); none with 0."""
    from apps.grpo.training import checkpoint_due

    cfg = load_config(GRPOConfig, None, ["model.path=/m", "steps=8", "trainer.checkpoint_every=3"])
    assert [s for s in range(1, 9) if checkpoint_due(cfg, s)] == [3, 6, 8]
    cfg = load_config(GRPOConfig, None, ["model.path=/m", "steps=8", "trainer.checkpoint_every=0"])
    assert not any(checkpoint_due(cfg, s) for s in range(1, 9))


async def test_a_dead_critic_is_replaced_like_the_trainer_and_shares_its_restarts(tmp_path: Path) -> None:
    """PPO's critic dying (or hanging) is a restartable death of its own role: its mesh is the one
    replaced, from the same newest checkpoint, and its deaths count against the same limit; the
    run's final error names the critic."""
    from apps.grpo.trainer_restart import trainer_died

    critic_died = RoleFailed("critic", ReplicaFailed("its process died"))
    assert trainer_died(critic_died) and not trainer_died(RoleFailed("critic", ValueError("a bug")))
    assert not trainer_died(RoleFailed("policy", ReplicaFailed("its process died")))
    restarts = _ScriptedRestarts(_cfg(tmp_path, "algorithm=ppo", "critic={}"), [None])
    assert await restarts.restart(critic_died) == (4, 4)
    assert restarts.dead == ["critic"] and restarts.replaced == ["step_00000004"]
    assert restarts.deaths == ["critic: ReplicaFailed: its process died"], restarts.deaths
    with pytest.raises(RoleFailed) as stopped:  # the default allows one restart
        await restarts.restart(critic_died)
    assert stopped.value.role == "critic" and "death 2: critic: " in stopped.value.detail, stopped.value.detail
