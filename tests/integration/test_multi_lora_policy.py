"""One policy service serving many runs' adapters: a real Monarch replica running a real vLLM.

``MultiLoraPolicy`` with one replica that holds one adapter at a time (``max_models=1``), two
adapters with random non-zero weights, synced as the multi-adapter app syncs them
(``apps.multi_lora.adapters``): each request is served by the adapter it names (PEFT's logprobs
for that adapter, in transformers, in this process), at its newest version, through LRU
evictions and reloads and through a SIGKILL of the replica (the restarted one resyncs every live
run's newest adapter); a stopped run's adapter is retired out of vLLM; an unknown one is refused
naming it. The same replica refuses adapter folders it must not trust (``update_weights``, the
LoRA policy's file-transport path): one outside its run's weight folder, one another user wrote.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from apps.common.roles import ROLE_ENV  # noqa: E402
from apps.grpo.faults import role_processes  # noqa: E402
from apps.multi_lora.adapters import AdapterWeights, SharedAdapters  # noqa: E402
from forge.actors import PolicyConfig  # noqa: E402
from forge.actors.multi_lora_policy import MultiLoraPolicy, multi_lora_engine_kwargs  # noqa: E402
from forge.controller.replica import ReplicaState  # noqa: E402
from forge.generation.weight_folder import private_folder  # noqa: E402
from forge.models import sequence_logprobs  # noqa: E402
from forge.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSettings, random_adapter, write_adapter_folder  # noqa: E402
from forge.types import Prompt, SampleRequest, TurnRequest  # noqa: E402
from tests.numerics import assert_close_to_scale  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SETTINGS = LoraSettings(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj", "down_proj"])
PROMPTS = [Prompt(prompt_id=str(i), text=t, answer="") for i, t in enumerate(["371=", "12*4=", "1+2=1+2="])]
TIMEOUT_S = 60.0
NOBODY = 65534


def _adapter(model_dir: Path, seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A PEFT model over the tiny base with random adapter weights, and its adapter tensors."""
    return random_adapter(str(model_dir), SETTINGS, seed, scale=0.3)


async def _check(svc, adapter_id: str, want_model: torch.nn.Module, version: int) -> None:
    """Rollouts (``generate_adapter``), held-out samples (``sample_adapter``) and multi-turn turns
    (``generate_turn_adapter``) naming ``adapter_id``: each sampled with that adapter's ``version``."""
    groups = [await svc.generate_adapter.route(p, model_id=adapter_id, timeout=TIMEOUT_S) for p in PROMPTS]
    samples = [SampleRequest(p, n=2, temperature=1.0, max_tokens=4) for p in PROMPTS]
    groups += await asyncio.gather(
        *(svc.sample_adapter.route(r, model_id=adapter_id, timeout=TIMEOUT_S) for r in samples)
    )
    completions = [c for g in groups for c in g.completions]
    assert {c.policy_version for c in completions} == {version}, adapter_id
    prompt_ids, token_ids = [c.prompt_ids for c in completions], [c.token_ids for c in completions]
    got = [c.logprobs for c in completions]
    history = completions[0].prompt_ids
    turn = await svc.generate_turn_adapter.route(TurnRequest("s", history), model_id=adapter_id, timeout=TIMEOUT_S)
    assert turn.policy_version == version, adapter_id
    prompt_ids, token_ids, got = [*prompt_ids, history], [*token_ids, turn.token_ids], [*got, turn.logprobs]
    want = sequence_logprobs(want_model, prompt_ids, token_ids, 1.0)
    assert_close_to_scale(
        torch.cat(got), torch.cat(want), rel=1e-3, scale=1.0, what=f"{adapter_id} v{version} logprobs"
    )


async def _refuses_untrusted_adapter_folders(svc, run_folder: Path, tmp_path: Path, tensors: dict) -> None:
    """An adapter folder outside the run's weight folder, and one in it whose weights another
    user owns: both refused by the replica before anything loads, naming the file and the rule."""
    outside = tmp_path / "elsewhere" / "v1"
    write_adapter_folder(outside, tensors, SETTINGS, "base")
    with pytest.raises(Exception, match=rf"{outside / ADAPTER_CONFIG} is not under this run's weight folder"):
        await svc.update_weights.fanout(str(outside), 1, timeout=TIMEOUT_S)
    if os.geteuid() != 0:
        pytest.skip("making a file of another user needs root (the tests run as root here)")
    foreign = run_folder / "v1"
    write_adapter_folder(foreign, tensors, SETTINGS, "base")
    os.chown(foreign / ADAPTER_WEIGHTS, NOBODY, NOBODY)  # in the run's folder, but someone else's file
    with pytest.raises(Exception, match=rf"{foreign / ADAPTER_WEIGHTS} belongs to uid {NOBODY}; the policy loads"):
        await svc.update_weights.fanout(str(foreign), 1, timeout=TIMEOUT_S)


