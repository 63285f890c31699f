"""One policy service serving many runs' adapters: a real Monarch replica running a real vLLM.

``MultiLoraPolicy`` with one replica that holds one adapter at a time (``max_models=1``), two
adapters with random non-zero weights: each request is served by the adapter it names (PEFT's
logprobs for that adapter, in transformers, in this process), at its newest version, through
LRU evictions and reloads; a stopped run's adapter is retired out of vLLM; an unknown one is
refused naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from forge.actors import PolicyConfig  # noqa: E402
from forge.actors.multi_lora_policy import MultiLoraPolicy, multi_lora_engine_kwargs  # noqa: E402
from forge.models import sequence_logprobs  # noqa: E402
from forge.models.lora import LoraSettings, random_adapter  # noqa: E402
from forge.types import Prompt  # noqa: E402
from tests.numerics import assert_close_to_scale  # noqa: E402

pytestmark = pytest.mark.timeout(240)

SETTINGS = LoraSettings(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj", "down_proj"])
PROMPTS = [Prompt(prompt_id=str(i), text=t, answer="") for i, t in enumerate(["371=", "12*4=", "1+2=1+2="])]
TIMEOUT_S = 60.0


def _adapter(model_dir: Path, seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A PEFT model over the tiny base with random adapter weights, and its adapter tensors."""
    return random_adapter(str(model_dir), SETTINGS, seed, scale=0.3)


async def _check(svc, adapter_id: str, want_model: torch.nn.Module, version: int) -> None:
    groups = [await svc.generate_adapter.route(p, model_id=adapter_id, timeout=TIMEOUT_S) for p in PROMPTS]
    completions = [c for g in groups for c in g.completions]
    assert {c.policy_version for c in completions} == {version}, adapter_id
    want = sequence_logprobs(want_model, [c.prompt_ids for c in completions], [c.token_ids for c in completions], 1.0)
    got = torch.cat([c.logprobs for c in completions])
    assert_close_to_scale(got, torch.cat(want), rel=1e-3, scale=1.0, what=f"{adapter_id} v{version} logprobs")


async def test_each_request_is_served_by_its_adapters_newest_version_through_lru_and_retire(
    tiny_model_dir: Path,
) -> None:
    """max_models=1, adapters a and b: a, b, a (each load evicts the other), a's version 2 swapped
    in while a is held, then b after a's retirement; vLLM never holds more than one adapter
    between calls, and none once both are retired."""
    config = PolicyConfig(
        model_path=str(tiny_model_dir),
        lora=SETTINGS,
        group_size=2,
        max_tokens=4,
        max_model_len=64,
        kv_cache_bytes=16 << 20,
        engine_kwargs={"use_tqdm_on_load": False, **multi_lora_engine_kwargs(1)},
    )
    (model_a, a1), (model_b, b1), (model_a2, a2) = (_adapter(tiny_model_dir, s) for s in (1, 2, 3))
    svc = await MultiLoraPolicy.options(num_replicas=1, max_models=1, name="policy").as_service(config)
    try:
        for adapter_id in ("a", "b"):
            await svc.add_adapter.fanout(adapter_id, timeout=TIMEOUT_S)
        await svc.update_adapter.fanout("a", a1, 1, timeout=TIMEOUT_S)
        await svc.update_adapter.fanout("b", b1, 1, timeout=TIMEOUT_S)
        await _check(svc, "a", model_a, 1)
        await _check(svc, "b", model_b, 1)  # evicts a
        await _check(svc, "a", model_a, 1)  # evicts b, reloads a from the replica's own copy
        [held] = await svc.adapters.fanout(timeout=TIMEOUT_S)
        assert held == {"loaded": {"a": 1}, "known": ["a", "b"], "vllm_loras": 1}
        await svc.update_adapter.fanout("a", a2, 2, timeout=TIMEOUT_S)  # a is held: swapped in at once
        await _check(svc, "a", model_a2, 2)
        models = svc.metrics()["models"]
        assert models["loads"] == 3 and models["evictions"] == 2, models

        assert await svc.retire_model("a", timeout_s=TIMEOUT_S) == 1
        assert await svc.forget_adapter.fanout("a", timeout=TIMEOUT_S) == [True]
        [held] = await svc.adapters.fanout(timeout=TIMEOUT_S)
        assert held == {"loaded": {}, "known": ["b"], "vllm_loras": 0}
        await _check(svc, "b", model_b, 1)  # room was free: loaded without evicting anything
        assert svc.metrics()["models"]["evictions"] == 3  # a's retirement was the third
        with pytest.raises(Exception, match=r"adapter 'a' is not served by this policy"):
            await svc.generate_adapter.route(PROMPTS[0], model_id="a", timeout=TIMEOUT_S)
    finally:
        await svc.shutdown()
