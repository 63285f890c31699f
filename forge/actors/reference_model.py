"""``ReferenceModel``: the frozen initial model, scoring sequences for GRPO's KL term.

Callers send one ``(prompt_ids, response_ids)`` pair each::

    ref_lp = await reference.logprobs.route((completion.prompt_ids, completion.token_ids))

and get back the per-token logprobs of the response (float32 ``[T]``). A caller with a whole
group (one prompt, many responses) sends it as one request instead, so that the controller pays
one request per group, not one per response::

    ref_lps = await reference.logprobs_groups.route(ResponseGroup(prompt_ids, response_ids, response_lens))

and gets the group's logprobs flat, response after response. The service prebatches
pairs by *length bucket* (the ``Batching`` key), so a batch holds sequences of similar length
and its right padding stays small; one forward pass scores the whole batch. A batch holds at
most ``TOKEN_BUDGET`` tokens (``Batching(size_fn=pair_tokens)``), not a number of sequences:
memory grows with tokens, and 64 truncated 700-token responses in one pass would not fit a GPU.
Logits are computed for response tokens only, in chunks (``forge.models.padded_token_logprobs``).
Each batch records ``reference/padding_fraction`` (pad tokens / all tokens in the padded batch) and
``reference/batch_size`` with ``forge.observability.record_metric``; the controller collects
them once a step with ``drain_metrics()``.

The logprobs use the sampler's temperature (``log_softmax(logits / T)``), like the trainer's
and vLLM's processed logprobs, so the k3 KL compares like with like.

With ``procs=N`` a replica is one SPMD mesh, like the trainer (``forge.distributed``): the frozen
model is sharded with FSDP2 per decoder layer (each rank holds about 1/N of it), every rank gets
the batch, scores its share of the pairs in one forward pass and the scores are gathered; rank 0
answers for the replica.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch

from forge.controller import Batching, ForgeActor, endpoint
from forge.distributed import SpmdRank, init_spmd, local_state_bytes, map_shares, shard_model, shutdown_spmd
from forge.models import forward_padding_fraction, sequence_logprobs
from forge.observability import record_metric
from forge.packing import Groups, Packed, per_item, per_token
from forge.wire import split_for_wire

__all__ = [
    "TOKEN_BUDGET",
    "bucket_of",
    "PackedPairs",
    "ReferenceConfig",
    "ReferenceModel",
    "ResponseGroup",
    "group_bucket",
    "group_tokens",
    "length_bucket",
    "pack_response_groups",
    "pair_tokens",
]

TOKEN_BUDGET = 16384
"""Most prompt + response tokens in one reference batch (padding adds under 25%: see buckets)."""

# Lengths up to this share one bucket; above it each bucket spans ~25% more tokens, so a batch
# pads each sequence by less than a quarter of its length.
_BUCKET_BASE = 32
_BUCKET_GROWTH = 1.25


def pair_tokens(pair: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Batching size of a pair: its tokens, prompt + response."""
    return int(pair[0].numel()) + int(pair[1].numel())


