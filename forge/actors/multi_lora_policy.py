"""``MultiLoraPolicy``: one vLLM policy serving many runs' LoRA adapters, each request naming its own.

Several GRPO runs (``apps.multi_lora``) each train an adapter over the same frozen base. One
policy service serves them all, through forge's model multiplexing
(``forge.controller.multiplex``): the model id of a request is its run's adapter id, so

- ``generate_adapter.route(prompt, model_id=run)`` batches a run's prompts with that run's
  others (one vLLM call per batch, one adapter per call), and the runs' batches share the
  replica's execution slots;
- ``model_aware`` routing keeps a run's prompts on the replicas that hold its adapter;
- a replica holds at most ``max_models`` adapters in vLLM (the service's
  ``options(max_models=...)``; vLLM's ``max_loras`` is set to match): past that the least
  recently used idle one is evicted (``unload_adapter``), and loaded again when named.

A run's weight sync (``update_adapter``) reaches every replica: each records the version in its
``AdapterCatalog``, and a replica that holds the adapter swaps the new version in at once; one
that does not loads the newest from the catalog when a request needs it. So every request is
served by its run's newest adapter, and its completions carry that run's version. A stopped run's
adapter is evicted by the service (``retire_model``) and then forgotten (``forget_adapter``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from forge.actors.policy import PackedGroups, PackedTurns, Policy, PolicyConfig
from forge.controller import Batching, endpoint, model_loader
from forge.controller.multiplex import model_store
from forge.generation.lora import ServedAdapter
from forge.types import SampleRequest, TurnRequest

__all__ = ["MultiLoraPolicy", "multi_lora_engine_kwargs"]


def multi_lora_engine_kwargs(max_loras: int) -> dict[str, Any]:
    """vLLM's adapter limits for a replica that holds ``max_loras`` adapters: one more on the
    CPU side, so that a version swap (the new adapter loads before the old one is removed) never
    makes vLLM drop another run's adapter behind the multiplexing's back."""
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
        raise ValueError(f"max_loras must be an int >= 1 (adapters one policy replica holds), got {max_loras!r}")
    return {"max_loras": max_loras, "max_cpu_loras": max_loras + 1}


class MultiLoraPolicy(Policy):
    """A LoRA ``Policy`` whose ``generate_adapter`` serves the adapter each request names."""

    def __init__(self, config: PolicyConfig) -> None:
        if config.lora is None:
            raise ValueError(
                "MultiLoraPolicy serves LoRA adapters: its PolicyConfig needs lora (the runs' trainer.lora)"
            )
        from forge.generation.adapter_catalog import AdapterCatalog

        super().__init__(config)
        self._catalog = AdapterCatalog(config.lora, config.model_path)  # writes nothing until a version comes

    # ------------------------------------------------------------------ multiplexing
    @model_loader(unload="unload_adapter")  # how many: the service's options(max_models=...)
    async def load_adapter(self, adapter_id: str) -> ServedAdapter:
        """Load ``adapter_id``'s newest version into vLLM (the base alone before its first)."""
        folder, version = self._catalog.newest(adapter_id)
        if folder is None:
            return ServedAdapter(None, 0)
        return self.engine.load_adapter(folder, version)

    async def unload_adapter(self, adapter_id: str, adapter: ServedAdapter) -> None:
        """Evicted: free its vLLM slot at once."""
        self.engine.unload_adapter(adapter)

    @endpoint(batch=Batching(max_size=256, max_wait_s=0.002, debatch="unpack_groups"), multiplexed=True)
    async def generate_adapter(self, adapter: ServedAdapter, prompts: list[Any]) -> PackedGroups:
        """``group_size`` completions of each prompt, sampled with the batch's adapter and
        stamped with its version (through the service each caller gets its own ``PackedGroup``)."""
        cfg = self.config
        seeds = self.sample_seeds(prompts, adapter.version)
        texts = [p.text for p in prompts]
        outputs = await self._sample(texts, cfg.group_size, "policy/batch_prompts", adapter=adapter, seed=seeds)
        return PackedGroups.pack(prompts, outputs, adapter.version)

    @endpoint(batch=Batching(max_size=256, max_wait_s=0.002, debatch="unpack_groups"), multiplexed=True)
    async def sample_adapter(self, adapter: ServedAdapter, requests: list[SampleRequest]) -> PackedGroups:
        """``Policy.sample`` with the batch's adapter: held-out evaluation of one run beside its
        training. A multiplexed batch is keyed by the adapter alone, so it may mix settings (a
        greedy and a sampled request): one engine call per settings in the batch."""
        outputs = await self._sample_requests(requests, adapter.version, adapter=adapter)
        return PackedGroups.pack([r.prompt for r in requests], outputs, adapter.version)

    @endpoint(batch=Batching(max_size=256, max_wait_s=0.002, debatch="unpack_turns"), multiplexed=True)
    async def generate_turn_adapter(self, adapter: ServedAdapter, requests: list[TurnRequest]) -> PackedTurns:
        """``Policy.generate_turn`` with the batch's adapter: one multi-turn run's turns, each
        stamped with the adapter version that sampled it."""
        inputs = [r.history_ids for r in requests]
        samples = [group[0] for group in await self._sample(inputs, 1, "policy/turn_batch", adapter=adapter)]
        return PackedTurns.of(samples, adapter.version)

    @endpoint(batch=Batching(max_size=1), multiplexed=True)
    async def probe_adapter(
        self, adapter: ServedAdapter, prompts: list[list[int]]
    ) -> list[tuple[int, list[int], list[float]]]:
        """``Policy.probe`` with the adapter (a batch of one): the version served and one sample
        of the prompt's ids, for the trainer to score the same tokens after a restore."""
        (completions,) = await self._sample(prompts, 1, "policy/probe_batch", adapter=adapter, seed=[0])
        (sample,) = completions
        return [(adapter.version, sample.token_ids.tolist(), sample.logprobs.tolist())]

    @endpoint
    async def adapter_version(self, adapter_id: str) -> int:
        """The version of ``adapter_id`` this replica serves next (its catalog's newest; 0: the base)."""
        return self._catalog.newest(adapter_id)[1]

    # ------------------------------------------------------------------ the runs' weight syncs
    @endpoint
    async def add_adapter(self, adapter_id: str) -> None:
        """Serve ``adapter_id`` (a run's name) from now on, as the base until its first version."""
        self._catalog.add(adapter_id)

    @endpoint
    async def update_adapter(
        self, adapter_id: str, adapter: Mapping[str, torch.Tensor], version: int, rollback: bool = False
    ) -> int:
        """Record ``version`` of ``adapter_id`` (its tensors) as the one to serve; if this replica
        holds the adapter, swap it in now (endpoints run one at a time: no batch is mid-call).
        An older version than the one served is refused unless ``rollback`` (a run restored from
        its checkpoint: a resume, a replaced trainer). Returns ``version``."""
        folder = self._catalog.receive(adapter_id, adapter, version, rollback)
        held = model_store(self).models.get(adapter_id)
        if held is not None:
            new = self.engine.load_adapter(folder, version)
            old = ServedAdapter(held.request, held.version)
            held.request, held.version = new.request, new.version  # the store's object: next batches use it
            self.engine.unload_adapter(old)
        return version

    @endpoint
    async def forget_adapter(self, adapter_id: str) -> bool:
        """Stop serving ``adapter_id`` (its run stopped) and remove its folders; False if unknown.
        Call it after the service's ``retire_model``, which evicts it from vLLM."""
        store = model_store(self)
        if adapter_id in store.models:  # not retired through the service (a direct call): evict it here
            await store.evict(adapter_id)
        return self._catalog.forget(adapter_id)

    @endpoint
    async def adapters(self) -> dict[str, Any]:
        """What this replica serves: ``loaded`` (adapter id -> version, in vLLM now),
        ``known`` (the catalog's ids) and ``vllm_loras`` (how many adapters vLLM holds)."""
        loaded = {str(k): v.version for k, v in model_store(self).models.items()}
        return {
            "loaded": loaded,
            "known": self._catalog.ids(),
            "vllm_loras": len(self.engine.llm.llm_engine.list_loras()),
        }

    async def __cleanup__(self, exc: BaseException | None) -> None:
        await super().__cleanup__(exc)
        self._catalog.close()
