"""``Policy``: the vLLM sampler as a service; prompts in, groups of completions out.

Callers send one ``Prompt`` each::

    policy = await Policy.options(endpoint_routers={"generate": "key_affinity"}).as_service(cfg)
    group = await policy.generate.route(prompt, key=prompt_key(prompt))

The replica prebatches concurrent prompts, and ``PolicyConfig.engine_mode`` says how a batch
reaches vLLM: ``"batched"`` (the default) makes **one** ``VllmEngine.generate`` call, where vLLM
batches prompts x ``group_size`` samples itself; ``"async"`` feeds ``AsyncVllmEngine`` (vLLM's
``AsyncLLM``) one request per prompt, all in flight at once. Batched is faster for the GRPO
app's batches on CPU at every batch size measured (``benchmarks/policy_engine.py``; figures in
``docs/benchmarks.md``). Every completion carries its prompt/response token ids,
the behaviour logprob of each sampled token (``processed_logprobs``: after temperature, what
the trainer computes) and the policy version it was sampled with.

``update_weights(state_dict, version)`` loads new weights into the running engine in place. With
``PolicyConfig.lora`` (a LoRA trainer) vLLM serves adapters instead: each version is an adapter
folder loaded beside the base, which is never reloaded (``forge.generation.lora``).
The sampling endpoints are concurrent, so an update can reach the replica while it generates.
``PolicyConfig.weight_updates`` says what then happens: ``drain`` (the default) holds new calls,
waits for the generation in flight to finish, loads, and lets them in, so no sequence spans two
versions; ``in_flight`` loads between
two engine steps (``VllmEngine.generate_async``) and the sequences in flight go on with the new
weights, each token stamped with the version that sampled it (``Completion.token_versions``);
with LoRA the sequences in flight finish on the adapter they started with and new ones start on
the new adapter (vLLM binds a request to its adapter), so nothing waits either.
What each update cost the engine is measured from its own step times and recorded as metrics
(``policy/update_stall_s``, ``policy/update_hold_s``, ``policy/engine_busy_s``).

Routing: ``prompt_key`` + ``key_affinity`` send a prompt (and any retry of it) to the replica
that owns it by consistent hashing, where its prefix may still be cached. The key only routes:
on the replica every prompt shares ``generate``'s one batch queue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from forge.actors.policy_batches import PackedGroups, PackedTurns
from forge.actors.policy_streams import EarlyCancels, StreamSender, aborted_samples
from forge.controller import Batching, ForgeActor, endpoint
from forge.generation.adapter_inbox import AdapterInbox
from forge.generation.drain_gate import DrainGate
from forge.generation.engine_steps import EngineCounters
from forge.generation.lora import serving_rank
from forge.models.lora import LoraSettings
from forge.observability import record_metric
from forge.types import Completion, PackedGroup, Prompt, SampleRequest, TurnRequest, TurnResult

__all__ = [
    "PackedGroups",
    "PackedTurns",
    "Policy",
    "PolicyConfig",
    "PolicySettings",
    "prompt_key",
    "prompt_seed",
]

logger = logging.getLogger("forge.policy")


def prompt_seed(prompt_id: str, version: int) -> int:
    """The sampling seed of ``prompt_id`` on weights ``version`` (``PolicySettings.prompt_seeds``):
    a stable hash (not Python's per-process ``hash``), the same in every process and run."""
    digest = hashlib.blake2b(f"{prompt_id}@{version}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)


ENGINE_MODES = ("batched", "async")
WEIGHT_UPDATES = ("drain", "in_flight")


@dataclass(kw_only=True)
class PolicySettings:
    """How the policy's vLLM engine samples and runs: what a user tunes (an app's config embeds it)."""

    max_tokens: int = 16
    """Most response tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature; the trainer and reference use the same one for their logprobs."""
    top_p: float = 1.0
    """Nucleus sampling; keep 1.0 unless the trainer applies the same mask."""
    stop: list[str] | None = None
    """Extra stop strings (the tokenizer's EOS always stops)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that also end a completion (kept as its last token), e.g. Qwen's ``<|im_end|>``
    (151645): a ``-Base`` checkpoint's EOS list lacks it, and it writes a made-up next turn."""
    max_model_len: int = 256
    """Longest prompt + response the engine accepts."""
    dtype: str = "float32"
    """Engine weights dtype (``bfloat16`` on GPUs)."""
    kv_cache_bytes: int = 64 << 20
    """KV cache size, allocated in full at start."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra ``vllm.LLM`` / ``AsyncEngineArgs`` arguments (e.g. ``gpu_memory_utilization``)."""
    engine_mode: str = "batched"
    """How a batch reaches vLLM: ``batched``, one ``LLM.generate`` call for the whole batch
    (``VllmEngine``, faster on CPU); ``async``, one ``AsyncLLM`` request per prompt, concurrently
    (``AsyncVllmEngine``)."""
    prompt_seeds: bool = False
    """Seed each prompt's samples from the prompt itself (its ``prompt_id`` and the version of the
    weights sampled) instead of the engine's one stream: the same prompt on the same weights then
    draws the same samples whichever batch, replica or other adapters it is served with, so two
    runs with the same seeds sample alike (``prompt_seed``). vLLM then keeps a generator per
    request, which samples large batches more slowly."""
    max_lora_rank: int = 0
    """With a LoRA trainer: the largest adapter rank vLLM serves (one of vLLM's accepted values,
    ``forge.generation.lora.VLLM_LORA_RANKS``); 0: the smallest of them that holds the trainer's
    rank."""

    keep_kv_on_update: bool = False
    """With in-flight weight updates: keep the KV that the old weights computed (the sequences in
    flight and the prefix cache) instead of recomputing it on the new weights. Cheaper; the
    tokens sampled after the update then saw old-weight KV for their prefix."""

    def __post_init__(self) -> None:
        if self.engine_mode not in ENGINE_MODES:
            raise ValueError(f"engine_mode must be one of {ENGINE_MODES}, got {self.engine_mode!r}")
        if self.keep_kv_on_update and self.engine_mode != "batched":
            raise ValueError(
                f"keep_kv_on_update needs engine_mode 'batched' (its updates land between engine steps); "
                f"the {self.engine_mode!r} engine drains before every update"
            )


@dataclass(kw_only=True)
class PolicyConfig(PolicySettings):
    """Everything the policy needs: its settings plus what the run decides (model, group size, seed)."""

    model_path: str
    """Hugging Face checkpoint folder (safetensors + tokenizer)."""
    group_size: int = 8
    """Completions sampled per prompt (GRPO's G)."""
    seed: int = 0
    """Seed of the engine's sampler."""
    weights_dir: str | None = None
    """The only folder ``update_weights`` loads weight files from (the GRPO app's run folder): a
    path outside it, or a file of another user, is refused. None: any safetensors path."""
    lora: LoraSettings | None = None
    """The trainer's adapter (``trainer.lora``): vLLM serves adapters over the base and every
    ``update_weights`` is an adapter (``forge.generation.lora``). None: full weights."""
    weight_updates: str = "drain"
    """``drain``: ``update_weights`` waits for the generation in flight to finish; ``in_flight``:
    it loads between two engine steps and the sequences in flight go on with the new weights
    (the app's ``weight_sync.mode``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_updates not in WEIGHT_UPDATES:
            raise ValueError(f"weight_updates must be one of {WEIGHT_UPDATES}, got {self.weight_updates!r}")
        if self.weight_updates == "in_flight" and self.engine_mode != "batched":
            raise ValueError(
                f"in-flight weight updates need engine_mode 'batched', got engine_mode {self.engine_mode!r}"
            )
        if self.lora is not None:
            serving_rank(self.lora.rank, self.max_lora_rank)  # a ValueError naming both ranks
            if self.engine_mode != "batched":
                raise ValueError(
                    f"a LoRA policy needs engine_mode 'batched' (adapters are served by VllmEngine), "
                    f"got {self.engine_mode!r}"
                )


def prompt_key(prompt: Prompt) -> str:
    """The routing key of a prompt: its text (equal prompts meet on one replica)."""
    return prompt.text


class Policy(ForgeActor):
    """vLLM engine behind a batched ``generate`` endpoint and an in-place ``update_weights``."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.engine: Any = None  # forge.generation.VllmEngine or AsyncVllmEngine, made in setup
        self._adapters: AdapterInbox | None = None  # LoRA: where adapters sent as messages are written
        self._gate = DrainGate()  # generate/sample/turn calls in flight (their endpoints are concurrent)
        self._early_cancels = EarlyCancels()  # cancels that came before their request
        self._updates: list[tuple[float, float, int]] = []  # (arrived, loaded, version), time.monotonic()

    @endpoint
    async def setup(self) -> None:
        from forge.generation import AsyncVllmEngine, VllmEngine

        cfg = self.config
        engine_cls = {"batched": VllmEngine, "async": AsyncVllmEngine}[cfg.engine_mode]
        lora = {}
        if cfg.lora is not None:
            lora = {"max_lora_rank": serving_rank(cfg.lora.rank, cfg.max_lora_rank)}
            self._adapters = AdapterInbox(cfg.lora, cfg.model_path, cfg.weights_dir)
        self.engine = await _settle(
            engine_cls.create(
                cfg.model_path,
                max_model_len=cfg.max_model_len,
                seed=cfg.seed,
                dtype=cfg.dtype,
                kv_cache_bytes=cfg.kv_cache_bytes,
                **lora,
                **cfg.engine_kwargs,
            )
        )

    @staticmethod
    def unpack_groups(packed: PackedGroups, n: int) -> list[PackedGroup]:
        """``generate``'s debatch: the packed batch -> one ``PackedGroup`` per caller."""
        return _unpacked(packed, n, "Policy.generate", "groups", "prompts")

    @endpoint(batch=Batching(max_size=256, max_wait_s=0.002, debatch="unpack_groups"), concurrent=True)
    async def generate(self, prompts: list[Prompt]) -> PackedGroups:
        """``group_size`` completions of each prompt (one engine call or one request per prompt,
        by ``engine_mode``).

        Returns the batch packed (``PackedGroups``); through the service each caller gets its
        own ``PackedGroup``. Called directly on an actor, use ``.unpack()``.
        """
        cfg = self.config
        seeds = self.sample_seeds(prompts, self.engine.version)
        outputs = await self._sample([p.text for p in prompts], cfg.group_size, "policy/batch_prompts", seed=seeds)
        finished = [c.finish_reason for group in outputs for c in group]
        # Cut at max_tokens: scored and (unless trainer.mask_truncated) trained as if finished.
        record_metric("policy/truncated_fraction", finished.count("length") / max(len(finished), 1))
        record_metric("policy/tokens", sum(int(c.token_ids.numel()) for group in outputs for c in group), "sum")
        return PackedGroups.pack(prompts, outputs, self.engine.version)

    @endpoint(
        batch=Batching(max_size=256, max_wait_s=0.002, key=lambda r: r.settings, debatch="unpack_groups"),
        concurrent=True,
    )
    async def sample(self, requests: list[SampleRequest]) -> PackedGroups:
        """``n`` completions of each request's prompt at its own settings (one engine call; a
        batch holds requests of equal ``SampleRequest.settings``): held-out evaluation beside
        training, or the OpenAI front door, on the weights being served. Through the service each
        caller gets a ``PackedGroup`` of ``n`` completions."""
        version = self.engine.version
        outputs = await self._sample_requests(requests, version)
        return PackedGroups.pack([r.prompt for r in requests], outputs, version)

    async def _sample_requests(
        self, requests: list[SampleRequest], version: int, adapter: Any = None
    ) -> list[list[Completion]]:
        """Each request's completions at its own settings: one engine call per distinct
        ``settings`` in the batch, each request seeded by its own ``seed`` if it has one."""
        by_settings: dict[tuple, list[int]] = {}
        outputs: list[Any] = [None] * len(requests)
        for i, request in enumerate(requests):
            if self._early_cancels.take(request.request_id):  # its client left before it got here
                outputs[i] = aborted_samples(request, version)
            else:
                by_settings.setdefault(request.settings, []).append(i)
        for (n, temperature, max_tokens, top_p, stop, top_logprobs), indices in by_settings.items():
            chosen = [requests[i] for i in indices]
            prompts = [r.prompt for r in chosen]
            policy_seeds = self.sample_seeds(prompts, version) or [None] * len(chosen)
            seeds = [r.seed if r.seed is not None else s for r, s in zip(chosen, policy_seeds)]
            sampled = await self._sample(
                [r.engine_input for r in chosen],
                n,
                "policy/sample_batch",
                temperature=temperature,
                max_tokens=max_tokens,
                top_p=top_p,
                stop=list(stop) if stop else None,
                adapter=adapter,
                seed=None if all(s is None for s in seeds) else seeds,
                **self._streams_and_tags(chosen),
                **({"top_logprobs": top_logprobs} if top_logprobs else {}),
            )
            for i, completions in zip(indices, sampled):
                outputs[i] = completions
        return outputs

    def _streams_and_tags(self, requests: list[SampleRequest]) -> dict[str, Any]:
        """The engine's ``watchers`` and ``tags`` for requests that stream or may be cancelled
        (none: nothing to pass). The async engine does neither: a streamed request is refused
        there, and a running one cannot be cancelled (one that has not started still can)."""
        streamed = [StreamSender(r.stream_to, r.n) if r.stream_to is not None else None for r in requests]
        tags = [r.request_id for r in requests]
        if not hasattr(self.engine, "cancel"):
            if any(w is not None for w in streamed):
                raise ValueError(
                    f"streamed requests need policy engine_mode 'batched', not {self.config.engine_mode!r}"
                )
            return {}
        if all(w is None for w in streamed) and all(t is None for t in tags):
            return {}
        return {"watchers": streamed, "tags": tags}

    @endpoint
    async def cancel(self, request_id: str) -> bool:
        """End the request ``request_id`` (``SampleRequest.request_id``) on this replica: at once if
        it is generating (it returns the tokens it has, ``finish_reason`` "abort"), or as it
        arrives. True if it was generating here."""
        if self.engine is not None and hasattr(self.engine, "cancel") and self.engine.cancel(request_id):
            return True
        self._early_cancels.add(request_id)
        return False

    @endpoint
    async def engine_counters(self) -> dict[str, int]:
        """What the engine did since it started (sums): requests, prompt tokens and how many of them
        the prefix cache held (``computed_prompt_tokens``: the prefill it did), generated tokens,
        cancels. The batched engine only (zeros for the async one)."""
        steps = self._steps()
        counters = steps.counters if steps is not None else EngineCounters()
        return {**dataclasses.asdict(counters), "computed_prompt_tokens": counters.computed_prompt_tokens}

    @staticmethod
    def unpack_turns(packed: PackedTurns, n: int) -> list[TurnResult]:
        """``generate_turn``'s debatch: the packed batch -> one ``TurnResult`` per caller."""
        return _unpacked(packed, n, "Policy.generate_turn", "turns", "requests")

    @endpoint(batch=Batching(max_size=256, max_wait_s=0.002, debatch="unpack_turns"), concurrent=True)
    async def generate_turn(self, requests: list[TurnRequest]) -> PackedTurns:
        """One sample (``max_tokens`` at most) per multi-turn request, from its token history.

        The history goes to vLLM as token ids, so nothing is re-tokenised; with prefix caching
        the part of it that this replica computed on an earlier turn is not computed again.
        """
        samples = [group[0] for group in await self._sample([r.history_ids for r in requests], 1, "policy/turn_batch")]
        return PackedTurns.of(samples, self.engine.version)

    async def _sample(
        self,
        inputs: list[Any],
        n: int,
        batch_metric: str,
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
        top_p: float | None = None,
        stop: list[str] | None = None,
        adapter: Any = None,
        seed: list[int | None] | None = None,
        **watched: Any,
    ) -> list[list[Completion]]:
        """``n`` samples of each input (text or token ids) at the configured sampling settings
        (or the given ``temperature``/``max_tokens``/``top_p``/``stop``), counted in the batch-size metric
        ``batch_metric`` and ``policy/generate_s``. ``adapter``: a ``ServedAdapter`` to sample
        with (a multi-adapter policy's), instead of the engine's own weights. ``seed``: one per
        input (``prompt_seeds``); None: the engine's own stream. ``watched``: the batched engine's
        ``watchers`` and ``tags`` (``_streams_and_tags``)."""
        cfg = self.config
        t0 = time.perf_counter()
        named = {} if adapter is None else {"adapter": adapter}
        # The batched engine steps with the event loop free between steps: an in-flight update
        # lands there (drain: update_weights waits for the calls in flight first).
        generate = getattr(self.engine, "generate_async", self.engine.generate)
        async with self._gate.calling():
            outputs = await _settle(
                generate(
                    inputs,
                    n=n,
                    temperature=cfg.temperature if temperature is None else temperature,
                    max_tokens=cfg.max_tokens if max_tokens is None else max_tokens,
                    top_p=cfg.top_p if top_p is None else top_p,
                    stop=cfg.stop if stop is None else stop,
                    stop_token_ids=list(cfg.stop_token_ids),
                    seed=seed,
                    **named,
                    **watched,
                )
            )
        seconds = time.perf_counter() - t0
        record_metric(batch_metric, len(inputs))
        record_metric("policy/generate_s", seconds, "sum")
        self._record_engine_time()
        return outputs

    def _record_engine_time(self) -> None:
        """The engine's busy seconds and the update stalls measured since the last record
        (``policy/engine_busy_s``, ``policy/update_stall_s``, ``policy/update_hold_s``, sums;
        ``policy/update_stalls`` counts them): the batched engine's own step times."""
        clock = self._clock()
        if clock is None:
            return
        record_metric("policy/engine_busy_s", clock.take_busy_s(), "sum")
        for stall in clock.take_stalls():
            record_metric("policy/update_stall_s", stall.stall_s, "sum")
            record_metric("policy/update_hold_s", stall.hold_s, "sum")
            record_metric("policy/update_stalls", 1, "sum")

    def _steps(self) -> Any:
        """The batched engine's step loop (``EngineSteps``: its clock, its counters); None for the async engine."""
        return getattr(self.engine, "steps", None)

    def _clock(self) -> Any:
        """The batched engine's ``StepClock``; None for the async engine."""
        steps = self._steps()
        return None if steps is None else steps.clock

    def sample_seeds(self, prompts: list[Prompt], version: int) -> list[int] | None:
        """Each prompt's sampling seed on weights ``version`` with ``prompt_seeds``, else None."""
        if not self.config.prompt_seeds:
            return None
        return [prompt_seed(p.prompt_id, version) for p in prompts]

    @endpoint
    async def prefix_cache_stats(self) -> dict[str, float]:
        """vLLM's own prompt-token counters: ``queries``/``hits`` of the prefix cache (tokens),
        ``prompt_tokens`` and ``prompt_tokens_cached``; and ``kv_cache_tokens``, how many tokens
        the KV cache holds. The counters need ``engine_kwargs.disable_log_stats: false`` (zeros
        otherwise); all need the batched engine."""
        names = {
            "vllm:prefix_cache_queries": "queries",
            "vllm:prefix_cache_hits": "hits",
            "vllm:prompt_tokens": "prompt_tokens",
            "vllm:prompt_tokens_cached": "prompt_tokens_cached",
        }
        out = dict.fromkeys([*names.values(), "kv_cache_tokens"], 0.0)
        llm = getattr(self.engine, "llm", None)
        if llm is None:
            return out
        cache = llm.llm_engine.vllm_config.cache_config  # the capacity the engine found room for
        out["kv_cache_tokens"] = float((cache.num_gpu_blocks or 0) * cache.block_size)
        for metric in llm.get_metrics():
            if metric.name in names:
                out[names[metric.name]] += float(getattr(metric, "value", 0) or 0)
        return out

    @endpoint
    async def update_weights(self, state_dict: Mapping[str, torch.Tensor] | str, version: int) -> int:
        """Load ``state_dict`` (checkpoint names) in place and serve it as ``version``.

        ``state_dict`` may also be the path of a safetensors file (e.g. in ``/dev/shm``) that
        the trainer wrote, which saves a copy through the message layer; a file the trainer has
        reused for a newer version since fails with ``StaleWeightFile``. With
        ``PolicyConfig.weights_dir`` set, a path outside that folder is ``UnsafeWeightFolder``:
        the policy serves only what its own run's trainer wrote. Returns ``version``.
        """
        t0, arrived = time.perf_counter(), time.monotonic()
        draining = self.config.weight_updates == "drain"  # no sequence spans two versions
        async with self._gate.draining() if draining else contextlib.nullcontext():
            await self._load(state_dict, version, arrived)
        seconds = time.perf_counter() - t0
        record_metric("policy/update_weights_s", seconds, "sum")
        self._updates = [*self._updates[-99:], (arrived, time.monotonic(), version)]
        return version

    async def _load(self, state_dict: Mapping[str, torch.Tensor] | str, version: int, arrived: float) -> None:
        """Load one update (see ``update_weights``), timing the engine's stall around it."""
        clock = self._clock()
        if clock is not None:
            clock.open(arrived)
        try:
            await self._load_weights(state_dict, version)
        finally:
            if clock is not None and not self._gate.held and not self.engine.steps.busy:
                clock.close_now()  # nothing waits for a step: the stall ends with the load
            self._record_engine_time()

    async def _load_weights(self, state_dict: Mapping[str, torch.Tensor] | str, version: int) -> None:
        keep = {"keep_kv": True} if self.config.keep_kv_on_update else {}
        if self._adapters is not None:  # LoRA: an adapter folder, or its tensors to write as one
            self.engine.update_adapter(self._adapters.receive(state_dict, version), version)
            self._adapters.loaded()
        elif isinstance(state_dict, str):
            from forge.generation.weight_files import read_weights
            from forge.generation.weight_folder import check_weight_file

            if self.config.weights_dir is not None:
                check_weight_file(state_dict, self.config.weights_dir)
            # Mapped, not copied; the trainer does not rewrite the file until the load is done.
            with read_weights(state_dict, version) as mapped:
                await _settle(self.engine.update_weights(mapped, version, **keep))
        else:
            await _settle(self.engine.update_weights(state_dict, version, **keep))

    @endpoint
    async def update_times(self) -> list[tuple[float, float, int]]:
        """The replica's last 100 updates: when each arrived and when its weights were loaded
        (``time.monotonic()``, one clock for every process of a host), and its version."""
        return list(self._updates)

    @endpoint
    async def in_flight(self) -> int:
        """How many sampling calls (batches) the replica is generating now."""
        return self._gate.in_flight

    @endpoint
    async def version(self) -> int:
        """Policy version of the weights being served."""
        return self.engine.version

    @endpoint
    async def probe(self, prompt_ids: list[int], seed: int = 0) -> tuple[int, list[int], list[float]]:
        """The version served and one sample of ``prompt_ids`` (``seed``; the run's sampling
        settings): its tokens and their logprobs. The trainer scores the same tokens
        (``Trainer.probe_logprobs``): equal logprobs say the replica serves the trainer's weights."""
        (completions,) = await self._sample([prompt_ids], 1, "policy/probe_batch", seed=[seed])
        (sample,) = completions
        return sample.policy_version, sample.token_ids.tolist(), sample.logprobs.tolist()

    async def __cleanup__(self, exc: BaseException | None) -> None:
        """Monarch's stop hook: shut the engine down so the process can exit at once."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._adapters is not None:
            self._adapters.close()


def _unpacked(packed: Any, n: int, endpoint_name: str, items: str, callers: str) -> list[Any]:
    """A batched endpoint's debatch: the packed result -> one item per caller, checked."""
    out = packed.unpack()
    if len(out) != n:
        raise ValueError(f"{endpoint_name} returned {len(out)} {items} for {n} {callers}")
    return out


async def _settle(result: Any) -> Any:
    """The engine's result: awaited for ``AsyncVllmEngine`` (coroutines), as is for ``VllmEngine``."""
    return await result if inspect.isawaitable(result) else result
