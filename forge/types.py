"""Payloads shared by the RL roles.

Token ids and logprobs are tensors so that they cross process boundaries as tensors
(``torch.save`` under Monarch), never as Python lists of floats.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass
class Prompt:
    """One task instance: the text the policy sees and what a reward function checks."""

    prompt_id: str
    text: str
    answer: str
    meta: dict = field(default_factory=dict)


@dataclass
class Completion:
    """One sampled response to a prompt, with what the trainer needs to correct off-policy data."""

    prompt_ids: torch.Tensor  # int64 [P]
    token_ids: torch.Tensor  # int64 [T], the sampled response tokens
    logprobs: torch.Tensor  # float32 [T], behaviour logprob of each sampled token
    text: str
    policy_version: int
    finish_reason: str = "stop"


@dataclass
class Group:
    """``group_size`` completions of the same prompt: GRPO normalises rewards within it."""

    prompt: Prompt
    completions: list[Completion]

    @property
    def policy_version(self) -> int:
        return min(c.policy_version for c in self.completions)


@dataclass
class PackedGroup:
    """One prompt's completions in flat tensors: what ``Policy.generate`` hands each caller.

    The same questions as ``Group`` (``prompt``, ``completions``, ``policy_version``), plus the
    flat fields that the rollouts turn into an ``EpisodeBatch`` with a few tensor operations per
    group instead of a dozen per completion (the controller's cost per sequence; section 17 of
    ``docs/benchmarks.md``). ``completions`` is made on first use only.
    """

    prompt: Prompt
    prompt_ids: torch.Tensor  # int64 [P], shared by every completion
    token_ids: torch.Tensor  # int64 [sum T], completion after completion
    logprobs: torch.Tensor  # float32 [sum T]
    response_lens: list[int]
    texts: list[str]
    finish_reasons: list[str]
    policy_version: int

    def __len__(self) -> int:
        return len(self.response_lens)

    @classmethod
    def of(cls, group: Group | PackedGroup) -> PackedGroup:
        """``group`` packed (a ``Group`` from a policy of the user's own), or as it is."""
        if isinstance(group, PackedGroup):
            return group
        completions = group.completions
        if not completions:  # packed as it is: the caller's count check names the policy
            empty = torch.zeros(0, dtype=torch.long)
            return cls(group.prompt, empty, empty, torch.zeros(0), [], [], [], 0)
        return cls(
            prompt=group.prompt,
            prompt_ids=completions[0].prompt_ids,
            token_ids=torch.cat([c.token_ids for c in completions]),
            logprobs=torch.cat([c.logprobs for c in completions]),
            response_lens=[int(c.token_ids.numel()) for c in completions],
            texts=[c.text for c in completions],
            finish_reasons=[c.finish_reason for c in completions],
            policy_version=group.policy_version,
        )

    @functools.cached_property
    def completions(self) -> list[Completion]:
        from forge.controller.wire import split_for_wire

        tokens = split_for_wire(self.token_ids, self.response_lens)
        logprobs = split_for_wire(self.logprobs, self.response_lens)
        return [
            Completion(self.prompt_ids, t, lp, text, self.policy_version, reason)
            for t, lp, text, reason in zip(tokens, logprobs, self.texts, self.finish_reasons)
        ]


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


def _split(flat: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """Per-item pieces that may each be sent on alone (``forge.controller.wire.split_for_wire``)."""
    from forge.controller.wire import split_for_wire

    return split_for_wire(flat, lengths.tolist())


@dataclass
class EpisodeBatch:
    """Many episodes packed into flat tensors: the form in which episodes travel.

    Monarch serialises every tensor of a message separately, at a fixed cost per tensor (send
    and receive; ``docs/benchmarks.md``), so 128 ``Episode`` objects are 512 tensors per hop;
    packed, the same episodes are ten tensors. ``pack``/``unpack`` convert; ``concat`` joins batches (e.g. the
    groups of one training step). Per-token fields are concatenated in episode order and split
    by ``prompt_lens``/``response_lens``.
    """

    group_ids: list[str]
    prompt_ids: torch.Tensor  # int64 [sum P]
    prompt_lens: torch.Tensor  # int64 [B]
    response_ids: torch.Tensor  # int64 [sum T]
    response_lens: torch.Tensor  # int64 [B]
    behaviour_logprobs: torch.Tensor  # float32 [sum T]
    ref_logprobs: torch.Tensor  # float32 [sum T]
    rewards: torch.Tensor  # float32 [B]
    advantages: torch.Tensor  # float32 [B]
    policy_versions: torch.Tensor  # int64 [B]
    loss_mask: torch.Tensor | None = None  # bool [sum T]; None: every response token is trained
    finish_reasons: list[str] | None = None  # [B]; None: all "stop"

    def __len__(self) -> int:
        return len(self.group_ids)

    @property
    def policy_version(self) -> int:
        """The oldest episode's policy version."""
        return int(self.policy_versions.min())

    @classmethod
    def pack(cls, episodes: list[Episode]) -> EpisodeBatch:
        if not episodes:
            raise ValueError("EpisodeBatch.pack needs at least one episode")
        return cls(
            group_ids=[e.group_id for e in episodes],
            prompt_ids=torch.cat([e.prompt_ids.long() for e in episodes]),
            prompt_lens=torch.tensor([e.prompt_ids.numel() for e in episodes], dtype=torch.long),
            response_ids=torch.cat([e.response_ids.long() for e in episodes]),
            response_lens=torch.tensor([e.response_ids.numel() for e in episodes], dtype=torch.long),
            behaviour_logprobs=torch.cat([e.behaviour_logprobs.float() for e in episodes]),
            ref_logprobs=torch.cat([e.ref_logprobs.float() for e in episodes]),
            rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float32),
            advantages=torch.tensor([e.advantage for e in episodes], dtype=torch.float32),
            policy_versions=torch.tensor([e.policy_version for e in episodes], dtype=torch.long),
            loss_mask=_joined_masks([e.loss_mask for e in episodes], [e.response_ids.numel() for e in episodes]),
            finish_reasons=[e.finish_reason for e in episodes],
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
        )

    @classmethod
    def concat(cls, batches: list[EpisodeBatch]) -> EpisodeBatch:
        if not batches:
            raise ValueError("EpisodeBatch.concat needs at least one batch")
        cat = lambda name: torch.cat([getattr(b, name) for b in batches])  # noqa: E731
        return cls(
            group_ids=[g for b in batches for g in b.group_ids],
            **{
                name: cat(name)
                for name in (
                    "prompt_ids",
                    "prompt_lens",
                    "response_ids",
                    "response_lens",
                    "behaviour_logprobs",
                    "ref_logprobs",
                    "rewards",
                    "advantages",
                    "policy_versions",
                )
            },
            loss_mask=_joined_masks([b.loss_mask for b in batches], [int(b.response_lens.sum()) for b in batches]),
            finish_reasons=[r for b in batches for r in (b.finish_reasons or ["stop"] * len(b))],
        )

    def split(self, sizes: list[int]) -> list[EpisodeBatch]:
        """Consecutive batches of ``sizes`` episodes each (the inverse of ``concat``); each piece
        can be sent on alone without carrying the others' storage (``forge.controller.wire.for_wire``:
        views where the fast tensor path sends only a view's elements, else copies)."""
        from forge.controller.wire import for_wire

        if any(n < 1 for n in sizes) or sum(sizes) != len(self):
            raise ValueError(f"split sizes {sizes} must be positive and add up to the batch's {len(self)} episodes")
        bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
        prompt_at = torch.cat([torch.zeros(1, dtype=torch.long), self.prompt_lens.cumsum(0)]).tolist()
        response_at = torch.cat([torch.zeros(1, dtype=torch.long), self.response_lens.cumsum(0)]).tolist()
        pieces = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            p0, p1, r0, r1 = prompt_at[a], prompt_at[b], response_at[a], response_at[b]
            pieces.append(
                EpisodeBatch(
                    group_ids=self.group_ids[a:b],
                    prompt_ids=for_wire(self.prompt_ids[p0:p1]),
                    prompt_lens=for_wire(self.prompt_lens[a:b]),
                    response_ids=for_wire(self.response_ids[r0:r1]),
                    response_lens=for_wire(self.response_lens[a:b]),
                    behaviour_logprobs=for_wire(self.behaviour_logprobs[r0:r1]),
                    ref_logprobs=for_wire(self.ref_logprobs[r0:r1]),
                    rewards=for_wire(self.rewards[a:b]),
                    advantages=for_wire(self.advantages[a:b]),
                    policy_versions=for_wire(self.policy_versions[a:b]),
                    loss_mask=for_wire(self.loss_mask[r0:r1]) if self.loss_mask is not None else None,
                    finish_reasons=self.finish_reasons[a:b] if self.finish_reasons is not None else None,
                )
            )
        return pieces

    def unpack(self) -> list[Episode]:
        prompts = _split(self.prompt_ids, self.prompt_lens)
        responses = _split(self.response_ids, self.response_lens)
        behaviour = _split(self.behaviour_logprobs, self.response_lens)
        reference = _split(self.ref_logprobs, self.response_lens)
        masks = _split(self.loss_mask, self.response_lens) if self.loss_mask is not None else [None] * len(self)
        reasons = self.finish_reasons or ["stop"] * len(self)
        return [
            Episode(
                group_id=self.group_ids[i],
                prompt_ids=prompts[i],
                response_ids=responses[i],
                behaviour_logprobs=behaviour[i],
                ref_logprobs=reference[i],
                reward=float(self.rewards[i]),
                advantage=float(self.advantages[i]),
                policy_version=int(self.policy_versions[i]),
                loss_mask=masks[i],
                finish_reason=reasons[i],
            )
            for i in range(len(self))
        ]


@dataclass
class EpisodeGroups:
    """Several groups (each an ``EpisodeBatch``) as one batch and each group's size: how a list
    of groups crosses a process. Sent as a list, every group costs Monarch its ten tensors (64
    groups: 640 tensors, most of the controller's CPU in a tiny run); packed, the list costs ten.
    """

    batch: EpisodeBatch
    sizes: list[int]

    @classmethod
    def pack(cls, groups: list[EpisodeBatch]) -> EpisodeGroups:
        return cls(EpisodeBatch.concat(groups), [len(g) for g in groups])

    def unpack(self) -> list[EpisodeBatch]:
        return self.batch.split(self.sizes)


def _joined_masks(masks: list[torch.Tensor | None], lengths: list[int]) -> torch.Tensor | None:
    """One flat loss mask for pieces of these lengths (all-true where a piece has none); None
    if no piece has one, so single-turn batches carry no extra tensor."""
    if all(m is None for m in masks):
        return None
    return torch.cat([m.bool() if m is not None else torch.ones(n, dtype=torch.bool) for m, n in zip(masks, lengths)])


@dataclass(frozen=True)
class SampleRequest:
    """``n`` samples of one prompt at sampling settings of the caller's own (evaluation: greedy
    with ``temperature=0``, or ``n`` samples for pass@n), whatever the policy's training settings."""

    prompt: Prompt
    n: int = 1
    temperature: float = 0.0
    max_tokens: int = 16

    @property
    def settings(self) -> tuple[int, float, int]:
        """What must be equal for requests to share one engine call: ``(n, temperature, max_tokens)``."""
        return self.n, self.temperature, self.max_tokens


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
    finish_reason: str = "stop"


@dataclass
class SFTExample:
    """One supervised example as token ids: the prompt (not trained) and the answer (trained)."""

    prompt_ids: torch.Tensor  # int64 [P]
    answer_ids: torch.Tensor  # int64 [A], the target, ending with the end-of-answer token


@dataclass
class SFTBatch:
    """Many ``SFTExample``s in four flat tensors, the form in which a step's examples travel to the
    trainer (one tensor per field, not two per example: see ``EpisodeBatch``)."""

    prompt_ids: torch.Tensor  # int64 [sum P]
    prompt_lens: torch.Tensor  # int64 [B]
    answer_ids: torch.Tensor  # int64 [sum A]
    answer_lens: torch.Tensor  # int64 [B]

    def __len__(self) -> int:
        return int(self.prompt_lens.numel())

    @classmethod
    def pack(cls, examples: list[SFTExample]) -> SFTBatch:
        if not examples:
            raise ValueError("SFTBatch.pack needs at least one example")
        return cls(
            prompt_ids=torch.cat([e.prompt_ids.long() for e in examples]),
            prompt_lens=torch.tensor([e.prompt_ids.numel() for e in examples], dtype=torch.long),
            answer_ids=torch.cat([e.answer_ids.long() for e in examples]),
            answer_lens=torch.tensor([e.answer_ids.numel() for e in examples], dtype=torch.long),
        )

    def unpack(self) -> list[SFTExample]:
        return [
            SFTExample(p, a)
            for p, a in zip(_split(self.prompt_ids, self.prompt_lens), _split(self.answer_ids, self.answer_lens))
        ]
