"""Payloads shared by the RL roles.

Token ids and logprobs are tensors so that they cross process boundaries as tensors
(``torch.save`` under Monarch), never as Python lists of floats. Batches of them travel packed
(``forge.packing``): ``PackedGroup``, ``EpisodeBatch``, ``SFTBatch`` and ``PreferenceBatch``
declare their fields, and ``Packed`` does the rest.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from forge.packing import Groups, Packed, per_item, per_token, shared

__all__ = [
    "Completion",
    "Episode",
    "EpisodeBatch",
    "Group",
    "Groups",
    "PackedGroup",
    "PreferenceBatch",
    "PreferenceExample",
    "Prompt",
    "QUESTION",
    "SFTBatch",
    "SFTExample",
    "SampleRequest",
    "SampledSoFar",
    "TurnRequest",
    "TurnResult",
]


QUESTION = "question"
"""``Prompt.meta``'s key for the question as the record holds it, before formatting."""


@dataclass
class Prompt:
    """One task instance: the text the policy sees and what a reward function checks."""

    prompt_id: str
    text: str
    answer: str
    meta: dict = field(default_factory=dict)

    @property
    def question(self) -> str:
        """The record's question before the prompt template and chat template made ``text`` of
        it (``meta[QUESTION]``, set where a prompt is formatted); ``text`` if it never was."""
        return self.meta.get(QUESTION, self.text)


def token_versions(stamps: torch.Tensor | None, num_tokens: int, version: int) -> torch.Tensor:
    """int64 [num_tokens]: each token's version, ``stamps`` or, without them, ``version`` throughout."""
    if stamps is not None:
        return stamps
    return torch.full((num_tokens,), version, dtype=torch.long)


def oldest_version(stamps: torch.Tensor | None, otherwise: int) -> int:
    """The version of the oldest token of ``stamps`` (``otherwise`` without any)."""
    if stamps is None or stamps.numel() == 0:
        return otherwise
    return int(stamps.min())


@dataclass
class Completion:
    """One sampled response to a prompt, with what the trainer needs to correct off-policy data."""

    prompt_ids: torch.Tensor  # int64 [P]
    token_ids: torch.Tensor  # int64 [T], the sampled response tokens
    logprobs: torch.Tensor  # float32 [T], behaviour logprob of each sampled token
    text: str
    policy_version: int
    """The version that sampled its oldest token: what ``max_policy_age`` goes by."""
    finish_reason: str = "stop"
    token_versions: torch.Tensor | None = None
    """int64 [T]: the version that sampled each token (a sequence may span a weight update made
    while it was generated); None: every token ``policy_version``'s."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per token, the most likely tokens there and their logprobs, most likely first
    (``SampleRequest.top_logprobs`` of them); None: not asked for."""

    def versions(self) -> torch.Tensor:
        """int64 [T]: each token's version (``token_versions``, or ``policy_version`` throughout)."""
        return token_versions(self.token_versions, self.token_ids.numel(), self.policy_version)


@dataclass
class Group:
    """``group_size`` completions of the same prompt: GRPO normalises rewards within it."""

    prompt: Prompt
    completions: list[Completion]

    @property
    def policy_version(self) -> int:
        return min(c.policy_version for c in self.completions)


