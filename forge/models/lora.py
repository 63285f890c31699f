"""LoRA through PEFT: the settings, the injection into a trainer's model, and the adapter's files.

Why LoRA: with an adapter of rank ``r`` on the attention projections, the trained (and
synchronised, and checkpointed) state is a few percent of the model, so a small machine can
train a model whose full optimizer state it could not hold, and a weight version that reaches
the policy is the adapter alone (``forge.generation.lora`` serves it beside the unchanged base).

Everything here goes through PEFT's own API (``LoraConfig``, ``get_peft_model``,
``get_peft_model_state_dict``, ``set_peft_model_state_dict``, ``merge_and_unload``,
``save_pretrained``), so the files are PEFT's format, which vLLM and ``transformers`` read:

- ``inject`` wraps a model before FSDP2 shards it (the LoRA layers must exist when the decoder
  layers are sharded) and freezes every base weight, so only the adapter is in the optimizer,
  in the gradients and in a checkpoint (``forge.checkpoint`` keeps trainable tensors only).
- ``adapter_tensors`` turns the trainer's full state of the trainable tensors into PEFT's names
  (``...q_proj.lora_A.weight``): what ``adapter_model.safetensors`` holds.
- ``write_adapter_folder`` writes ``adapter_config.json`` and ``adapter_model.safetensors``; the
  trainer calls it to publish a version, the policy to load one sent as a message.
- ``export_merged`` writes a run's final adapter and the base with the adapter merged in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "LoraSettings",
    "adapter_tensors",
    "random_adapter",
    "read_adapter_folder",
    "check_targets",
    "export_merged",
    "inject",
    "lora_config",
    "write_adapter_folder",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(kw_only=True)
class LoraSettings:
    """A LoRA adapter's shape: what ``trainer.lora`` holds (null there: full fine-tuning)."""

    rank: int = 8
    """Rank ``r`` of each adapter's two matrices (the policy's ``max_lora_rank`` must allow it)."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training (0 keeps the trainer's logprobs exact)."""
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Names of the linear layers that get an adapter (the last part of a module's name)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"trainer.lora.rank must be an integer >= 1, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"trainer.lora.alpha must be a number > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"trainer.lora.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
            raise ValueError(
                f"trainer.lora.target_modules must list module names, e.g. {list(DEFAULT_TARGETS)}, "
                f"got {self.target_modules!r}"
            )


def lora_config(settings: LoraSettings, base_model: str | None = None) -> Any:
    """PEFT's ``LoraConfig`` for ``settings`` (``base_model``: recorded in adapter_config.json)."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",  # vLLM serves no adapter bias
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers: what ``target_modules`` may name."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def check_targets(model: torch.nn.Module, targets: Sequence[str]) -> None:
    """A ``ValueError`` naming the first target the model has no linear layer for, and the ones it has.

    PEFT's own error on a missing target names none of the model's modules; and one present
    target is enough for PEFT to accept the others silently, leaving them untrained.
    """
    have = linear_names(model)
    missing = [t for t in targets if t not in have]
    if missing:
        raise ValueError(
            f"trainer.lora.target_modules names {missing[0]!r}, which {type(model).__name__} has no linear layer "
            f"called; its linear layers are {have}"
        )


def inject(model: torch.nn.Module, settings: LoraSettings, base_model: str) -> torch.nn.Module:
    """``model`` wrapped by PEFT with an adapter of ``settings``; only the adapter requires grad.

    Call it before sharding: FSDP2 then shards the base weights and the adapter of each layer
    together. The adapter's ``B`` starts at zero, so version 0 is the base model exactly.
    """
    from peft import get_peft_model

    check_targets(model, settings.target_modules)
    return get_peft_model(model, lora_config(settings, base_model))


def adapter_tensors(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter part of ``state`` (a state dict of the PEFT-wrapped ``model``) under PEFT's
    file names, contiguous: what ``adapter_model.safetensors`` holds."""
    from peft import get_peft_model_state_dict

    tensors = get_peft_model_state_dict(model, state_dict=dict(state))
    return {name: t.detach().contiguous() for name, t in tensors.items()}


def random_adapter(
    base_model: str, settings: LoraSettings, seed: int, scale: float
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The base at ``base_model`` with an adapter of random weights (``scale`` x a seeded normal;
    a fresh adapter's zero ``lora_B`` would change nothing), in eval mode, and the adapter's
    tensors: a known adapter for the tests and benchmarks that check what serves it."""
    from transformers import AutoModelForCausalLM

    model = inject(AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32), settings, base_model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    return model.eval(), adapter_tensors(model, model.state_dict())


def write_adapter_folder(
    folder: str | Path, tensors: Mapping[str, torch.Tensor], settings: LoraSettings, base_model: str
) -> Path:
    """``adapter_config.json`` and ``adapter_model.safetensors`` in ``folder`` (made if missing):
    an adapter folder in PEFT's format, which vLLM's ``LoRARequest`` and ``PeftModel`` load."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / ADAPTER_WEIGHTS), {"format": "pt"})
    lora_config(settings, base_model).save_pretrained(str(folder))
    return folder


def export_merged(
    base_model: str, settings: LoraSettings, tensors: Mapping[str, torch.Tensor], merged: Path, adapter: Path
) -> None:
    """The trained adapter as a PEFT folder (``adapter``) and the base with it merged in as a
    Hugging Face folder (``merged``: config, safetensors, tokenizer), from a fresh CPU copy of
    the base; the trainer's own (sharded) model is left as it is."""
    from peft import set_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    model = inject(base, settings, base_model)
    result = set_peft_model_state_dict(model, dict(tensors))
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"the adapter has tensors the model lacks, first {unexpected[0]!r}")
    model.save_pretrained(str(adapter))
    model.merge_and_unload().save_pretrained(str(merged))
    AutoTokenizer.from_pretrained(base_model).save_pretrained(str(merged))


def read_adapter_folder(folder: str | Path) -> tuple[LoraSettings, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter folder (``adapter_config.json``, ``adapter_model.safetensors``): its
    settings and its tensors under PEFT's names, as a multi-adapter policy takes them. A folder
    that is not one is a ``ValueError`` naming it and what is missing."""
    import json

    from safetensors.torch import load_file

    folder = Path(folder)
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{folder} is not a PEFT adapter folder: it has no {' or '.join(missing)}")
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder} holds a {config.get('peft_type')} adapter; only LoRA adapters are served")
    targets = config.get("target_modules") or []
    settings = LoraSettings(
        rank=int(config.get("r", 8)),
        alpha=float(config.get("lora_alpha", 8)),
        target_modules=sorted([targets] if isinstance(targets, str) else targets),
    )
    return settings, load_file(str(folder / ADAPTER_WEIGHTS))