async def _restarted(svc, deadline_s: float) -> None:
    """Until the service's one replica is back (generation 1) and takes traffic again."""
    [replica] = svc.service.replicas
    deadline = time.monotonic() + deadline_s
    while not (replica.generation == 1 and replica.state is ReplicaState.HEALTHY):
        assert time.monotonic() < deadline, f"the killed replica was not back in {deadline_s:g} s ({replica.state})"
        await asyncio.sleep(0.2)


async def test_each_request_is_served_by_its_adapters_newest_version_through_lru_restart_and_retire(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """max_models=1, adapters a and b: a, b, a (each load evicts the other), a's version 2 swapped
    in while a is held, b's version 2 recorded while it is not; after a SIGKILL of the replica the
    restarted one serves a's and b's version 2 (PEFT's logprobs for each); then b after a's
    retirement; vLLM never holds more than one adapter between calls, and none once both are
    retired. Untrusted adapter folders are refused on the same replica."""
    run_folder = private_folder(tmp_path / "weights" / "run")
    config = PolicyConfig(
        model_path=str(tiny_model_dir),
        lora=SETTINGS,
        group_size=2,
        max_tokens=4,
        max_model_len=64,
        kv_cache_bytes=16 << 20,
        weights_dir=str(run_folder),
        engine_kwargs={"use_tqdm_on_load": False, **multi_lora_engine_kwargs(1)},
    )
    (model_a, a1), (model_b, b1), (model_a2, a2), (model_b2, b2) = (_adapter(tiny_model_dir, s) for s in (1, 2, 3, 4))
    svc = await MultiLoraPolicy.options(
        num_replicas=1, max_models=1, name="policy", restart_backoff_s=0.1, env={ROLE_ENV: "policy"}
    ).as_service(config)
    try:
        adapters = SharedAdapters(svc, TIMEOUT_S)  # the app's record of every run's newest adapter, and resync
        weights = {}
        for adapter_id in ("a", "b"):
            await adapters.add(adapter_id)
            weights[adapter_id] = AdapterWeights(None, adapters, adapter_id, TIMEOUT_S)  # push needs no trainer
        await weights["a"].push(a1, 1)
        await weights["b"].push(b1, 1)
        await _check(svc, "a", model_a, 1)
        await _check(svc, "b", model_b, 1)  # evicts a
        await _check(svc, "a", model_a, 1)  # evicts b, reloads a from the replica's own copy
        [held] = await svc.adapters.fanout(timeout=TIMEOUT_S)
        assert held == {"loaded": {"a": 1}, "known": ["a", "b"], "vllm_loras": 1}
        await weights["a"].push(a2, 2)  # a is held: swapped in at once
        await _check(svc, "a", model_a2, 2)
        models = svc.metrics()["models"]
        assert models["loads"] == 3 and models["evictions"] == 2, models
        await weights["b"].push(b2, 2)  # b is not held: only recorded

        [victim] = role_processes(os.getpid(), "policy")
        victim.kill()
        await _restarted(svc, 120.0)
        [held] = await svc.adapters.fanout(timeout=TIMEOUT_S)
        assert held == {"loaded": {}, "known": ["a", "b"], "vllm_loras": 0}  # resynced, nothing loaded yet
        await _check(svc, "b", model_b2, 2)
        await _check(svc, "a", model_a2, 2)  # evicts b

        evictions = svc.metrics()["models"]["evictions"]
        assert await adapters.retire("a") == 1
        [held] = await svc.adapters.fanout(timeout=TIMEOUT_S)
        assert held == {"loaded": {}, "known": ["b"], "vllm_loras": 0}
        await _check(svc, "b", model_b2, 2)  # room was free: loaded without evicting anything
        assert svc.metrics()["models"]["evictions"] == evictions + 1  # a's retirement, no other
        with pytest.raises(Exception, match=r"adapter 'a' is not served by this policy"):
            await svc.generate_adapter.route(PROMPTS[0], model_id="a", timeout=TIMEOUT_S)
        await _refuses_untrusted_adapter_folders(svc, run_folder, tmp_path, a1)  # last: its second part needs root
    finally:
        await svc.shutdown()