@dataclass
class PackedGroup(Packed):
    """One prompt's completions in flat tensors: what ``Policy.generate`` hands each caller.

    The same questions as ``Group`` (``prompt``, ``completions``, ``policy_version``), plus the
    flat fields that the rollouts turn into an ``EpisodeBatch`` with a few tensor operations per
    group instead of a dozen per completion (the controller's cost per sequence; section 17 of
    ``docs/benchmarks.md``). ``completions`` is made on first use only.
    """

    prompt: Prompt = shared()
    prompt_ids: torch.Tensor = shared()  # int64 [P], shared by every completion
    token_ids: torch.Tensor = per_token("response_lens", torch.long)  # completion after completion
    logprobs: torch.Tensor = per_token("response_lens", torch.float32)
    response_lens: list[int] = per_item()
    texts: list[str] = per_item()
    finish_reasons: list[str] = per_item()
    policy_version: int = shared()
    """The oldest token's version, over the group."""
    token_versions: torch.Tensor | None = per_token("response_lens", torch.long, fill=-1)
    """The version that sampled each token; None: all ``policy_version``'s."""
    top_logprobs: list[Any] | None = per_item(fill=None)
    """Each completion's ``Completion.top_logprobs``; None: not asked for."""

    @classmethod
    def of(cls, group: Group | PackedGroup) -> PackedGroup:
        """``group`` packed (a ``Group`` from a policy of the user's own), or as it is."""
        if isinstance(group, PackedGroup):
            return group
        completions = group.completions
        return cls.build(
            prompt=group.prompt,
            # No completions: packed as it is; the caller's count check names the policy.
            prompt_ids=completions[0].prompt_ids if completions else torch.zeros(0, dtype=torch.long),
            token_ids=[c.token_ids for c in completions],
            logprobs=[c.logprobs for c in completions],
            texts=[c.text for c in completions],
            finish_reasons=[c.finish_reason for c in completions],
            policy_version=group.policy_version if completions else 0,
            token_versions=[c.versions() for c in completions],
            top_logprobs=top_logprobs_column(completions),
        )

    def versions(self) -> torch.Tensor:
        """int64, flat like ``token_ids``: each token's version."""
        return token_versions(self.token_versions, self.token_ids.numel(), self.policy_version)

    @functools.cached_property
    def completions(self) -> list[Completion]:
        versions = self.pieces("token_versions") if self.token_versions is not None else [None] * len(self)
        tops = self.top_logprobs if self.top_logprobs is not None else [None] * len(self)
        return [
            Completion(self.prompt_ids, t, lp, text, oldest_version(v, self.policy_version), reason, v, top)
            for t, lp, text, reason, v, top in zip(
                self.pieces("token_ids"), self.pieces("logprobs"), self.texts, self.finish_reasons, versions, tops
            )
        ]


def top_logprobs_column(completions: list[Completion]) -> list[Any] | None:
    """The completions' ``top_logprobs`` as a packed column (None when none has them)."""
    tops = [c.top_logprobs for c in completions]
    return None if all(t is None for t in tops) else tops


@dataclass
class Episode:
    """One completion, scored and ready for a training step."""

    group_id: str
    prompt_ids: torch.Tensor  # int64 [P]
    response_ids: torch.Tensor  # int64 [T]
    behaviour_logprobs: torch.Tensor  # float32 [T]
    ref_logprobs: torch.Tensor  # float32 [T]
    reward: float
    advantage: float
    policy_version: int
    loss_mask: torch.Tensor | None = None
    """bool [T]: the response tokens the loss trains on (a multi-turn episode's sampled tokens,
    not the environment's); None: all of them."""
    finish_reason: str = "stop"
    """Why sampling ended (vLLM's): ``stop`` (EOS, a stop token or string) or ``length`` (cut at
    ``max_tokens``; ``trainer.mask_truncated`` leaves such episodes out of the loss)."""
    token_versions: torch.Tensor | None = None
    """int64 [T]: the version that sampled each response token, -1 for a token no policy sampled
    (an environment's); None: not recorded (every sampled token ``policy_version``'s)."""