def length_bucket(pair: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Batching key of a pair: a geometric bucket of its total length (prompt + response)."""
    return bucket_of(int(pair[0].numel()) + int(pair[1].numel()))


def bucket_of(n: int) -> int:
    """The geometric length bucket of ``n`` tokens."""
    if n <= _BUCKET_BASE:
        return 0
    return 1 + int(math.log(n / _BUCKET_BASE, _BUCKET_GROWTH))


@dataclass
class ResponseGroup:
    """One prompt's ids and its responses flat, as ``logprobs_groups`` takes a group: three
    fields however many responses (what ``PackedGroup`` holds, less what the reference ignores)."""

    prompt_ids: torch.Tensor  # int64 [P]
    response_ids: torch.Tensor  # int64 [sum T]
    response_lens: list[int]

    def __len__(self) -> int:
        return len(self.response_lens)


def group_tokens(group: ResponseGroup) -> int:
    """Batching size of a group: its pairs' tokens, at most the budget. A group larger than one
    forward pass is still one request: the replica splits its batch into passes within the
    budget (``ReferenceModel._score_within_budget``)."""
    return min(TOKEN_BUDGET, len(group) * int(group.prompt_ids.numel()) + sum(group.response_lens))


def group_bucket(group: ResponseGroup) -> int:
    """Batching key of a group: the length bucket of its longest pair (``length_bucket``)."""
    return bucket_of(int(group.prompt_ids.numel()) + max(group.response_lens, default=0))


@dataclass
class PackedPairs(Packed):
    """A batch of (prompt_ids, response_ids) pairs in flat tensors (two tensors, not 2 per pair:
    Monarch serialises each tensor separately). The service packs singletons into it
    (``enbatch``) and splits the flat logprobs back per caller (``debatch``); a batch of whole
    groups is a ``Groups`` of it (``pack_response_groups``)."""

    prompt_ids: torch.Tensor = per_token("prompt_lens", torch.long)
    prompt_lens: list[int] = per_item()
    response_ids: torch.Tensor = per_token("response_lens", torch.long)
    response_lens: list[int] = per_item()

    @classmethod
    def pack(cls, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> PackedPairs:
        return cls.build(prompt_ids=[p for p, _ in pairs], response_ids=[r for _, r in pairs])

    def unpack(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.pieces("prompt_ids"), self.pieces("response_ids")


def pack_response_groups(groups: list[ResponseGroup]) -> Groups[PackedPairs]:
    """Every group's pairs as one ``PackedPairs``, group after group (each group's prompt once
    per response, its responses as they are), and each group's number of responses."""
    pairs = PackedPairs(
        prompt_ids=torch.cat([g.prompt_ids.long().repeat(len(g)) for g in groups]),
        prompt_lens=[int(g.prompt_ids.numel()) for g in groups for _ in range(len(g))],
        response_ids=torch.cat([g.response_ids.long() for g in groups]),
        response_lens=[n for g in groups for n in g.response_lens],
    )
    return Groups(pairs, [len(g) for g in groups])


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
    dist_timeout_s: float = 300.0
    """Longest the ranks of a ``procs > 1`` replica wait for each other."""
    pack_sequences: bool = False
    """Pack each batch's sequences into rows instead of right-padding them to the longest
    (``forge.models.pack_rows``, rows twice the batch's longest sequence): almost no padding is
    computed. Same logprobs to float rounding."""


