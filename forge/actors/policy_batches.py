"""How a policy replica's batches travel back: ``PackedGroups`` (``generate``, ``sample``) and
``PackedTurns`` (``generate_turn``), a few flat tensors per batch (``forge.packing``), unpacked
into one ``PackedGroup`` or ``TurnResult`` per caller by the endpoints' debatch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from forge.packing import Packed, per_item, per_token, shared
from forge.types import Completion, PackedGroup, Prompt, TurnResult, oldest_version, top_logprobs_column
from forge.wire import split_for_wire

__all__ = ["PackedGroups", "PackedTurns"]


@dataclass
class PackedGroups(Packed):
    """One batch's groups in a few flat tensors, as they travel back from the replica.

    Monarch serialises each tensor of a message separately, at a fixed cost per tensor: a batch
    of 16 prompts x 8 completions as ``Completion`` objects is 384 tensors, a large share of the
    tiny model's generation time (``docs/benchmarks.md``); packed it is three. Its items are the
    completions, prompt after prompt (``group_sizes[i]`` of prompt ``i``: a batch of held-out
    requests may mix greedy and sampled ones); the prompts are shared. The service unpacks it into
    ``PackedGroup``s (the endpoint's ``debatch``), so callers of ``generate.route`` never see it.
    """

    prompts: list[Prompt] = shared()
    group_sizes: list[int] = shared()  # completions per prompt
    prompt_lens: list[int] = shared()  # per prompt
    prompt_ids: torch.Tensor = shared()  # int64 [sum of prompt lengths]
    response_lens: list[int] = per_item()  # per completion, prompt-major
    token_ids: torch.Tensor = per_token("response_lens", torch.long)
    logprobs: torch.Tensor = per_token("response_lens", torch.float32)
    texts: list[str] = per_item()
    finish_reasons: list[str] = per_item()
    policy_version: int = shared()
    """The version served when the batch ended."""
    token_versions: torch.Tensor | None = per_token("response_lens", torch.long, fill=-1)
    """The version that sampled each token (a batch may span an update)."""
    top_logprobs: list[Any] | None = per_item(fill=None)
    """Each completion's most likely tokens per position (``Completion.top_logprobs``); None: not asked for."""

    @classmethod
    def pack(cls, prompts: list[Prompt], outputs: list[list[Completion]], version: int) -> PackedGroups:
        """``outputs[i]``: the completions of ``prompts[i]`` (at least one)."""
        flat = [c for group in outputs for c in group]
        return cls.build(
            prompts=prompts,
            group_sizes=[len(g) for g in outputs],
            prompt_lens=[int(g[0].prompt_ids.numel()) for g in outputs],
            prompt_ids=torch.cat([g[0].prompt_ids for g in outputs]),
            policy_version=version,
            top_logprobs=top_logprobs_column(flat),
            **_sample_columns(flat),
        )

    def unpack(self) -> list[PackedGroup]:
        """One ``PackedGroup`` per prompt: slices of the flat tensors, no per-completion objects."""
        prompt_ids = split_for_wire(self.prompt_ids, self.prompt_lens)
        groups = self.split(self.group_sizes)
        return [
            PackedGroup(
                prompt,
                prompt_ids[i],
                g.token_ids,
                g.logprobs,
                g.response_lens,
                g.texts,
                g.finish_reasons,
                oldest_version(g.token_versions, g.policy_version),
                g.token_versions,
                g.top_logprobs,
            )
            for i, (prompt, g) in enumerate(zip(self.prompts, groups))
        ]


@dataclass
class PackedTurns(Packed):
    """One batch of multi-turn turns in flat tensors (two per batch, not two per turn)."""

    lens: list[int] = per_item()
    token_ids: torch.Tensor = per_token("lens", torch.long)
    logprobs: torch.Tensor = per_token("lens", torch.float32)
    texts: list[str] = per_item()
    finish_reasons: list[str] = per_item()
    policy_version: int = shared()
    token_versions: torch.Tensor | None = per_token("lens", torch.long, fill=-1)

    @classmethod
    def of(cls, samples: list[Completion], version: int) -> PackedTurns:
        """One sample per turn, packed; ``version``: the version served when the batch ended."""
        return cls.build(policy_version=version, **_sample_columns(samples))

    def unpack(self) -> list[TurnResult]:
        versions = self.pieces("token_versions") if self.token_versions is not None else [None] * len(self)
        return [
            TurnResult(tokens, logprobs, text, oldest_version(stamps, self.policy_version), reason, stamps)
            for tokens, logprobs, text, reason, stamps in zip(
                self.pieces("token_ids"), self.pieces("logprobs"), self.texts, self.finish_reasons, versions
            )
        ]


def _sample_columns(samples: list[Completion]) -> dict[str, list]:
    """The per-sample columns both batches carry, sample after sample."""
    return {
        "token_ids": [c.token_ids for c in samples],
        "logprobs": [c.logprobs for c in samples],
        "texts": [c.text for c in samples],
        "finish_reasons": [c.finish_reason for c in samples],
        "token_versions": [c.versions() for c in samples],
    }