@dataclass
class EpisodeBatch(Packed):
    """Many episodes packed into flat tensors: the form in which episodes travel, and the one
    type a trainer step takes (it slices the batch by rank and micro-batch, never unpacking it).

    ``pack``/``unpack`` convert from and to ``Episode``s; ``concat`` joins batches (e.g. the
    groups of one training step), ``split``/``rows`` cut them.
    """

    group_ids: list[str] = per_item()
    prompt_ids: torch.Tensor = per_token("prompt_lens", torch.long)
    prompt_lens: torch.Tensor = per_item(torch.long)
    response_ids: torch.Tensor = per_token("response_lens", torch.long)
    response_lens: torch.Tensor = per_item(torch.long)
    behaviour_logprobs: torch.Tensor = per_token("response_lens", torch.float32)
    ref_logprobs: torch.Tensor = per_token("response_lens", torch.float32)
    rewards: torch.Tensor = per_item(torch.float32)
    advantages: torch.Tensor = per_item(torch.float32)
    policy_versions: torch.Tensor = per_item(torch.long)
    loss_mask: torch.Tensor | None = per_token("response_lens", torch.bool, fill=True)
    """The response tokens the loss trains on; None: every one."""
    finish_reasons: list[str] | None = per_item(fill="stop")
    """None: all ``stop``."""
    token_versions: torch.Tensor | None = per_token("response_lens", torch.long, fill=-1)
    """The version that sampled each response token; -1: none recorded (an environment's token,
    or an episode packed without versions)."""
    token_advantages: torch.Tensor | None = per_token("response_lens", torch.float32, fill=0.0)
    """PPO: each response token's advantage (``forge.losses.ppo.gae``), used instead of
    ``advantages``; None: GRPO's, one per episode."""
    returns: torch.Tensor | None = per_token("response_lens", torch.float32, fill=0.0)
    """PPO: each response token's return, the critic's regression target; None without a critic."""
    values: torch.Tensor | None = per_token("response_lens", torch.float32, fill=0.0)
    """PPO: the critic's value of each response token when ``returns`` were made (value clipping's
    anchor); None without a critic."""

    @property
    def policy_version(self) -> int:
        """The oldest episode's policy version."""
        return int(self.policy_versions.min())

    def token_ages(self, version: int) -> dict[str, float]:
        """How stale the sampled tokens are for a step that trains weights ``version``:
        ``token_age_mean``/``token_age_max`` over the tokens whose version is known (else over
        the episodes' versions), and ``spanning_fraction``, the share of episodes whose sampled
        tokens span more than one version."""
        if self.token_versions is None:
            ages = (version - self.policy_versions).float()
            return {"token_age_mean": float(ages.mean()), "token_age_max": float(ages.max()), "spanning_fraction": 0.0}
        known = self.token_versions >= 0
        if self.loss_mask is not None:
            known &= self.loss_mask
        ages = (version - self.token_versions[known]).float()
        if ages.numel() == 0:
            return {"token_age_mean": 0.0, "token_age_max": 0.0, "spanning_fraction": 0.0}
        spanning = 0
        for versions, mask in zip(self.pieces("token_versions"), torch.split(known, self.response_lens.tolist())):
            seen = versions[mask]
            spanning += int(seen.numel() > 0 and bool(seen.min() != seen.max()))
        return {
            "token_age_mean": float(ages.mean()),
            "token_age_max": float(ages.max()),
            "spanning_fraction": spanning / len(self),
        }

    @classmethod
    def pack(cls, episodes: list[Episode]) -> EpisodeBatch:
        if not episodes:
            raise ValueError("EpisodeBatch.pack needs at least one episode")
        return cls.build(
            group_ids=[e.group_id for e in episodes],
            prompt_ids=[e.prompt_ids for e in episodes],
            response_ids=[e.response_ids for e in episodes],
            behaviour_logprobs=[e.behaviour_logprobs for e in episodes],
            ref_logprobs=[e.ref_logprobs for e in episodes],
            rewards=[e.reward for e in episodes],
            advantages=[e.advantage for e in episodes],
            policy_versions=[e.policy_version for e in episodes],
            loss_mask=[e.loss_mask for e in episodes],
            finish_reasons=[e.finish_reason for e in episodes],
            token_versions=[e.token_versions for e in episodes],
        )

    @classmethod
    def of_group(
        cls,
        group: PackedGroup,
        group_id: str,
        ref_logprobs: torch.Tensor,
        rewards: torch.Tensor,
        advantages: torch.Tensor,
    ) -> EpisodeBatch:
        """One scored group straight from its packed completions (``ref_logprobs`` flat, like
        ``group.logprobs``; ``rewards`` and ``advantages`` one per completion): a few tensor
        operations, whatever the group's size."""
        n = len(group)
        if ref_logprobs.numel() != group.token_ids.numel() or rewards.numel() != n or advantages.numel() != n:
            raise ValueError(
                f"group {group_id}: {n} completions of {group.token_ids.numel()} tokens, but "
                f"{ref_logprobs.numel()} reference logprobs, {rewards.numel()} rewards, {advantages.numel()} advantages"
            )
        prompt_len = int(group.prompt_ids.numel())
        return cls(
            group_ids=[group_id] * n,
            prompt_ids=group.prompt_ids.long().repeat(n),
            prompt_lens=torch.full((n,), prompt_len, dtype=torch.long),
            response_ids=group.token_ids.long(),
            response_lens=torch.tensor(group.response_lens, dtype=torch.long),
            behaviour_logprobs=group.logprobs.float(),
            ref_logprobs=ref_logprobs.float(),
            rewards=rewards.float(),
            advantages=advantages.float(),
            policy_versions=torch.full((n,), group.policy_version, dtype=torch.long),
            finish_reasons=list(group.finish_reasons),
            token_versions=group.versions().long(),
        )

    def unpack(self) -> list[Episode]:
        masks = self.pieces("loss_mask") if self.loss_mask is not None else [None] * len(self)
        reasons = self.finish_reasons or ["stop"] * len(self)
        versions = self.pieces("token_versions") if self.token_versions is not None else [None] * len(self)
        columns = zip(
            self.group_ids,
            self.pieces("prompt_ids"),
            self.pieces("response_ids"),
            self.pieces("behaviour_logprobs"),
            self.pieces("ref_logprobs"),
            self.rewards.tolist(),
            self.advantages.tolist(),
            self.policy_versions.tolist(),
            masks,
            reasons,
            versions,
        )
        return [Episode(*row) for row in columns]


