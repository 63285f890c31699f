"""Serving LoRA adapters on vLLM: one adapter per weight version, beside a base that never reloads.

Why: with ``trainer.lora`` the trained state is the adapter, a few percent of the model, so a
weight version is an adapter folder (PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``)
and vLLM loads it beside the base (``enable_lora``) in a fraction of a full reload. The pieces:

- ``lora_engine_kwargs``: vLLM's LoRA arguments. ``max_loras`` is 2, so the adapter being
  replaced and its successor can both be active: a request runs to its end on the adapter it
  was submitted with (``AdapterSlots``).
- ``serving_rank``: vLLM accepts only some ``max_lora_rank`` values (``VLLM_LORA_RANKS``); the
  policy's default is the smallest that holds the trainer's rank.
- ``check_serves_lora``: a model class vLLM has no LoRA layers for is refused when the policy
  starts, naming the architecture (vLLM itself fails later, inside the engine's start).
- ``AdapterSlots``: a new ``LoRARequest`` (name and integer id) per load, never reused: vLLM
  caches an adapter by its id, and a trainer restarted from a checkpoint publishes a version
  number again with other weights.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "VLLM_LORA_RANKS",
    "AdapterSlots",
    "ServedAdapter",
    "check_serves_lora",
    "lora_engine_kwargs",
    "serving_rank",
]

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM (0.32) accepts."""
ACTIVE_ADAPTERS = 2
"""Adapters vLLM keeps active at once: the one being served and the one replacing it."""


def serving_rank(trainer_rank: int, max_lora_rank: int = 0) -> int:
    """The engine's ``max_lora_rank``: ``max_lora_rank`` if set (it must be one vLLM accepts and
    hold ``trainer_rank``), else the smallest accepted value that holds ``trainer_rank``.
    A ``ValueError`` names the values otherwise."""
    if max_lora_rank:
        if max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"policy.max_lora_rank must be one of vLLM's {VLLM_LORA_RANKS}, got {max_lora_rank}")
        if trainer_rank > max_lora_rank:
            raise ValueError(
                f"trainer.lora.rank ({trainer_rank}) is above policy.max_lora_rank ({max_lora_rank}): the policy "
                f"could not load the adapter; lower the rank or raise policy.max_lora_rank (or leave it 0)"
            )
        return max_lora_rank
    fits = [r for r in VLLM_LORA_RANKS if r >= trainer_rank]
    if not fits:
        raise ValueError(
            f"trainer.lora.rank ({trainer_rank}) is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}"
        )
    return fits[0]


def lora_engine_kwargs(max_lora_rank: int) -> dict[str, Any]:
    """vLLM's arguments for an engine that serves adapters up to ``max_lora_rank``."""
    return {
        "enable_lora": True,
        "max_lora_rank": max_lora_rank,
        "max_loras": ACTIVE_ADAPTERS,
        "max_cpu_loras": ACTIVE_ADAPTERS,
    }


def check_serves_lora(model_dir: str | Path) -> None:
    """A ``ValueError`` unless vLLM has LoRA layers for the model class ``config.json`` names."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    config = json.loads((Path(model_dir) / "config.json").read_text())
    architectures = config.get("architectures") or []
    for arch in architectures:
        # The registry's own lazy loader: it imports the one model module, not all of them.
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is not None and supports_lora(cls):
            return
    raise ValueError(
        f"trainer.lora is set, but vLLM cannot serve LoRA adapters on the model at {model_dir} (architectures "
        f"{architectures}: vLLM has no LoRA layers for it); use a model vLLM serves with adapters (e.g. "
        "Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM) or train every weight (trainer.lora: null)"
    )


@dataclass
class ServedAdapter:
    """One adapter an engine holds, as ``generate(adapter=...)`` takes it: its ``LoRARequest``
    (None: the base alone) and the policy version its samples carry. Mutable: a multi-adapter
    policy swaps a newer version in place, so a holder of this object serves the newest."""

    request: Any
    version: int


class AdapterSlots:
    """The adapter an engine serves now, as a ``LoRARequest``; a fresh id and name per load."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)  # vLLM's adapter ids start at 1
        self.current: Any = None  # vllm.lora.request.LoRARequest, or None: the base (version 0)

    def next_request(self, folder: str | Path, version: int) -> Any:
        """A ``LoRARequest`` for the adapter folder of ``version``, never seen by the engine before."""
        from vllm.lora.request import LoRARequest

        n = next(self._ids)
        return LoRARequest(f"forge-v{version}-{n}", n, str(folder))