class ReferenceModel(ForgeActor):
    """Frozen causal LM with a batched, length-bucketed ``logprobs`` endpoint."""

    def __init__(self, config: ReferenceConfig) -> None:
        self.config = config
        self.model: torch.nn.Module | None = None
        self.device = torch.device("cpu")

    @endpoint
    async def setup(self) -> None:
        from transformers import AutoModelForCausalLM

        self.rank: SpmdRank = await init_spmd(timeout_s=self.config.dist_timeout_s)
        self.device = self.rank.device
        dtype = getattr(torch, self.config.dtype)
        model = AutoModelForCausalLM.from_pretrained(self.config.model_path, dtype=dtype)
        self.model = shard_model(model.to(self.device).eval().requires_grad_(False), self.rank)

    @staticmethod
    def pack_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> PackedPairs:
        """``logprobs``' enbatch: the callers' pairs -> one ``PackedPairs``."""
        return PackedPairs.pack(pairs)

    @staticmethod
    def split_logprobs(result: tuple[torch.Tensor, list[int]], n: int) -> list[torch.Tensor]:
        """``logprobs``' debatch: flat logprobs -> one tensor per caller."""
        flat, lengths = result
        if len(lengths) != n:
            raise ValueError(f"ReferenceModel.logprobs returned {len(lengths)} results for {n} pairs")
        return split_for_wire(flat, lengths)

    @staticmethod
    def pack_groups(groups: list[ResponseGroup]) -> Groups[PackedPairs]:
        """``logprobs_groups``' enbatch: the callers' groups -> one ``Groups`` of pairs."""
        return pack_response_groups(groups)

    @staticmethod
    def split_group_logprobs(result: tuple[torch.Tensor, list[int], list[int]], n: int) -> list[torch.Tensor]:
        """``logprobs_groups``' debatch: flat logprobs -> each caller's group's logprobs, flat."""
        flat, lengths, sizes = result
        if len(sizes) != n or sum(sizes) != len(lengths):
            raise ValueError(
                f"ReferenceModel.logprobs_groups returned {len(sizes)} groups of {sum(sizes)} responses and "
                f"{len(lengths)} logprob rows for {n} groups"
            )
        bounds = [0, *itertools.accumulate(sizes)]
        return split_for_wire(flat, [sum(lengths[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])

    @endpoint(
        batch=Batching(
            max_size=TOKEN_BUDGET,
            size_fn=group_tokens,
            max_wait_s=0.002,
            key=group_bucket,
            enbatch="pack_groups",
            debatch="split_group_logprobs",
        )
    )
    async def logprobs_groups(
        self, groups: Groups[PackedPairs] | list[ResponseGroup]
    ) -> tuple[torch.Tensor, list[int], list[int]]:
        """``logprobs`` of whole groups: each item is one prompt's ids and its responses
        (``ResponseGroup``).

        Returns the logprobs flat with the response lengths and each group's size; through the
        service each caller gets its group's logprobs as one flat tensor, response after response.
        """
        if not isinstance(groups, Groups):
            groups = pack_response_groups(groups)
        flat, lengths = self._logprobs(groups.batch)
        return flat, lengths, groups.sizes

    @endpoint(
        batch=Batching(
            max_size=TOKEN_BUDGET,
            size_fn=pair_tokens,
            max_wait_s=0.002,
            key=length_bucket,
            enbatch="pack_pairs",
            debatch="split_logprobs",
        )
    )
    async def logprobs(
        self, pairs: PackedPairs | list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, list[int]]:
        """Per-token logprobs of each response given its prompt, one forward pass per batch.

        Returns them flat with the response lengths; through the service each caller gets its
        own ``[T]`` tensor.
        """
        if not isinstance(pairs, PackedPairs):
            pairs = PackedPairs.pack(pairs)
        return self._logprobs(pairs)

    def _logprobs(self, pairs: PackedPairs) -> tuple[torch.Tensor, list[int]]:
        """One batch's flat logprobs and response lengths, with its metrics recorded."""
        t0 = time.perf_counter()
        prompts, responses = pairs.unpack()
        out = self._score_within_budget(prompts, responses)
        if self.rank.is_main:  # rank 0 answers (and is drained) for the replica
            lengths = [p + r for p, r in zip(pairs.prompt_lens, pairs.response_lens)]
            record_metric("reference/padding_fraction", forward_padding_fraction(lengths, self.config.pack_sequences))
            record_metric("reference/batch_size", len(lengths))
            record_metric("reference/forward_s", time.perf_counter() - t0, "sum")
        return torch.cat(out), pairs.response_lens

    def _score_within_budget(self, prompts: list[torch.Tensor], responses: list[torch.Tensor]) -> list[torch.Tensor]:
        """``_score`` in consecutive passes of at most ``TOKEN_BUDGET`` tokens each (a batch of
        groups may hold more: a group is one request, however long); one pass if it fits."""
        out: list[torch.Tensor] = []
        start, tokens = 0, 0
        for i, (p, r) in enumerate(zip(prompts, responses)):
            n = int(p.numel()) + int(r.numel())
            if i > start and tokens + n > TOKEN_BUDGET:
                out += self._score(prompts[start:i], responses[start:i])
                start, tokens = i, 0
            tokens += n
        if start < len(prompts):
            out += self._score(prompts[start:], responses[start:])
        return out

    def _score(self, prompts: list[torch.Tensor], responses: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every pair's logprobs; on a sharded replica each rank scores a contiguous share."""
        cfg = self.config

        def score(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
            prompts, responses = [p for p, _ in pairs], [r for _, r in pairs]
            return sequence_logprobs(
                self.model, prompts, responses, cfg.temperature, cfg.pad_id, pack=cfg.pack_sequences
            )

        return map_shares(list(zip(prompts, responses)), score, self.rank)

    @endpoint
    async def state_bytes(self) -> int:
        """Bytes of weights this rank holds (its shards)."""
        return local_state_bytes(self.model)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        """Monarch's stop hook: leave the process group."""
        shutdown_spmd()