@dataclass(frozen=True)
class SampleRequest:
    """``n`` samples of one prompt at sampling settings of the caller's own (evaluation: greedy
    with ``temperature=0``, or ``n`` samples for pass@n; a client of the OpenAI front door),
    whatever the policy's training settings."""

    prompt: Prompt
    n: int = 1
    temperature: float = 0.0
    max_tokens: int = 16
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    """Stop strings (the text ends before the first one)."""
    seed: int | None = None
    """This request's sampling seed; None: the policy's (``prompt_seeds``, or its engine's stream)."""
    prompt_ids: tuple[int, ...] | None = None
    """The prompt as token ids, sent to the engine as they are (``prompt.text`` is then only a label):
    the front door's session turns, whose history holds the model's own tokens as it sampled them.
    None: the engine tokenises ``prompt.text``."""
    request_id: str | None = None
    """Names the request for ``Policy.cancel`` (unique among the requests in flight); None: it
    cannot be cancelled."""
    stream_to: Any = None
    """A Monarch ``Port`` that receives a ``SampledSoFar`` after each engine step that sampled
    tokens of this request (the batched engine only); the result still carries every token."""
    top_logprobs: int = 0
    """Also return, per sampled token, this many most likely tokens there and their logprobs
    (``Completion.top_logprobs``); 0: only the sampled token's."""

    @property
    def engine_input(self) -> str | list[int]:
        """What the engine samples from: the ids if the request has them, else the text."""
        return self.prompt.text if self.prompt_ids is None else list(self.prompt_ids)

    @property
    def settings(self) -> tuple[int, float, int, float, tuple[str, ...], int]:
        """What must be equal for requests to share one engine call:
        ``(n, temperature, max_tokens, top_p, stop, top_logprobs)``."""
        return self.n, self.temperature, self.max_tokens, self.top_p, self.stop, self.top_logprobs


@dataclass(frozen=True)
class SampledSoFar:
    """A streamed request's progress after one engine step: one sample's new tokens."""

    index: int
    """Which of the request's ``n`` samples."""
    start: int
    """How many of its tokens came before these."""
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """The behaviour logprob of each of ``token_ids``."""
    top_logprobs: tuple[Any, ...] | None = None
    """Per token, the most likely tokens there (``SampleRequest.top_logprobs``); None: not asked for."""


@dataclass
class TurnRequest:
    """One turn of a multi-turn trajectory: the whole token history so far, sent as ids (the
    policy never re-tokenises it), and the session it belongs to."""

    session: str
    history_ids: torch.Tensor  # int64 [H]: the prompt, then every sampled and environment token


