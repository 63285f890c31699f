"""``ReferenceModel``: the frozen initial model, scoring sequences for GRPO's KL term.

Callers send one ``(prompt_ids, response_ids)`` pair each::

    ref_lp = await reference.logprobs.route((completion.prompt_ids, completion.token_ids))

and get back the per-token logprobs of the response (float32 ``[T]``). The service prebatches
pairs by *length bucket* (the ``Batching`` key), so a batch holds sequences of similar length
and its right padding stays small; one forward pass scores the whole batch. The padding
fraction of each batch (pad tokens / all tokens in the padded batch) is kept and reported by
``stats()``.

The logprobs use the sampler's temperature (``log_softmax(logits / T)``), like the trainer's
and vLLM's processed logprobs, so the k3 KL compares like with like.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from forge.controller import Batching, ForgeActor, endpoint
from forge.models import sequence_logprobs

__all__ = ["ReferenceConfig", "ReferenceModel", "length_bucket"]

# Lengths up to this share one bucket; above it each bucket spans ~25% more tokens, so a batch
# pads each sequence by less than a quarter of its length.
_BUCKET_BASE = 32
_BUCKET_GROWTH = 1.25


def length_bucket(pair: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Batching key of a pair: a geometric bucket of its total length (prompt + response)."""
    n = int(pair[0].numel()) + int(pair[1].numel())
    if n <= _BUCKET_BASE:
        return 0
    return 1 + int(math.log(n / _BUCKET_BASE, _BUCKET_GROWTH))


@dataclass(kw_only=True)
class ReferenceConfig:
    """The reference model's checkpoint and how it scores."""

    model_path: str
    """Hugging Face checkpoint folder: the policy's initial weights."""
    temperature: float = 1.0
    """The sampler's temperature; logprobs are ``log_softmax(logits / temperature)``."""
    dtype: str = "float32"
    """Weights dtype (``bfloat16`` on GPUs)."""
    pad_id: int = 0
    """Token id used for padding (masked out; any valid id works)."""


class ReferenceModel(ForgeActor):
    """Frozen causal LM with a batched, length-bucketed ``logprobs`` endpoint."""

    def __init__(self, config: ReferenceConfig) -> None:
        self.config = config
        self.model: torch.nn.Module | None = None
        self.device = torch.device("cpu")
        self.stats_ = {"batches": 0, "sequences": 0, "real_tokens": 0, "padded_tokens": 0, "forward_s": 0.0}

    @endpoint
    async def setup(self) -> None:
        from transformers import AutoModelForCausalLM

        if torch.cuda.is_available():
            self.device = torch.device("cuda")
        dtype = getattr(torch, self.config.dtype)
        model = AutoModelForCausalLM.from_pretrained(self.config.model_path, dtype=dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)

    @endpoint(batch=Batching(max_size=128, max_wait_s=0.005, key=length_bucket))
    async def logprobs(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Per-token logprobs of each response given its prompt, one forward pass per batch."""
        t0 = time.perf_counter()
        prompts = [p for p, _ in pairs]
        responses = [r for _, r in pairs]
        out = sequence_logprobs(self.model, prompts, responses, self.config.temperature, self.config.pad_id)
        lengths = [int(p.numel()) + int(r.numel()) for p, r in pairs]
        s = self.stats_
        s["forward_s"] += time.perf_counter() - t0
        s["batches"] += 1
        s["sequences"] += len(pairs)
        s["real_tokens"] += sum(lengths)
        s["padded_tokens"] += max(lengths) * len(lengths)
        return out

    @endpoint
    async def stats(self) -> dict[str, float]:
        """Batches, sequences, forward seconds and ``padding_fraction`` since start."""
        s = dict(self.stats_)
        s["padding_fraction"] = 1.0 - s["real_tokens"] / s["padded_tokens"] if s["padded_tokens"] else 0.0
        s["mean_batch_size"] = s["sequences"] / s["batches"] if s["batches"] else 0.0
        return s