@dataclass
class TurnResult:
    """What the policy sampled for one turn, with the behaviour logprob of every token."""

    token_ids: torch.Tensor  # int64 [T]
    logprobs: torch.Tensor  # float32 [T]
    text: str
    policy_version: int
    """The version that sampled its oldest token."""
    finish_reason: str = "stop"
    token_versions: torch.Tensor | None = None
    """int64 [T]: the version that sampled each token; None: all ``policy_version``'s."""

    def versions(self) -> torch.Tensor:
        """int64 [T]: each token's version (``token_versions``, or ``policy_version`` throughout)."""
        return token_versions(self.token_versions, self.token_ids.numel(), self.policy_version)


@dataclass
class SFTExample:
    """One supervised example as token ids: the prompt (not trained) and the answer (trained)."""

    prompt_ids: torch.Tensor  # int64 [P]
    answer_ids: torch.Tensor  # int64 [A], the target, ending with the end-of-answer token


@dataclass
class SFTBatch(Packed):
    """Many ``SFTExample``s in four flat tensors, the form in which a step's examples travel to the
    trainer (one tensor per field, not two per example)."""

    prompt_ids: torch.Tensor = per_token("prompt_lens", torch.long)
    prompt_lens: torch.Tensor = per_item(torch.long)
    answer_ids: torch.Tensor = per_token("answer_lens", torch.long)
    answer_lens: torch.Tensor = per_item(torch.long)

    @classmethod
    def pack(cls, examples: list[SFTExample]) -> SFTBatch:
        if not examples:
            raise ValueError("SFTBatch.pack needs at least one example")
        return cls.build(prompt_ids=[e.prompt_ids for e in examples], answer_ids=[e.answer_ids for e in examples])

    def unpack(self) -> list[SFTExample]:
        return [SFTExample(p, a) for p, a in zip(self.pieces("prompt_ids"), self.pieces("answer_ids"))]


@dataclass
class PreferenceExample:
    """One preference pair as token ids: the prompt, then the chosen and the rejected response
    (each ending with the end-of-answer token, as ``PromptFormat.sft_example`` writes an answer)."""

    prompt_ids: torch.Tensor  # int64 [P]
    chosen_ids: torch.Tensor  # int64 [C]
    rejected_ids: torch.Tensor  # int64 [R]


@dataclass
class PreferenceBatch(Packed):
    """Many ``PreferenceExample``s in flat tensors: what a reward-model or DPO step takes. A pair
    is one item, so slicing the batch by rank and micro-batch keeps each pair's two responses
    together. DPO adds each pair's reference logprobs (summed over the response's tokens)."""

    prompt_ids: torch.Tensor = per_token("prompt_lens", torch.long)
    prompt_lens: torch.Tensor = per_item(torch.long)
    chosen_ids: torch.Tensor = per_token("chosen_lens", torch.long)
    chosen_lens: torch.Tensor = per_item(torch.long)
    rejected_ids: torch.Tensor = per_token("rejected_lens", torch.long)
    rejected_lens: torch.Tensor = per_item(torch.long)
    ref_chosen_logprobs: torch.Tensor | None = per_item(torch.float32, fill=0.0)
    """The reference model's logprob of each chosen response (a sum over its tokens); None: not scored."""
    ref_rejected_logprobs: torch.Tensor | None = per_item(torch.float32, fill=0.0)
    """The same for each rejected response."""

    @classmethod
    def pack(
        cls, examples: list[PreferenceExample], ref_logprobs: list[tuple[float, float]] | None = None
    ) -> PreferenceBatch:
        """The examples packed; ``ref_logprobs``: each pair's ``(chosen, rejected)`` reference
        logprobs (DPO), or None."""
        if not examples:
            raise ValueError("PreferenceBatch.pack needs at least one example")
        if ref_logprobs is not None and len(ref_logprobs) != len(examples):
            raise ValueError(f"{len(examples)} preference examples but {len(ref_logprobs)} reference logprob pairs")
        return cls.build(
            prompt_ids=[e.prompt_ids for e in examples],
            chosen_ids=[e.chosen_ids for e in examples],
            rejected_ids=[e.rejected_ids for e in examples],
            ref_chosen_logprobs=None if ref_logprobs is None else [c for c, _ in ref_logprobs],
            ref_rejected_logprobs=None if ref_logprobs is None else [r for _, r in ref_logprobs],
        )
